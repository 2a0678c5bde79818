"""The RHI optimizer prompt (MASS_SPEC §3.3 step B): the raw data its templates render, computed as the reference's
``iterate_multi_agent_prompt.py`` computes it. Every sentence, label, marker and separator lives in the templates
``optimizer_system.j2``, ``optimizer_user.j2`` and ``optimizer_parts.j2`` (and the evidence macros of
``evidence.j2``); this module decides which rows, their order, caps, truncation points, de-duplication, the six
checklist buckets, the design diffs and the run-status JSON.

User prompt: 1 the query (task, current design, previous best with its rationale, the v0 root, save rules), 2 the
evidence of the current workspace, 2b execution metadata with the failure notice, 3 the history of verdicts against
the bare reference (scoreboard, takeaways, design diffs), 3b the delta checklist, 4 instructions and schema.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.prompts import PromptSet, shipped_prompts
from mass_ops.workflow import START_MARKER

BEST_RATIONALE_CHARS = 2000
HISTORY_RATIONALE_CHARS = 2400
MAX_TAKEAWAYS = 6
RECENT_DIFFS = 3
RECENT_DIFF_CHARS = 1500
OLDER_DIFF_CHARS = 400
DIFF_CONTEXT_LINES = 1
# The reference's shortener keeps `limit - 3` characters to leave room for its three-character ending; the ending
# itself is the template's (``optimizer_parts.j2``), the room it needs is computation.
TRUNCATION_ROOM = 3
# Characters that end a sentence for the reference's best-design rationale (it appends a period otherwise).
_SENTENCE_END = ".!?\"'"

_TAKEAWAY_CUES = (
    "fail", "fails", "failed", "missing", "inconsistent", "mismatch", "not ", "lack", "weak", "nan", "null", "error",
    "defect", "reproducibility",
)  # fmt: skip
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+")


def _any_of(*phrases: str) -> re.Pattern[str]:
    """A pattern matching any of `phrases` anywhere (substring semantics, as the reference's buckets)."""
    return re.compile("|".join(re.escape(phrase) for phrase in phrases))


# The delta checklist's six buckets, in the reference's order: (id, pattern over the LOWER-CASED rationale). The ids
# are data; optimizer_parts.j2 names each bucket. Plain substrings, as in the reference: "nan" also matches
# "financial" and "test" "latest" — kept, since the counts are what the reference shows.
DELTA_BUCKETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("inconsistency", _any_of("inconsistent", "mismatch", "contradict", "does not match", "conflict")),
    ("missing", _any_of("missing", "absent", "not found", "not present")),
    ("robustness", _any_of("stability", "robustness", "subperiod", "pre_2020", "post_2020")),
    ("null_values", _any_of("nan", "null", "none", "non-standard json")),
    ("reproducibility", _any_of("reproducibility", "not reproducible", "cannot reproduce", "requirements", "pin")),
    ("validation", _any_of("validation", "test", "insufficient evidence", "not proven", "unclear")),
)

# The reference's run_status.json fields in its order (written by runtime/run_episode.sh): the execution metadata
# shows these and no mass-ops addition. Nested objects keep their own reference fields.
STATUS_FIELDS = (
    "started_at", "finished_at", "model", "endpoint", "seed", "qwen_code_version", "exit_code",
    "trace_has_success_result", "failure", "execution_mode", "operational_limits", "hiw",
)  # fmt: skip
_FAILURE_FIELDS = ("subtype", "message", "last_tool_calls_most_recent_first")
_LIMIT_FIELDS = (
    "http_response_timeout_ms", "foreground_shell_timeout_ms", "context_window_tokens",
    "max_tokens_per_model_response",
)  # fmt: skip
_HIW_FIELDS = ("condition", "prompt_source", "client_endpoint", "api_log", "api_requests", "mass", "env_policy")
# Read by the reference's failure notice when a status file carries it (its runner never writes it).
PRIOR_FAILURES = "prior_failures"


def collapse(text: str) -> str:
    """Whitespace runs collapsed to single spaces, surrounding whitespace removed."""
    return " ".join(text.split())


def excerpt(text: str, limit: int) -> dict[str, Any]:
    """The reference shortener as data: `text` collapsed; when longer than `limit`, its first ``limit - 3``
    characters (right-stripped) and ``truncated`` true — the template writes the ending."""
    flat = collapse(text)
    if len(flat) <= limit:
        return {"text": flat, "truncated": False}
    return {"text": flat[: limit - TRUNCATION_ROOM].rstrip(), "truncated": True}


def sentences(text: str) -> list[str]:
    """Non-empty sentences of the whitespace-collapsed `text` (split after ``.``, ``!`` or ``?``)."""
    return [s.strip() for s in _SENTENCE_SPLIT.split(collapse(text)) if s.strip()]


def takeaways(rationale: str, limit: int = MAX_TAKEAWAYS) -> list[str]:
    """Actionable sentences of a rationale: those naming a cue (a failure, a gap, a defect), each once, in order,
    at most `limit`."""
    picks: list[str] = []
    for sentence in sentences(rationale):
        low = sentence.lower()
        if sentence not in picks and any(cue in low for cue in _TAKEAWAY_CUES):
            picks.append(sentence)
            if len(picks) >= limit:
                break
    return picks


@dataclass(frozen=True)
class HistoryEntry:
    """One verdict of a version against the reference, with the design change behind it.

    `diff` is the raw unified diff of v(version-1) → v(version) ("" when the designs are identical), None when the
    entry has no diff (v0, or a design not recorded). `episode_a`/`episode_b` name the judged episodes, `judged_at`
    is the verdict time (ISO 8601), None when unknown.
    """

    key: str
    version: int
    winner: str
    judge_model: str
    judged_at: str | None
    side_a: str
    side_b: str
    rationale: str
    diff: str | None = None
    episode_a: str | None = None
    episode_b: str | None = None
    label_a: str = ""
    label_b: str = ""


@dataclass(frozen=True)
class BestDesign:
    """The champion shown to the optimizer when it is not the current version."""

    version: int
    design: str
    rationale: str
    case: Literal["both_win_arbitration", "champion_only_win"]


@dataclass(frozen=True)
class OptimizerInputs:
    """Everything the optimizer prompt of step k is built from.

    `evidence` and `results_appendix` are the raw evidence data (`EvidenceBundle.variables()`,
    `ResultsAppendix.variables()`) that the template renders with the ``evidence.j2`` macros; `run_status` is the
    current run's status record (None: no status was supplied).
    """

    version: int
    task_text: str
    current_design: str
    evidence: Any
    results_appendix: Any
    run_status: Mapping[str, Any] | None
    history: Sequence[HistoryEntry] = ()
    scoreboard: Sequence[tuple[int, str | None]] = ()
    retained: int | None = None
    best: BestDesign | None = None
    v0_design: str | None = None

    @property
    def baseline_mode(self) -> bool:
        """From step 1 on, history is framed as verdicts against the fixed bare reference."""
        return self.version >= 1


def optimizer_system_prompt(*, prompts: PromptSet | None = None) -> str:
    """System prompt of the optimizer (template ``optimizer_system.j2``)."""
    return (prompts or shipped_prompts()).render("optimizer_system.j2")


def run_failed(run_status: Mapping[str, Any] | None) -> bool:
    """The reference's rule: a run failed when its exit code is neither 0 nor unknown, or its trace is marked as
    holding no success result (an absent or null mark is not a failure)."""
    if not isinstance(run_status, Mapping):
        return False
    return run_status.get("exit_code") not in (0, None) or run_status.get("trace_has_success_result") is False


def prior_failures(run_status: Mapping[str, Any] | None) -> bool:
    """The status record names earlier failed runs of this task."""
    return isinstance(run_status, Mapping) and bool(run_status.get(PRIOR_FAILURES))


def _fields(value: Any, names: Sequence[str]) -> Any:
    if not isinstance(value, Mapping):
        return value
    return {name: value[name] for name in names if name in value}


def _tool_call(call: Any) -> Any:
    # mass-ops' runtime names the tool under "name"; the reference's runner under "tool".
    if not isinstance(call, Mapping):
        return call
    tool = call["tool"] if "tool" in call else call.get("name")
    return {"tool": tool, "args": call.get("args")}


def status_document(run_status: Mapping[str, Any]) -> dict[str, Any]:
    """The run status as the reference's run_status.json holds it: its fields in its order (mass-ops' additions
    left out), ``prior_failures`` last when present."""
    document: dict[str, Any] = _fields(run_status, STATUS_FIELDS)
    failure = document.get("failure")
    if isinstance(failure, Mapping):
        failure = _fields(failure, _FAILURE_FIELDS)
        calls = failure.get("last_tool_calls_most_recent_first")
        if isinstance(calls, list):
            failure["last_tool_calls_most_recent_first"] = [_tool_call(call) for call in calls]
        document["failure"] = failure
    for name, fields in (("operational_limits", _LIMIT_FIELDS), ("hiw", _HIW_FIELDS)):
        if name in document:
            document[name] = _fields(document[name], fields)
    if PRIOR_FAILURES in run_status:
        document[PRIOR_FAILURES] = run_status[PRIOR_FAILURES]
    return document


def status_json(run_status: Mapping[str, Any] | None) -> str | None:
    """The execution metadata JSON: indented by 2, non-ASCII kept (the reference's json.dumps options)."""
    if run_status is None:
        return None
    return json.dumps(status_document(run_status), indent=2, ensure_ascii=False)


def failure_notice(run_status: Mapping[str, Any] | None, *, prompts: PromptSet | None = None) -> str | None:
    """The failure notice (and prior-failure addenda) for a run that did not finish cleanly, else None (macro
    ``failure_notice`` of ``optimizer_parts.j2``)."""
    notice = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "failure_notice")
    return notice(run_failed(run_status), prior_failures(run_status)).strip("\n") or None


def scoreboard_entries(scoreboard: Sequence[tuple[int, str | None]], retained: int | None) -> list[dict[str, Any]]:
    """One entry per version: its verdict against the reference and whether it is the retained champion."""
    return [{"version": v, "verdict": verdict, "retained": v == retained} for v, verdict in scoreboard]


def scoreboard_line(
    scoreboard: Sequence[tuple[int, str | None]], retained: int | None, *, prompts: PromptSet | None = None
) -> str:
    """The W/L/T record against the reference (macro ``scoreboard`` of ``optimizer_parts.j2``)."""
    line = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "scoreboard")
    return line(scoreboard_entries(scoreboard, retained)).strip("\n")


def delta_rows(rationales: Sequence[str]) -> list[dict[str, Any]]:
    """The recurring-defect buckets of the history rationales, most frequent first (ties in bucket order).

    A non-empty rationale counts once in each bucket whose pattern it matches (lower-cased). A bucket's example is
    the first actionable sentence of the oldest matching rationale that has one (None when none has).
    """
    counts = dict.fromkeys((bucket for bucket, _ in DELTA_BUCKETS), 0)
    examples: dict[str, str] = {}
    for raw in rationales:
        rationale = raw.strip()
        if not rationale:
            continue
        low = rationale.lower()
        for bucket, pattern in DELTA_BUCKETS:
            if pattern.search(low):
                counts[bucket] += 1
                if bucket not in examples:
                    first = takeaways(rationale, limit=1)
                    if first:
                        examples[bucket] = first[0]
    ranked = sorted((bucket for bucket, count in counts.items() if count), key=lambda b: counts[b], reverse=True)
    return [{"bucket": b, "count": counts[b], "example": examples.get(b)} for b in ranked]


def delta_checklist(rationales: Sequence[str], *, prompts: PromptSet | None = None) -> str:
    """The delta checklist of `rationales` (macro ``delta_checklist`` of ``optimizer_parts.j2``)."""
    checklist = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "delta_checklist")
    return checklist(delta_rows(rationales), bool(rationales)).strip("\n")


def design_file_name(version: int) -> str:
    """The name a design version goes by in a diff header (the reference's versions/ file stem)."""
    return f"multi_agent_design_v{version}"


def version_diff(old_design: str, new_design: str, old_version: int, new_version: int) -> str:
    """Unified diff (1 context line) of two design blocks, stripped; "" when they are identical. Each block is
    split as the reference reads its versions/ file (the stripped block plus a newline: an empty block is one
    empty line)."""
    lines = difflib.unified_diff(
        (old_design.strip() + "\n").splitlines(),
        (new_design.strip() + "\n").splitlines(),
        fromfile=design_file_name(old_version),
        tofile=design_file_name(new_version),
        lineterm="",
        n=DIFF_CONTEXT_LINES,
    )
    return "\n".join(lines).strip()


def diff_caps(history: Sequence[HistoryEntry]) -> dict[int, int]:
    """Character cap of each version's diff: the 3 highest versions ≥ 1 in the history get 1500, older ones 400
    (ranked whether or not their diff exists, as the reference ranks keys before reading files)."""
    ranked = sorted({entry.version for entry in history if entry.version >= 1}, reverse=True)
    return {v: RECENT_DIFF_CHARS if rank < RECENT_DIFFS else OLDER_DIFF_CHARS for rank, v in enumerate(ranked)}


def diff_excerpt(diff: str, limit: int) -> dict[str, Any]:
    """A diff as the history shows it: collapsed to one line and cut like a rationale; `identical` when empty."""
    if not diff:
        return {"text": "", "truncated": False, "identical": True}
    return {**excerpt(diff, limit), "identical": False}


def history_rows(history: Sequence[HistoryEntry]) -> list[dict[str, Any]]:
    """The history entries as template rows (see the header of ``optimizer_user.j2``)."""
    caps = diff_caps(history)
    rows = []
    for entry in history:
        rationale = entry.rationale.strip()
        diff = None
        if entry.diff is not None and entry.version in caps:
            diff = diff_excerpt(entry.diff, caps[entry.version])
        rows.append(
            {
                "key": entry.key,
                "version": entry.version,
                "label_a": entry.label_a,
                "label_b": entry.label_b,
                "winner": entry.winner,
                "judge_model": entry.judge_model,
                "judged_at": entry.judged_at,
                "side_a": entry.side_a,
                "side_b": entry.side_b,
                "episode_a": entry.episode_a,
                "episode_b": entry.episode_b,
                "rationale": excerpt(rationale, HISTORY_RATIONALE_CHARS),
                "takeaways": takeaways(rationale),
                "diff": diff,
            }
        )
    return rows


def best_variables(best: BestDesign | None) -> dict[str, Any] | None:
    """The previous-best section's data: the rationale cut at 2000 characters, and whether the reference would end
    it with an added period (a non-empty, uncut rationale whose last character closes no sentence)."""
    if best is None:
        return None
    rationale = excerpt(best.rationale.strip(), BEST_RATIONALE_CHARS)
    text = rationale["text"]
    needs_period = bool(text) and not rationale["truncated"] and text[-1] not in _SENTENCE_END
    return {
        "version": best.version,
        "design": best.design.strip(),
        "rationale": {**rationale, "needs_period": needs_period},
        "case": best.case,
    }


def select_best(
    champion: int,
    has_win: bool,
    current: int,
    champion_design: str,
    arbitration_rationale: str | None,
    baseline_rationale: str | None,
) -> BestDesign | None:
    """The previous best shown at step `current`: the champion when it is not the current version and beat the
    reference. Its rationale is the arbitration's between the two (`arbitration_rationale`, None when no such
    arbitration is recorded: case "both_win_arbitration"), else the current version's verdict against the reference
    (case "champion_only_win"); a missing rationale is empty."""
    if champion == current or not has_win:
        return None
    if arbitration_rationale is not None:
        return BestDesign(champion, champion_design, arbitration_rationale, "both_win_arbitration")
    return BestDesign(champion, champion_design, baseline_rationale or "", "champion_only_win")


def show_v0(version: int, best: BestDesign | None) -> bool:
    """The v0 root is shown from step 1 on unless it is the previous best already shown above."""
    return version >= 1 and (best is None or best.version != 0)


def optimizer_variables(inputs: OptimizerInputs) -> dict[str, Any]:
    """The variables of ``optimizer_user.j2`` for step k (documented in the template's header)."""
    v0 = inputs.v0_design if inputs.v0_design is not None and show_v0(inputs.version, inputs.best) else None
    return {
        "version": inputs.version,
        "task_text": inputs.task_text.strip(),
        "current_design": inputs.current_design.strip(),
        "best": best_variables(inputs.best),
        "v0_design": None if v0 is None else v0.strip(),
        "evidence": inputs.evidence,
        "results_appendix": inputs.results_appendix,
        "run_status_json": status_json(inputs.run_status),
        "run_failed": run_failed(inputs.run_status),
        "prior_failures": prior_failures(inputs.run_status),
        "baseline_mode": inputs.baseline_mode,
        "scoreboard": scoreboard_entries(inputs.scoreboard, inputs.retained),
        "history": history_rows(inputs.history),
        "delta_rows": delta_rows([e.rationale for e in inputs.history]),
        "start_marker": START_MARKER,
    }


def optimizer_user_prompt(inputs: OptimizerInputs, *, prompts: PromptSet | None = None) -> str:
    """The user message of the optimizer call of step k (template ``optimizer_user.j2``)."""
    return (prompts or shipped_prompts()).render("optimizer_user.j2", **optimizer_variables(inputs))
