"""Evidence bundles, judge prompts and the pairwise judge against the scripted policy server (MASS_SPEC §5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mass_ops.judge import evidence
from mass_ops.judge.evidence import (
    EvidenceCaps,
    EvidenceError,
    build_bundle,
    file_excerpts,
    preflight,
    results_json_appendix,
    task_plot_paths,
    token_counter,
)
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import (
    JudgeOutputError,
    judge_system_prompt,
    judge_user_prompt,
    parse_verdict,
)
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling
from mass_ops.seeds import judge_retry_seed
from mass_ops.store.schema import CallStatus
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.judge.scripted import open_judged_cycle
from tests.policy_server import Fault, FaultRule, PolicyReply, RequestKind, classify_request


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


# -- directory tree ------------------------------------------------------------------------------------------------


def tree_lines(root: Path, name: str | None = None) -> list[str]:
    """The tree as the shipped template renders it (the lines between its fences)."""
    text = build_bundle(root, task_id=51, task_text="", location="x", caps=EvidenceCaps(), name=name).render("W")
    return text.split("```\n", 1)[1].split("\n```", 1)[0].splitlines()


def test_tree_lists_folders_first_case_insensitively_skips_tool_folders_and_tags_binaries(tmp_path: Path) -> None:
    root = write(
        tmp_path / "ws",
        {
            "zeta.txt": "z",
            "Alpha.md": "a",
            "beta.PNG": b"\x89PNG",
            ".png": b"x",  # no suffix for Python: not tagged
            "data/raw.parquet": b"x",
            "Results/metrics.json": "{}",
            ".git/HEAD": "ref",
            "__pycache__/x.pyc": b"x",
            ".venv/lib/x.py": "x",
            "venv": "a file named like a tool folder is listed",
        },
    )
    assert tree_lines(root, "query51") == [
        "query51",
        "  data/",
        "    raw.parquet  [.parquet binary/large]",
        "  Results/",
        "    metrics.json",
        "  .png",
        "  Alpha.md",
        "  beta.PNG  [.png binary/large]",
        "  venv",
        "  zeta.txt",
    ]


def test_tree_elides_crowded_folders_and_stops_at_depth_and_entry_limits(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    write(root, {f"many/f{i:03d}.txt": "x" for i in range(101)})
    write(root, {"/".join(f"d{i}" for i in range(9)) + "/leaf.txt": "x"})
    tree = "\n".join(tree_lines(root))
    assert "  many/\n    ... (101 entries omitted)" in tree
    assert "d5/" in tree and "d6/" not in tree  # depth 6 is the deepest folder listed
    assert "truncated" not in tree  # the reference marks only the entry limit, not the depth

    wide = tmp_path / "wide"
    for folder in range(5):
        write(wide, {f"g{folder}/f{i:02d}.txt": "x" for i in range(90)})
    lines = tree_lines(wide)
    assert len(lines) == 1 + evidence.TREE_MAX_ENTRIES + 1
    assert lines[-1] == "... (tree truncated)"


# -- preflight and excerpts ----------------------------------------------------------------------------------------

TASK = (
    "Deliverables:\\n1. research_report.md\\n3. deliverables/plots/ containing equity_curves.png, drawdowns.png and "
    "deliverables/plots/rolling_sharpe.png; also figures/extra.png and out/deliverables/plots/x.png."
)


def test_plot_paths_are_sorted_bare_names_mapped_into_the_plots_folder_full_paths_kept() -> None:
    assert task_plot_paths(TASK) == [
        "deliverables/plots/drawdowns.png",
        "deliverables/plots/equity_curves.png",
        "deliverables/plots/extra.png",  # the name of figures/extra.png
        "deliverables/plots/rolling_sharpe.png",
        "deliverables/plots/x.png",
        "out/deliverables/plots/x.png",
    ]
    many = " ".join(f"p{i}.png" for i in range(60))
    assert len(task_plot_paths(many)) == 60


def test_preflight_reports_found_missing_and_each_plot(tmp_path: Path) -> None:
    root = write(
        tmp_path / "ws",
        {"research_report.md": "# r", "results/metrics.json": "{}", "deliverables/plots/drawdowns.png": b"x"},
    )
    checks = preflight(root, TASK)
    assert checks["core"] == [
        {"path": "deliverables/index.json", "found": False},
        {"path": "requirements.txt", "found": False},
        {"path": "research_report.md", "found": True},
        {"path": "results/metrics.json", "found": True},
    ]
    assert (checks["plot_count"], checks["plots_found"]) == (6, 1)
    text = build_bundle(root, task_id=51, task_text=TASK, location="x", caps=EvidenceCaps()).render("W")
    assert "- research_report.md: FOUND\n- results/metrics.json: FOUND" in text
    assert "plots named by the task: 1/6 present" in text
    assert "  - deliverables/plots/drawdowns.png: ok\n  - deliverables/plots/equity_curves.png: missing" in text
    many = preflight(root, " ".join(f"p{i:02d}.png" for i in range(45)))
    assert (len(many["plots"]), many["plot_count"]) == (evidence.PREFLIGHT_MAX_PLOTS, 45)


def test_token_counter_is_chars_over_four_except_for_gpt_models(monkeypatch: pytest.MonkeyPatch) -> None:
    assert token_counter("Qwen/Qwen3.6-27B-FP8")("x" * 9) == 3
    assert token_counter("qwen")("") == 1  # never below one token
    monkeypatch.setattr(evidence, "_o200k_counter", lambda: lambda text: 1000)
    assert token_counter("gpt-5.5")("abc") == 1000
    assert token_counter(" GPT-5.5")("abc") == 1000  # any case, surrounding spaces ignored
    monkeypatch.setattr(evidence, "_o200k_counter", lambda: None)
    assert token_counter("gpt-5.5")("x" * 9) == math.ceil(9 / 4)


def test_excerpts_follow_the_reference_order_and_caps(tmp_path: Path) -> None:
    root = write(
        tmp_path / "ws",
        {
            "research_report.md": "R" * 40_000,
            "results/model_comparison.json": '{"m": 1}',
            "results/metrics.json": '{"sharpe": 1}',
            "deliverables/index.json": "[]",
            "requirements.txt": "numpy==2.1.0\n",
            **{f"run_{name}.py": "print(1)\n" for name in ("a", "b", "c", "d", "e")},
            "main.py": "print(0)\n",
            "tests/test_b.py": "B" * 20_000,
            "tests/test_a.py": "A" * 20_000,
            "notes.md": "not excerpted",
        },
    )
    excerpts = file_excerpts(root, EvidenceCaps.local("qwen"))
    assert [e.path for e in excerpts] == [
        "research_report.md",
        "deliverables/index.json",
        "results/metrics.json",
        "results/model_comparison.json",
        "requirements.txt",
        "main.py",
        "run_a.py",
        "run_b.py",
        "run_c.py",
        "tests/test_a.py",
    ]
    report, test_file = excerpts[0], excerpts[-1]
    assert report.truncated and [p["kind"] for p in report.parts] == ["text", "char_cut", "text"]
    kept = sum(len(p["text"]) for p in test_file.parts if p["kind"] == "text")
    assert test_file.truncated and kept == evidence.TEST_FILE_CAP
    assert not excerpts[1].truncated


def test_bundle_renders_tree_preflight_and_fenced_excerpts(tmp_path: Path) -> None:
    root = write(
        tmp_path / "ws", {"research_report.md": "# Report\n```python\nx = 1\n```\n", "results/metrics.json": "{}"}
    )
    bundle = build_bundle(root, task_id=51, task_text=TASK, location="s3://b/ws.tar.gz", caps=EvidenceCaps.local("q"))
    text = bundle.render("Workspace A")
    assert text.startswith("# Workspace A (evidence only)\nPath: `s3://b/ws.tar.gz`")
    assert "## Directory tree (representative)" in text and "## Programmatic preflight" in text
    assert "### File: `research_report.md`\n````\n# Report" in text  # longer fence than the inner one
    assert bundle.query_id == "query_51"
    with pytest.raises(EvidenceError, match="not a folder"):
        build_bundle(tmp_path / "absent", task_id=51, task_text="", location="x", caps=EvidenceCaps())


def test_results_appendix_excludes_known_dumps_and_respects_both_caps(tmp_path: Path) -> None:
    root = write(
        tmp_path / "ws",
        {
            "results/a.json": "a" * 100,
            "results/big.json": "b" * 30_000,
            "results/c_huge.json": "c" * 80_000,
            "results/d.json": "d" * 50,
            "results/raw_records.json": "[]",
            "results/sub/pilot_raw_records.json": "[]",
            "results/curve_data.json": "[]",
            "results/run_B1_random_s0.json": "[]",
            "results/run_X_random_s0.json": "[]",  # not on the reference's list for task 202
        },
    )
    text = results_json_appendix(root, 202, per_file_chars=24_000, total_chars=40_000).render()
    assert text.startswith("# Full JSON artifacts under results/")
    for excluded in ("raw_records", "pilot_raw_records", "curve_data", "run_B1_random_s0"):
        assert excluded not in text
    assert "## `results/a.json`" in text and "## `results/big.json`" in text and "run_X_random_s0" in text
    assert "\n[truncated: middle omitted]\n" in text
    assert "Omitted (total cap of 40000 characters reached): results/c_huge.json" in text
    assert "## `results/d.json`" in text  # a later, smaller file still fits
    # Task 51 has no per-task exclusions: curve_data.json is included there.
    assert "results/curve_data.json" in results_json_appendix(root, 51).render()


# -- prompts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_id", "who"),
    [
        (51, "senior quantitative researcher"),
        (99, "senior quantitative researcher"),
        (202, "senior researcher in pharmacy"),
        (324, "senior researcher in robotics"),
        (150, "senior research reviewer"),
        (400, "senior research reviewer"),
    ],
)
def test_persona_follows_the_task_id_range(task_id: int, who: str) -> None:
    system = judge_system_prompt(task_id)
    assert who in system and "JSON" in system
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]}
    assert classify_request(body) is RequestKind.JUDGE


def test_user_prompt_holds_task_labels_bundles_rubric_and_schema(tmp_path: Path) -> None:
    a = build_bundle(write(tmp_path / "a", {"a.txt": "1"}), task_id=51, task_text="", location="A", caps=EvidenceCaps())
    b = build_bundle(write(tmp_path / "b", {"b.txt": "1"}), task_id=51, task_text="", location="B", caps=EvidenceCaps())
    text = judge_user_prompt("Do the study.", "no-harness-single-agent-baseline", "multi-agent-design-v2", a, b)
    order = ["# Task\nDo the study.", "# Labels (for orientation only)", "# Workspace A", "# Workspace B", "rubric"]
    positions = [text.find(marker) for marker in order]
    assert -1 not in positions and positions == sorted(positions)
    assert "- Workspace A: no-harness-single-agent-baseline" in text
    assert all(f"{i}. " in text for i in range(1, 7))
    assert '"winner": "A" | "B" | "tie"' in text
    other = build_bundle(tmp_path / "b", task_id=202, task_text="", location="B", caps=EvidenceCaps())
    with pytest.raises(ValueError, match="different tasks"):
        judge_user_prompt("t", "a", "b", a, other)


def test_parse_verdict_accepts_the_schema_only() -> None:
    assert parse_verdict({"winner": " tie ", "rationale": " close "}).winner == "tie"
    assert parse_verdict({"winner": "b", "rationale": "B is better."}).winner == "B"
    for bad, message in [
        ({"winner": "C", "rationale": "x"}, "winner"),
        ({"winner": "A"}, "rationale"),
        ({"winner": "A", "rationale": "  "}, "rationale"),
        ({"verdict": "A"}, "winner"),
        (["A"], "JSON object"),
    ]:
        with pytest.raises(JudgeOutputError, match=message):
            parse_verdict(bad)  # type: ignore[arg-type]


# -- the pairwise judge against the policy server ------------------------------------------------------------------


def _case(tmp_path: Path, key: str, label_a: str = "alpha", label_b: str = "beta") -> PairwiseCase:
    caps = EvidenceCaps.local("q")
    a = build_bundle(
        write(tmp_path / "a", {"research_report.md": "A"}), task_id=51, task_text=TASK, location="A", caps=caps
    )
    b = build_bundle(
        write(tmp_path / "b", {"research_report.md": "B"}), task_id=51, task_text=TASK, location="B", caps=caps
    )
    return PairwiseCase(CallUnit(key, "judge", 51), 51, "Study SPY.", label_a, label_b, a, b, seed=450051)


def _judge(
    inner_loop: InnerLoopEnv, judge: dict[str, object] | None = None, **options: object
) -> tuple[PairwiseJudge, CallLedger]:
    opened = open_judged_cycle(inner_loop, judge or {}, **options)
    ctx = opened.ctx
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    pairwise = PairwiseJudge(
        opened.client,
        ledger,
        lambda seed: in_loop_sampling(opened.config, seed),
        invalid_retries=opened.config.judge.invalid_retries,
        swap_consistent=opened.config.search.swap_consistent,
    )
    return pairwise, ledger


def test_retry_seeds_start_at_the_unit_seed_and_differ_per_retry() -> None:
    assert judge_retry_seed(450051, 0) == 450051  # a first usable answer is the reference's own
    derived = [judge_retry_seed(450051, retry) for retry in range(1, 50)]
    assert len(set(derived)) == 49 and 450051 not in derived
    assert all(0 <= seed < 2**31 for seed in derived)  # type: ignore[operator]
    assert derived[:2] == [judge_retry_seed(450051, 1), judge_retry_seed(450051, 2)]  # reproducible
    assert judge_retry_seed(450052, 1) != derived[0]
    assert judge_retry_seed(None, 3) is None  # no seed is sent (OpenRouter, external judges): none to derive
    with pytest.raises(ValueError, match="start at 0"):
        judge_retry_seed(450051, -1)


def test_a_valid_verdict_is_one_recorded_call_and_is_reused_on_rerun(
    inner_loop: InnerLoopEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-test-secret-never-stored-0123456789"
    monkeypatch.setenv("MASS_DEMO_API_KEY", secret)
    inner_loop.policy.judge_winner = lambda request: "B"
    judge, ledger = _judge(inner_loop)
    case = _case(tmp_path, "task51/rhi/v1_vs_no_harness")
    outcome = judge.judge(case)
    assert (outcome.verdict, outcome.calls) == ("B", 1)
    body = inner_loop.judge_requests()[0]
    assert body["seed"] == 450051 and body["response_format"] == {"type": "json_object"}
    # The test config's backend is openai-compatible (the demo preset's): top_k is a vLLM-only extension.
    assert "top_k" not in body and body["chat_template_kwargs"] == {"enable_thinking": True}

    rows = ledger.attempts(case.unit)
    assert [(r.unit_key, r.status, r.purpose) for r in rows] == [
        ("task51/rhi/v1_vs_no_harness/a1", CallStatus.SUCCEEDED, "judge")
    ]
    stored = json.loads(Path(rows[0].prompt_uri.removeprefix("file://")).read_text())
    assert stored["request"]["messages"][1]["content"].startswith("# Task\nStudy SPY.")
    assert stored["seed"] == 450051

    again = judge.judge(case)
    assert (again.verdict, again.calls, again.call_id) == ("B", 0, outcome.call_id)
    assert len(inner_loop.judge_requests()) == 1

    stored_text = "".join(p.read_text(errors="ignore") for p in Path(inner_loop.artifact_url).rglob("*") if p.is_file())
    assert secret not in stored_text
    assert secret not in Path(inner_loop.metadata_url.removeprefix("sqlite:///")).read_bytes().decode(errors="ignore")


def test_ledger_attempts_are_dense_across_lookup_batches(inner_loop: InnerLoopEnv) -> None:
    _, ledger = _judge(inner_loop)
    unit = CallUnit("task51/rhi/v4_vs_no_harness", "judge", 51)
    # a1..a10 span two lookup batches; a12 after the gap at a11 and the swapped order's a1 are not this unit's.
    for key in [*(unit.attempt_key(n) for n in (*range(1, 11), 12)), f"{unit.key}/swapped/a1"]:
        ledger.repo.record_llm_call(ledger.cycle_id, key, purpose="judge", model="m", status=CallStatus.INVALID)
    assert [row.unit_key for row in ledger.attempts(unit)] == [unit.attempt_key(n) for n in range(1, 11)]
    assert ledger.attempts(CallUnit("task51/rhi/v5_vs_no_harness", "judge", 51)) == []


def test_invalid_answers_are_retried_within_the_budget(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.policy.judge_replies += [
        PolicyReply(content="Workspace A is better overall."),
        PolicyReply(content=json.dumps({"winner": "maybe", "rationale": "?"})),
    ]
    inner_loop.policy.judge_winner = lambda request: "A"
    judge, ledger = _judge(inner_loop, {"invalid_retries": 2})
    case = _case(tmp_path, "task51/rhi/v0_vs_no_harness")
    outcome = judge.judge(case)
    assert (outcome.verdict, outcome.calls) == ("A", 3)
    statuses = [row.status for row in ledger.attempts(case.unit)]
    assert statuses == [CallStatus.INVALID, CallStatus.INVALID, CallStatus.SUCCEEDED]
    errors = [row.error for row in ledger.attempts(case.unit)[:2]]
    assert "no JSON object" in errors[0] and "winner" in errors[1]
    # A deterministic server would repeat an unusable answer: every retry samples with its own derived seed, sent
    # with the request and recorded with the attempt.
    expected = [450051, judge_retry_seed(450051, 1), judge_retry_seed(450051, 2)]
    assert [body["seed"] for body in inner_loop.judge_requests()] == expected
    assert [row.seed for row in ledger.attempts(case.unit)] == expected
    assert len(set(expected)) == 3


def test_an_exhausted_budget_records_invalid_counted_as_a_tie(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.server.config.faults.append(FaultRule(Fault.WRONG_SCHEMA, kind=RequestKind.JUDGE))
    judge, ledger = _judge(inner_loop, {"invalid_retries": 1})
    case = _case(tmp_path, "task51/ranking/a_vs_b")
    outcome = judge.judge(case)
    assert (outcome.verdict, outcome.effective, outcome.calls) == ("invalid", "tie", 2)
    assert "invalid after 2 attempts" in outcome.rationale
    assert [r.status for r in ledger.attempts(case.unit)] == [CallStatus.INVALID] * 2
    # The stage either records the invalid verdict (never asking again) or fails without recording it; then a rerun
    # asks again: a fresh round whose seeds continue the unit's count of unusable answers, never repeating one.
    inner_loop.server.config.faults.clear()
    inner_loop.policy.judge_winner = lambda request: "B"
    again = judge.judge(case)
    assert (again.verdict, again.calls) == ("B", 1)
    rows = ledger.attempts(case.unit)
    assert [r.status for r in rows] == [CallStatus.INVALID, CallStatus.INVALID, CallStatus.SUCCEEDED]
    assert [r.seed for r in rows] == [450051, judge_retry_seed(450051, 1), judge_retry_seed(450051, 2)]
    # Once a usable verdict is stored, it is reused without a call.
    assert (judge.judge(case).verdict, len(inner_loop.judge_requests())) == ("B", 3)


def test_an_infrastructure_failure_is_retried_with_the_same_seed(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.policy.judge_replies.append(PolicyReply(content="no verdict here"))
    inner_loop.policy.judge_winner = lambda request: "A"
    judge, ledger = _judge(inner_loop, {"invalid_retries": 0})
    case = _case(tmp_path, "task51/rhi/v3_vs_no_harness")
    assert judge.judge(case).verdict == "invalid"
    # The next run's attempt fails on infrastructure (503 on every transport retry): it uses the first derived seed.
    inner_loop.server.config.faults.append(FaultRule(Fault.HTTP_503, kind=RequestKind.JUDGE, times=2))
    with pytest.raises(Exception, match="503"):
        judge.judge(case)
    assert judge.judge(case).verdict == "A"
    rows = ledger.attempts(case.unit)
    assert [r.status for r in rows] == [CallStatus.INVALID, CallStatus.FAILED, CallStatus.SUCCEEDED]
    assert [r.seed for r in rows] == [450051, judge_retry_seed(450051, 1), judge_retry_seed(450051, 1)]


def test_reasoning_that_eats_the_output_is_an_invalid_attempt(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.server.config.faults.append(FaultRule(Fault.EMPTY_CONTENT, kind=RequestKind.JUDGE, times=1))
    judge, ledger = _judge(inner_loop)
    case = _case(tmp_path, "task51/rhi/v2_vs_no_harness")
    assert judge.judge(case).verdict in ("A", "B", "tie")
    first = ledger.attempts(case.unit)[0]
    assert first.status == CallStatus.INVALID and "consumed by reasoning" in first.error


def test_swap_consistent_judging_turns_disagreement_into_a_tie(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.policy.judge_winner = lambda request: "A"  # position bias: always the first workspace
    judge, _ = _judge(inner_loop, swap_consistent=True)
    outcome = judge.judge(_case(tmp_path, "task51/rhi/v1_vs_no_harness"))
    assert (outcome.verdict, outcome.calls) == ("tie", 2)
    assert "disagree" in outcome.rationale
    bodies = inner_loop.judge_requests()
    assert "- Workspace A: alpha" in bodies[0]["messages"][1]["content"]
    assert "- Workspace A: beta" in bodies[1]["messages"][1]["content"]


def test_swap_consistent_judging_keeps_an_order_independent_preference(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    def prefers_beta(request: object) -> str:
        text = request.user_text()  # type: ignore[attr-defined]
        return "A" if "- Workspace A: beta" in text else "B"

    inner_loop.policy.judge_winner = prefers_beta
    judge, _ = _judge(inner_loop, swap_consistent=True)
    outcome = judge.judge(_case(tmp_path, "task51/rhi/v3_vs_no_harness"))
    assert outcome.verdict == "B"
    assert outcome.usage and outcome.usage["prompt_tokens"] > 0
