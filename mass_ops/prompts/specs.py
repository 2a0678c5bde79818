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
_HISTORY = [
    {
        "key": "v0_vs_no_harness",
        "version": 0,
        "winner": "B",
        "judge_model": "judge-model",
        "judged_at": "2026-01-01T00:00:00",
        "side_a": "s3://bucket/ref.tar.gz",
        "side_b": "s3://bucket/v0.tar.gz",
        "rationale": "B is complete.",
        "takeaways": [],
        "diff": None,
    },
    {
        "key": "v1_vs_no_harness",
        "version": 1,
        "winner": "invalid",
        "judge_model": "judge-model",
        "judged_at": "2026-01-01T01:00:00",
        "side_a": "s3://bucket/ref.tar.gz",
        "side_b": "s3://bucket/v1.tar.gz",
        "rationale": "B is missing the report.",
        "takeaways": ["B is missing the report."],
        "diff": "-old +new",
    },
]
_OPTIMIZER_FIRST_STEP: dict[str, Any] = {
    "version": 0,
    "task_text": "Study the task.",
    "current_design": f"{START_MARKER} 1. Orchestrator.",
    "best": None,
    "v0_design": None,
    "evidence": _EVIDENCE,
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
            ({"task_id": 51, "reviewer": "a senior research reviewer", "focus": "rigor and reproducibility"},),
        ),
        TemplateSpec(
            "judge_user.j2",
            "User message of a pairwise judge call: task, labels, both evidence bundles, rubric, verdict schema.",
            (
                {
                    "task_text": "Study the task.",
                    "label_a": "no-harness-single-agent-baseline",
                    "label_b": "multi-agent-design-v1",
                    "evidence_a": _EVIDENCE,
                    "evidence_b": _EVIDENCE.replace("Workspace A", "Workspace B"),
                },
            ),
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
                        "rationale": "Both won; v1 preferred.",
                        "case": "both_win_arbitration",
                    },
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
                    "delta_rows": [{"name": "missing deliverables or sections", "count": 1, "example": "B is missing"}],
                },
                {
                    **_OPTIMIZER_FIRST_STEP,
                    "version": 1,
                    "best": {
                        "version": 0,
                        "design": f"{START_MARKER} v0",
                        "rationale": "v0 won, v1 did not.",
                        "case": "champion_only_win",
                    },
                    "prior_failures": True,
                    "baseline_mode": True,
                },
            ),
        ),
        TemplateSpec(
            "optimizer_parts.j2",
            "Macros of the optimizer message: failure notice, scoreboard line, delta checklist.",
            ({},),
            macros=("failure_notice", "scoreboard", "delta_checklist"),
        ),
        TemplateSpec(
            "teacher_prompt.j2",
            "Prompt of a teacher-collection episode: the retained workflow prompt and the teacher directive.",
            ({"retained_prompt": f"Study the task.\n\n{START_MARKER} 1. Orchestrator.", "teacher_directive": "Work."},),
        ),
    )
}
