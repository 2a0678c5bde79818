"""Verdict parsing (`judge.verdict_parsing`): the issue's cases read both ways, strict mode against an independent
transcription of the reference's reading on ≥ 1,000 seeded random answers per route, and the judge honouring the
mode with its retries."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from mass_ops.judge.evidence import EvidenceCaps, build_bundle
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge
from mass_ops.judge.verdicts import JudgeOutputError, parse_verdict, recorded_verdict
from mass_ops.llm import LLMOutputError, fenced_json_object, strict_json_object, whole_json_object
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling
from mass_ops.llm.response import extract_json_object
from mass_ops.search import driver as search_driver
from mass_ops.stages import rank as rank_stage
from mass_ops.store.schema import CallStatus
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.judge.scripted import open_judged_cycle
from tests.policy_server import ChatRequest, PolicyReply, RequestKind

# -- the reference's reading, transcribed from its code (not from ours) ----------------------------------------------


class _ReferenceVerdict(BaseModel):
    """The reference's verdict model: a literal winner and a rationale of at least one character."""

    winner: Literal["A", "B", "tie"]
    rationale: str = Field(min_length=1)


_REFERENCE_FENCE = r"```(?:json)?\s*(\{.*?\})\s*```"


def _reference_chat_object(raw: str) -> dict[str, Any]:
    """harness_improvement/llm_backend.py: the trimmed text, else the outermost braces, else the first fence."""
    text = raw.strip()
    if not text:
        raise ValueError("empty")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        candidates = []
        start, end = text.find("{"), text.rfind("}")
        if start >= 0 and end > start:
            candidates.append(text[start : end + 1])
        fenced = re.search(_REFERENCE_FENCE, text, flags=re.DOTALL)
        if fenced:
            candidates.append(fenced.group(1))
        value = None
        for candidate in candidates:
            try:
                value = json.loads(candidate)
                break
            except json.JSONDecodeError:
                continue
        if value is None:
            raise ValueError("no candidate parses") from None
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def _reference_anthropic_candidate(raw: str) -> str:
    """evaluation_claudecodex/pairwise_judge.py: the first fence, else the outermost braces, else the text."""
    s = raw.strip()
    if not s:
        return s
    fenced = re.search(_REFERENCE_FENCE, s, flags=re.DOTALL)
    if fenced:
        return fenced.group(1).strip()
    start, end = s.find("{"), s.rfind("}")
    if start != -1 and end != -1 and end > start:
        return s[start : end + 1].strip()
    return s


def _reference(route: str, text: str) -> tuple[str, str] | None:
    """(winner, rationale) as the reference reads `text` on `route`, or None where it fails."""
    try:
        if route == "chat":
            verdict = _ReferenceVerdict.model_validate(_reference_chat_object(text))
        elif route == "responses":
            verdict = _ReferenceVerdict.model_validate_json(text.strip())
        else:
            verdict = _ReferenceVerdict.model_validate_json(_reference_anthropic_candidate(text))
    except (ValueError, ValidationError):
        return None
    return verdict.winner, verdict.rationale


_STRICT_READERS = {"chat": strict_json_object, "responses": whole_json_object, "anthropic": fenced_json_object}


def _ours(route: str, text: str) -> tuple[str, str] | None:
    try:
        verdict = parse_verdict(_STRICT_READERS[route](text), parsing="strict")
    except (LLMOutputError, JudgeOutputError):
        return None
    return verdict.winner, verdict.rationale


def _lenient(text: str) -> tuple[str, str] | None:
    try:
        verdict = parse_verdict(extract_json_object(text), parsing="lenient")
    except (LLMOutputError, JudgeOutputError):
        return None
    return verdict.winner, verdict.rationale


# -- the issue's cases -----------------------------------------------------------------------------------------------

GOOD = '{"winner": "A", "rationale": "A is better."}'
CASES = [
    # (case, answer text, strict (winner, rationale) or None, lenient (winner, rationale) or None)
    ("exact", GOOD, ("A", "A is better."), ("A", "A is better.")),
    ("lower-case a", '{"winner": "a", "rationale": "r"}', None, ("A", "r")),
    ("Tie", '{"winner": "Tie", "rationale": "r"}', None, ("tie", "r")),
    ("padded B", '{"winner": " B ", "rationale": "r"}', None, ("B", "r")),
    ("padded rationale", '{"winner": "B", "rationale": "  kept  "}', ("B", "  kept  "), ("B", "kept")),
    ("whitespace rationale", '{"winner": "tie", "rationale": "   "}', ("tie", "   "), None),
    ("empty rationale", '{"winner": "A", "rationale": ""}', None, None),
    (
        "second fenced block",
        'Draft:\n```json\n{"winner": A}\n```\nFinal:\n```json\n{"winner": "B", "rationale": "r"}\n```',
        None,
        ("B", "r"),
    ),
    (
        "one-line fence before a stray brace",
        'Verdict ```json {"winner": "A", "rationale": "r"} ``` end }',
        ("A", "r"),
        None,
    ),
    ("lone surrogate in rationale", '{"winner": "A", "rationale": "\\ud800"}', None, ("A", "\ud800")),
    ("list of verdicts", f"[{GOOD}]", None, None),
]


@pytest.mark.parametrize(("case", "text", "strict", "lenient"), CASES, ids=[c[0] for c in CASES])
def test_the_issues_cases_read_both_ways(case: str, text: str, strict: Any, lenient: Any) -> None:
    assert _ours("chat", text) == strict
    assert _reference("chat", text) == strict  # the expected strict outcome is the reference's own
    assert _lenient(text) == lenient


# -- strict mode against the transcription on random answers ---------------------------------------------------------

_WINNERS: list[Any] = ["A", "B", "tie"]
_ODD_WINNERS: list[Any] = ["a", "b", "Tie", "TIE", " B ", "A\n", "", None, 1, ["A"]]
_RATIONALES: list[Any] = [
    "B covers more.", "A is better. It tests more.", " padded ", "   ", "\t\n", "emoji 😀", "brace } and { inside",
    "fence ``` inside", 'quote " inside', "é",
]  # fmt: skip
_ODD_RATIONALES: list[Any] = ["", None, 0, ["x"], {"t": "x"}, "lone \ud800 surrogate", "\udc00"]
_PROSE = ["Here is my verdict:", "Verdict", "I weighed {both} sides.", "Done }", "```", "{", "see below", "é"]
_SPACE = ["", " ", "\n", "\n\n", "\t", "\xa0", "\u2003", "\r\n"]


def _document(rng: random.Random) -> str:
    """One JSON-ish verdict document: random keys, values, key order, layout, escapes and defects."""
    items: list[tuple[str, Any]] = []
    if rng.random() < 0.95:
        items.append(("winner", rng.choice(_WINNERS if rng.random() < 0.75 else _ODD_WINNERS)))
    if rng.random() < 0.95:
        items.append(("rationale", rng.choice(_RATIONALES if rng.random() < 0.8 else _ODD_RATIONALES)))
    if rng.random() < 0.3:
        items.append((rng.choice(["confidence", "notes", "winner_reason"]), rng.choice([0.7, "x", None, [1, {}]])))
    if rng.random() < 0.08 and items:  # a duplicate key: the last one wins in both readers
        items.append((items[0][0], rng.choice(_WINNERS + _ODD_WINNERS)))
    rng.shuffle(items)
    ensure_ascii = rng.random() < 0.5
    indent = rng.choice([None, None, 2])
    parts = [
        json.dumps(key, ensure_ascii=ensure_ascii) + ": " + json.dumps(value, ensure_ascii=ensure_ascii)
        for key, value in items
    ]
    if rng.random() < 0.05:
        parts.append('"extra": NaN')
    joiner = ",\n  " if indent else rng.choice([", ", ","])
    text = "{" + ("\n  " if indent else "") + joiner.join(parts) + ("\n" if indent else "") + "}"
    defect = rng.random()
    if defect < 0.04:
        text = text[: rng.randrange(1, len(text))]  # cut off
    elif defect < 0.07:
        text = text.replace('"', "'")  # Python-style quotes
    elif defect < 0.09:
        text = text[:-1] + ",}"  # trailing comma
    elif defect < 0.11:
        text = f"[{text}]"
    return text


def _wrap(rng: random.Random, text: str) -> str:
    """The document inside a random answer: prose, fences of several kinds, other blocks, surrounding space."""
    for _ in range(rng.choice([0, 1, 1, 2])):
        kind = rng.randrange(9)
        if kind == 0:
            text = f"```json\n{text}\n```"
        elif kind == 1:
            text = f"```\n{text}\n```"
        elif kind == 2:
            text = f"```JSON\n{text}\n```"
        elif kind == 3:
            text = f"```json {text} ```"
        elif kind == 4:
            text = f"{rng.choice(_PROSE)}\n{text}"
        elif kind == 5:
            text = f"{text}\n{rng.choice(_PROSE)}"
        elif kind == 6:
            text = f"```json\n{_document(rng)}\n```\n{text}"
        elif kind == 7:
            text = f"{text}\n```json\n{_document(rng)}\n```"
        else:
            text = f"{_document(rng)} {text}"
    return rng.choice(_SPACE) + text + rng.choice(_SPACE)


def _answers(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [_wrap(rng, _document(rng)) for _ in range(count)]


@pytest.mark.parametrize("route", ["chat", "responses", "anthropic"])
def test_strict_mode_reads_random_answers_exactly_as_the_reference(route: str) -> None:
    answers = _answers(2026, 1500)
    mismatches = [(text, _ours(route, text), _reference(route, text)) for text in answers]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert mismatches == [], f"{len(mismatches)} of {len(answers)} differ, first: {mismatches[:3]!r}"
    outcomes = [_reference(route, text) for text in answers]
    accepted = sum(outcome is not None for outcome in outcomes)
    # Both outcomes are well represented: the comparison is not one between two always-failing readers.
    assert 100 <= accepted <= len(answers) - 100
    assert {outcome[0] for outcome in outcomes if outcome} == {"A", "B", "tie"}


def test_the_two_modes_really_differ_on_random_answers() -> None:
    answers = _answers(7, 1000)
    differ = sum(_ours("chat", text) != _lenient(text) for text in answers)
    assert differ > 100


# -- recorded answers and the judge ----------------------------------------------------------------------------------


def test_a_recorded_answer_is_read_under_either_mode() -> None:
    spaced = {"winner": "tie", "rationale": "   "}  # accepted when recorded under strict only
    assert recorded_verdict(spaced, parsing="lenient") == recorded_verdict(spaced, parsing="strict")
    assert recorded_verdict({"winner": " b ", "rationale": "r"}, parsing="strict").winner == "B"
    with pytest.raises(JudgeOutputError):
        recorded_verdict({"winner": "C", "rationale": "r"})
    with pytest.raises(ValueError, match="verdict parsing must be one of"):
        parse_verdict(spaced, parsing="loose")  # type: ignore[arg-type]


def _case(tmp_path: Path, key: str) -> PairwiseCase:
    caps = EvidenceCaps.local("q")
    bundles = []
    for side in ("a", "b"):
        root = tmp_path / side
        root.mkdir(exist_ok=True)
        (root / "research_report.md").write_text(side.upper())
        bundles.append(build_bundle(root, task_id=51, task_text="Study SPY.", location=side, caps=caps))
    return PairwiseCase(CallUnit(key, "judge", 51), 51, "Study SPY.", "alpha", "beta", *bundles, seed=450051)


def _answer_judges_with(inner_loop: InnerLoopEnv, text: str) -> None:
    original = inner_loop.policy.respond

    def respond(request: ChatRequest) -> PolicyReply:
        return PolicyReply(content=text) if request.kind is RequestKind.JUDGE else original(request)

    inner_loop.policy.respond = respond  # type: ignore[method-assign]


LOWER_CASE = 'My verdict: ```json\n{"winner": "a", "rationale": " A is better. "}\n```'
ONE_LINE_FENCE = 'Verdict ```json {"winner": "B", "rationale": "B is better."} ``` end }'
JUDGE_CASES = [
    # (mode, answer, verdict, rationale or the invalid reason's tail, calls)
    ("strict", LOWER_CASE, "invalid", "'winner' must be exactly one of A, B, tie; got 'a')", 3),
    ("lenient", LOWER_CASE, "A", "A is better.", 1),
    ("strict", ONE_LINE_FENCE, "B", "B is better.", 1),  # the strict JSON reading finds the one-line fence
    ("lenient", ONE_LINE_FENCE, "invalid", 'contains no JSON object: \'Verdict ```json {"winner"', 3),
]


@pytest.mark.parametrize(("parsing", "answer", "verdict", "why", "calls"), JUDGE_CASES)
def test_the_judge_honours_the_mode_and_keeps_its_retries(
    inner_loop: InnerLoopEnv, tmp_path: Path, parsing: str, answer: str, verdict: str, why: str, calls: int
) -> None:
    opened = open_judged_cycle(inner_loop, {"verdict_parsing": parsing, "invalid_retries": 2})
    config = opened.config
    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    judge = PairwiseJudge(
        opened.client,
        ledger,
        lambda seed: in_loop_sampling(config, seed),
        invalid_retries=config.judge.invalid_retries,
        verdict_parsing=config.judge.verdict_parsing,
    )
    _answer_judges_with(inner_loop, answer)
    case = _case(tmp_path, "task51/rhi/v1_vs_no_harness")
    outcome = judge.judge(case)
    assert (outcome.verdict, outcome.calls) == (verdict, calls)
    assert why in outcome.rationale
    statuses = [row.status for row in ledger.attempts(case.unit)]
    if verdict == "invalid":
        # Every unusable answer is a recorded attempt, each retry with a fresh derived seed.
        assert statuses == [CallStatus.INVALID] * 3
        assert len({body["seed"] for body in inner_loop.judge_requests()}) == 3
    else:
        assert statuses == [CallStatus.SUCCEEDED] and outcome.rationale == why


def test_a_strict_judge_keeps_a_whitespace_rationale_and_reuses_the_record(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    opened = open_judged_cycle(inner_loop, {"verdict_parsing": "strict", "invalid_retries": 0})
    config = opened.config
    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    judge = PairwiseJudge(opened.client, ledger, lambda seed: in_loop_sampling(config, seed), verdict_parsing="strict")
    _answer_judges_with(inner_loop, '{"winner": "tie", "rationale": "  "}')
    case = _case(tmp_path, "task51/ranking/c1_vs_c2")
    first = judge.judge(case)
    again = judge.judge(case)
    assert (first.verdict, first.rationale, first.calls) == ("tie", "  ", 1)
    assert (again.verdict, again.rationale, again.calls) == ("tie", "  ", 0)
    assert len(inner_loop.judge_requests()) == 1


@pytest.mark.parametrize("stage", ["search", "rank"])
def test_the_judging_stages_build_their_judge_with_the_configured_mode(
    inner_loop: InnerLoopEnv, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    opened = open_judged_cycle(inner_loop, {"verdict_parsing": "strict"})
    seen: list[str] = []

    class Built(Exception):
        """Stops the stage once its judge is built: nothing here is ready to be judged."""

    class Recording(PairwiseJudge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs.get("verdict_parsing", "lenient"))
            raise Built

    module = search_driver if stage == "search" else rank_stage
    monkeypatch.setattr(module, "PairwiseJudge", Recording)
    with pytest.raises(Built):
        if stage == "search":
            search_driver.search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
        else:
            rank_stage.rank_tasks(opened.ctx, client=opened.client)
    assert seen == ["strict"]
