"""The shipped prompt templates: what each one is for and sample variables that exercise every branch.

The samples are what `PromptSet.check` renders a template with (an override is checked the same way), and their
keys are the variables a template may use: a template naming any other variable is refused at validate time, even
inside a branch the samples do not take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mass_ops.workflow import START_MARKER


@dataclass(frozen=True)
class TemplateSpec:
    """One prompt template: its file name, a one-line summary, sample variable sets and the macros callers use."""

    name: str
    summary: str
    samples: tuple[Mapping[str, Any], ...]
    macros: tuple[str, ...] = ()

    @property
    def variables(self) -> frozenset[str]:
        """Every variable the template may use."""
        return frozenset(key for sample in self.samples for key in sample)


_EVIDENCE = "# Workspace A (evidence only)\nPath: `s3://bucket/w.tar.gz`\n\n## Directory tree\n```text\nw/\n```"
# One workspace's evidence as `EvidenceBundle.variables()` gives it, taking every branch of evidence.j2.
_BUNDLE: dict[str, Any] = {
    "task_id": 51,
    "query_id": "query_51",
    "location": "s3://bucket/w.tar.gz",
    "refused": None,
    "tree": {
        "root": "query51_ourTeam",
        "lines": [
            {"depth": 1, "kind": "dir", "name": "data", "suffix": "", "count": 0},
            {"depth": 2, "kind": "crowded", "name": "", "suffix": "", "count": 150},
            {"depth": 1, "kind": "file", "name": "prices.parquet", "suffix": ".parquet", "count": 0},
            {"depth": 1, "kind": "file", "name": "research_report.md", "suffix": "", "count": 0},
        ],
        "truncated": True,
        "child_limit": 100,
        "backticks": 0,
    },
    "preflight": {
        "core": [{"path": "research_report.md", "found": True}, {"path": "requirements.txt", "found": False}],
        "plots": [{"path": "deliverables/plots/a.png", "found": True}],
        "plot_count": 41,
        "plots_found": 1,
    },
    "excerpts": [
        {
            "path": "research_report.md",
            "truncated": True,
            "backticks": 3,
            "parts": [
                {"kind": "text", "text": "# Report ```"},
                {"kind": "token_cut", "start": 0, "stop": 4},
                {"kind": "char_cut", "omitted": 120},
                {"kind": "text", "text": "end"},
            ],
        },
        {"path": "main.py", "truncated": False, "backticks": 0, "parts": [{"kind": "text", "text": "print(1)"}]},
    ],
}
_APPENDIX: dict[str, Any] = {
    "results_dir": True,
    "files": [
        {"path": "results/a.json", "head": "{", "tail": "}", "truncated": True, "unreadable": False, "backticks": 0},
        {"path": "results/b.json", "head": "{}", "tail": "", "truncated": False, "unreadable": False, "backticks": 0},
    ],
    "omitted": [{"path": "results/big.json", "chars": 24029}],
    "per_file_chars": 24000,
    "total_chars": 120000,
}
_HISTORY = [
    {
        "key": "v0_vs_no_harness",
        "version": 0,
        "label_a": "no-harness-single-agent-baseline",
        "label_b": "multi-agent-design-v0",
        "winner": "B",
        "judge_model": "judge-model",
        "judged_at": "2026-01-01T00:00:00.123456+00:00",
        "side_a": "reference",
        "side_b": "v0",
        "episode_a": "reference-t51-s1/a1",
        "episode_b": None,
        "rationale": {"text": "B is complete.", "truncated": False},
        "takeaways": [],
        "diff": None,
    },
    {
        "key": "v1_vs_no_harness",
        "version": 1,
        "label_a": "no-harness-single-agent-baseline",
        "label_b": "multi-agent-design-v1",
        "winner": "invalid",
        "judge_model": "judge-model",
        "judged_at": None,
        "side_a": "reference",
        "side_b": "v1",
        "episode_a": "reference-t51-s1/a1",
        "episode_b": "search-t51-v1-s1001/a1",
        "rationale": {"text": "B is missing the", "truncated": True},
        "takeaways": ["B is missing the report."],
        "diff": {
            "text": "--- multi_agent_design_v0 +++ multi_agent_design_v1 -old +new",
            "truncated": False,
            "identical": False,
        },
    },
    {
        "key": "v2_vs_no_harness",
        "version": 2,
        "label_a": "no-harness-single-agent-baseline",
        "label_b": "multi-agent-design-v2",
        "winner": "tie",
        "judge_model": "judge-model",
        "judged_at": "2026-01-01T02:00:00+00:00",
        "side_a": "reference",
        "side_b": "v2",
        "episode_a": None,
        "episode_b": None,
        "rationale": {"text": "", "truncated": False},
        "takeaways": [],
        "diff": {"text": "", "truncated": False, "identical": True},
    },
]
_OPTIMIZER_FIRST_STEP: dict[str, Any] = {
    "version": 0,
    "task_text": "Study the task.",
    "current_design": f"{START_MARKER} 1. Orchestrator.",
    "best": None,
    "v0_design": None,
    "evidence": _BUNDLE,
    "results_appendix": _APPENDIX,
    "run_status_json": '{\n  "exit_code": 0\n}',
    "run_failed": False,
    "prior_failures": False,
    "baseline_mode": False,
    "scoreboard": [{"version": 0, "verdict": None, "retained": False}],
    "history": [],
    "delta_rows": [],
    "start_marker": START_MARKER,
}

TEMPLATES: dict[str, TemplateSpec] = {
    spec.name: spec
    for spec in (
        TemplateSpec(
            "judge_system.j2",
            "System message of every pairwise judge (RHI, arbitration, ranking self-judge, report judges).",
            ({"task_id": 51}, {"task_id": 202}, {"task_id": 324}, {"task_id": 150}),
        ),
        TemplateSpec(
            "judge_user.j2",
            "User message of a pairwise judge call: task, labels, both evidence bundles, rubric, verdict schema.",
            (
                {
                    "task_text": "Study the task.",
                    "label_a": "no-harness-single-agent-baseline",
                    "label_b": "multi-agent-design-v1",
                    "evidence_a": _BUNDLE,
                    "evidence_b": {**_BUNDLE, "excerpts": [], "tree": {**_BUNDLE["tree"], "truncated": False}},
                },
                {
                    "task_text": "Study the task.",
                    "label_a": "candidate-a",
                    "label_b": "candidate-b",
                    "evidence_a": {**_BUNDLE, "refused": "archive over the limits"},
                    "evidence_b": {**_BUNDLE, "preflight": {**_BUNDLE["preflight"], "plots": [], "plot_count": 0}},
                },
            ),
        ),
        TemplateSpec(
            "evidence.j2",
            "Macros rendering a workspace's evidence and the optimizer's results/ appendix, and the cut markers.",
            ({},),
            macros=("evidence", "results_appendix", "token_cut_marker", "appendix_cut_marker"),
        ),
        TemplateSpec("optimizer_system.j2", "System message of the RHI optimizer.", ({},)),
        TemplateSpec(
            "optimizer_user.j2",
            "User message of the RHI optimizer: query, evidence, metadata, verdict history, checklist, schema.",
            (
                _OPTIMIZER_FIRST_STEP,
                {
                    **_OPTIMIZER_FIRST_STEP,
                    "version": 2,
                    "best": {
                        "version": 1,
                        "design": f"{START_MARKER} best",
                        "rationale": {"text": "Both won; v1 preferred", "truncated": False, "needs_period": True},
                        "case": "both_win_arbitration",
                    },
                    "results_appendix": {**_APPENDIX, "files": [], "omitted": []},
                    "v0_design": f"{START_MARKER} root",
                    "run_failed": True,
                    "prior_failures": True,
                    "baseline_mode": True,
                    "scoreboard": [
                        {"version": 0, "verdict": "B", "retained": False},
                        {"version": 1, "verdict": "invalid", "retained": True},
                        {"version": 2, "verdict": None, "retained": False},
                    ],
                    "history": _HISTORY,
                    "delta_rows": [
                        {"bucket": "missing", "count": 2, "example": "B is missing the report."},
                        {"bucket": "validation", "count": 1, "example": None},
                    ],
                },
                {
                    **_OPTIMIZER_FIRST_STEP,
                    "version": 1,
                    "best": {
                        "version": 0,
                        "design": f"{START_MARKER} v0",
                        "rationale": {"text": "v0 won, v1 did not", "truncated": True, "needs_period": False},
                        "case": "champion_only_win",
                    },
                    "run_status_json": None,
                    "prior_failures": True,
                    "baseline_mode": True,
                },
            ),
        ),
        TemplateSpec(
            "optimizer_parts.j2",
            "Macros of the optimizer message: failure notice, scoreboard line, delta checklist, text endings.",
            ({},),
            macros=("failure_notice", "scoreboard", "delta_checklist", "cut"),
        ),
        TemplateSpec(
            "teacher_prompt.j2",
            "Prompt of a teacher-collection episode: the retained workflow prompt and the teacher directive.",
            (
                {
                    "retained_prompt": f"Study the task.\n\n{START_MARKER} 1. Orchestrator.",
                    "teacher_directive": "Work.\n",
                },
            ),
        ),
    )
}
