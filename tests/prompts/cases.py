"""Representative inputs of every prompt builder, shared by the fixture generator and the rendering test.

The builders are called through their public API (`judge_system_prompt`, `optimizer_user_prompt`, …), which is the
same before and after the prompt texts moved into templates, so `generate_fixtures.py` can be run against the old
string-building code (a checkout of the commit before the templates) to produce the expected texts.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from mass_ops.judge.evidence import EvidenceBundle, Excerpt
from mass_ops.judge.prompts import judge_system_prompt, judge_user_prompt
from mass_ops.prompts import shipped_prompts
from mass_ops.search.prompt import (
    BestDesign,
    HistoryEntry,
    OptimizerInputs,
    delta_checklist,
    failure_notice,
    optimizer_system_prompt,
    optimizer_user_prompt,
    scoreboard_line,
)
from mass_ops.stages.collect import teacher_prompt
from mass_ops.tasks.catalogue import TaskCatalogue, TaskSplits
from mass_ops.workflow import START_MARKER

LONG_RATIONALE = (
    "Workspace A is complete and its report matches metrics.json. Workspace B is missing the ablation log. "
    "B's Sharpe ratio in report.md is inconsistent with results/metrics.json. The validation uses a hold-out "
    "that leaks future data. B's requirements are not pinned, so the run is not reproducible. B fails two unit "
    "tests. Several plots show NaN values and an empty placeholder table. The variance across seeds is not "
    "reported, a robustness gap. " * 4
)


def _bundle(task_id: int, location: str, root: str, excerpt: str) -> EvidenceBundle:
    """A bundle as `build_bundle` makes it: a small tree, the preflight, one cut excerpt holding `excerpt`."""
    lines = [
        {"depth": 1, "kind": "dir", "name": "results", "suffix": "", "count": 0},
        {"depth": 2, "kind": "file", "name": "metrics.json", "suffix": "", "count": 0},
        {"depth": 1, "kind": "file", "name": "fig.png", "suffix": ".png", "count": 0},
    ]
    core = ["deliverables/index.json", "requirements.txt", "research_report.md", "results/metrics.json"]
    parts = [
        {"kind": "text", "text": excerpt},
        {"kind": "token_cut", "start": 0, "stop": 12},
        {"kind": "char_cut", "omitted": 345},
        {"kind": "text", "text": "x = 1\n"},
    ]
    return EvidenceBundle(
        task_id=task_id,
        query_id=f"query_{task_id}",
        location=location,
        tree={"root": root, "lines": lines, "truncated": False, "child_limit": 100, "backticks": 0},
        preflight={
            "core": [{"path": path, "found": path.startswith("res")} for path in core],
            "plots": [{"path": "deliverables/plots/eq.png", "found": False}],
            "plot_count": 1,
            "plots_found": 0,
        },
        excerpts=(Excerpt("research_report.md", tuple(parts), truncated=True, backticks=3),),
    )


def _entry(version: int, winner: str, rationale: str, diff: str | None = None) -> HistoryEntry:
    return HistoryEntry(
        key=f"v{version}_vs_no_harness",
        version=version,
        winner=winner,
        judge_model="judge-model",
        judged_at=f"2026-11-30T0{version}:00:00.250000+00:00",
        side_a="reference",
        side_b=f"v{version}",
        rationale=rationale,
        diff=diff,
        episode_a="reference-t51-s450051/a1",
        episode_b=f"search-t51-v{version}-s45{version}051/a1" if version != 2 else None,
    )


def _diff(version: int, size: int) -> str:
    return "\n".join(f"-  old line {i} of v{version - 1}\n+  new line {i} of v{version}" for i in range(size))


def _evidence_variables(location: str, text: str) -> dict[str, object]:
    """A workspace's evidence as `EvidenceBundle.variables()` gives it (evidence.j2's header): one excerpt."""
    return {
        "task_id": 51,
        "query_id": "query_51",
        "location": location,
        "refused": None,
        "tree": {
            "root": "w",
            "lines": [{"depth": 1, "kind": "file", "name": "report.md", "suffix": "", "count": 0}],
            "truncated": False,
            "child_limit": 100,
            "backticks": 0,
        },
        "preflight": {"core": [{"path": "report.md", "found": True}], "plots": [], "plot_count": 0, "plots_found": 0},
        "excerpts": [
            {"path": "report.md", "truncated": False, "backticks": 0, "parts": [{"kind": "text", "text": text}]}
        ],
    }


# The results/ appendix as `ResultsAppendix.variables()` gives it.
_APPENDIX: dict[str, object] = {
    "results_dir": True,
    "files": [
        {"path": "results/m.json", "head": '{"sharpe": ', "tail": "1.2}", "truncated": True, "unreadable": False,
         "backticks": 0},
    ],
    "omitted": [{"path": "results/big.json", "chars": 30000}],
    "per_file_chars": 24000,
    "total_chars": 120000,
}  # fmt: skip


def _optimizer_cases() -> dict[str, OptimizerInputs]:
    evidence = (
        "# Workspace for current iteration (multi-agent-design-v3) (evidence only)\nPath: `s3://b/w.tar.gz`\n\n"
        "## Directory tree (representative)\n```text\nw/\n  report.md\n```\n\n{{ not a template }} {% raw %}\n"
    )
    history = [
        _entry(0, "B", "Fine work overall."),
        _entry(1, "A", LONG_RATIONALE, _diff(1, 3)),
        _entry(2, "invalid", "", _diff(2, 200)),
        _entry(3, "tie", "The report is missing Limitations. Everything else is fine.", _diff(3, 2)),
        _entry(4, "B", "B wins: complete deliverables, pinned requirements.", _diff(4, 1)),
    ]
    return {
        "v0_first_step_clean": OptimizerInputs(
            version=0,
            task_text="  Study SPY momentum with walk-forward validation.\n\nDeliverables: report.md\n",
            current_design=f"{START_MARKER}\n1. Orchestrator: plans.\n2. Analyst: runs the study.\n",
            evidence=_evidence_variables("s3://b/w.tar.gz", evidence),
            results_appendix=_APPENDIX,
            run_status={"exit_code": 0, "trace_has_success_result": True, "wall_s": 812.5},
        ),
        "v0_force_quit_with_history": OptimizerInputs(
            version=0,
            task_text="Study SPY.",
            current_design=f"{START_MARKER} design",
            evidence=_evidence_variables("x", "evidence"),
            results_appendix=_APPENDIX,
            run_status={"exit_code": 137, "trace_has_success_result": False, "prior_failures": []},
            history=[_entry(0, "A", "B is missing the report.")],
        ),
        "v4_baseline_both_win_recurrent_failure": OptimizerInputs(
            version=4,
            task_text="Study SPY — ünïcödé, “quotes”, {braces} and ★.",
            current_design=f"{START_MARKER} current v4 design",
            evidence=_evidence_variables("s3://b/w.tar.gz", evidence),
            results_appendix=_APPENDIX,
            run_status={"exit_code": 1, "prior_failures": [{"version": 2, "exit_code": 137}], "started": None},
            history=history,
            scoreboard=[(0, "B"), (1, "A"), (2, "invalid"), (3, "tie"), (4, "B"), (5, None)],
            retained=4,
            best=BestDesign(1, f"{START_MARKER} best v1 design\n", LONG_RATIONALE, "both_win_arbitration"),
            v0_design=f"  {START_MARKER} root design  ",
        ),
        "v2_champion_only_resolved_failures": OptimizerInputs(
            version=2,
            task_text="Study SPY.",
            current_design=f"{START_MARKER} current",
            evidence=_evidence_variables("x", "# Workspace (evidence only)\nPath: `x`"),
            results_appendix=_APPENDIX,
            run_status={"exit_code": 0, "trace_has_success_result": True, "prior_failures": [1]},
            history=history[:3],
            scoreboard=[(0, "B"), (1, "A"), (2, "invalid")],
            retained=0,
            best=BestDesign(0, f"{START_MARKER} v0 best", "v0 beat the baseline and v2 did not.", "champion_only_win"),
        ),
        "v1_baseline_no_verdicts_yet": OptimizerInputs(
            version=1,
            task_text="Study SPY.",
            current_design=f"{START_MARKER} current",
            evidence=_evidence_variables("e", "e"),
            results_appendix=_APPENDIX,
            run_status={},
            scoreboard=[(0, None), (1, None)],
        ),
    }


def _teacher_ctx(directive: str) -> Any:
    """What the teacher prompt reads of a cycle: its templates and a catalogue holding only the directive."""
    catalogue = TaskCatalogue(tasks={}, splits=TaskSplits((), (), (), {}, {}), teacher_directive=directive)
    return SimpleNamespace(prompts=shipped_prompts(), catalogue=catalogue)


def prompt_cases() -> dict[str, Callable[[], str | None]]:
    """Case name → a call of today's public builder that returns the prompt text."""
    a = _bundle(51, "s3://bucket/a.tar.gz", "a", "# Report\n```python\nx = 1\n```")
    b = _bundle(51, "s3://bucket/b.tar.gz", "b", "{{ jinja-looking }} {# text #}")
    cases: dict[str, Callable[[], str | None]] = {}
    for task_id in (1, 51, 99, 100, 150, 202, 299, 324, 399, 400, 9999):
        cases[f"judge_system/{task_id}"] = lambda task_id=task_id: judge_system_prompt(task_id)
    cases["judge_user/rhi"] = lambda: judge_user_prompt(
        "\n  Do the study.\nDeliverables: report.md  \n", "no-harness-single-agent-baseline", "multi-agent-design-v2",
        a, b,
    )  # fmt: skip
    cases["judge_user/ranking"] = lambda: judge_user_prompt("Task ★ text", "candidate-a", "candidate-b", b, a)
    cases["optimizer_system"] = optimizer_system_prompt
    for name, inputs in _optimizer_cases().items():
        cases[f"optimizer_user/{name}"] = lambda inputs=inputs: optimizer_user_prompt(inputs)
    statuses = {
        "clean": {"exit_code": 0, "trace_has_success_result": True},
        "unknown_exit_success": {"exit_code": None, "trace_has_success_result": True},
        "force_quit": {"exit_code": 137, "trace_has_success_result": True},
        "no_success": {"exit_code": 0, "trace_has_success_result": False},
        "recurrent": {"exit_code": 1, "prior_failures": [1]},
        "resolved": {"exit_code": 0, "trace_has_success_result": True, "prior_failures": [1]},
    }
    for name, status in statuses.items():
        cases[f"failure_notice/{name}"] = lambda status=status: failure_notice(status)
    cases["scoreboard/mixed"] = lambda: scoreboard_line([(0, "B"), (1, "A"), (2, "tie"), (3, None), (4, "invalid")], 0)
    cases["scoreboard/none_retained"] = lambda: scoreboard_line([(0, "B"), (1, "x")], None)
    cases["scoreboard/empty"] = lambda: scoreboard_line([], None)
    cases["delta_checklist/empty"] = lambda: delta_checklist([])
    cases["delta_checklist/history"] = lambda: delta_checklist([LONG_RATIONALE, "Plot missing.", "Fine.", "x" * 400])
    directive = "Execution requirements\n1. Use sub-agents."
    cases["teacher_prompt/builtin_like"] = lambda: teacher_prompt(
        _teacher_ctx(directive), f"{START_MARKER}\n1. Orchestrator\n\n  \n"
    )
    cases["teacher_prompt/empty_directive"] = lambda: teacher_prompt(_teacher_ctx(""), "retained prompt")
    return cases
