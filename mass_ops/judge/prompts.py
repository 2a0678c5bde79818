"""Pairwise judge prompts: labels and the message builders (MASS_SPEC §5); the verdict schema and its parser live in
`verdicts`. The texts, personas included, are the templates ``judge_system.j2`` and ``judge_user.j2``
(`mass_ops.prompts`); this module chooses their variables.

The same prompt serves the RHI judge (a version against the bare reference), champion arbitration and the
self-judge of the ranking tournament; only the labels differ.
"""

from __future__ import annotations

from mass_ops.judge.evidence import EvidenceBundle

# The verdict schema and its parser live in `mass_ops.judge.verdicts`; re-exported for existing imports.
from mass_ops.judge.verdicts import WINNERS, JudgeOutputError, PairwiseVerdict, Winner, parse_verdict  # noqa: F401
from mass_ops.prompts import PromptSet, shipped_prompts

# Labels of the RHI ledgers and the ranking tournament.
REFERENCE_LABEL = "no-harness-single-agent-baseline"
CANDIDATE_A_LABEL = "candidate-a"
CANDIDATE_B_LABEL = "candidate-b"


def version_label(version: int) -> str:
    """Label of workflow version k in judge prompts."""
    return f"multi-agent-design-v{version}"


def judge_system_prompt(task_id: int, *, prompts: PromptSet | None = None) -> str:
    """System prompt of a pairwise judge for `task_id` (template ``judge_system.j2``, which picks the reviewer by
    the task's id range)."""
    return (prompts or shipped_prompts()).render("judge_system.j2", task_id=task_id)


def judge_user_prompt(
    task_text: str,
    label_a: str,
    label_b: str,
    bundle_a: EvidenceBundle,
    bundle_b: EvidenceBundle,
    *,
    prompts: PromptSet | None = None,
) -> str:
    """The pairwise message (template ``judge_user.j2``): task, labels, both bundles, rubric and schema. Both bundles
    must be of one task."""
    if (bundle_a.task_id, bundle_a.query_id) != (bundle_b.task_id, bundle_b.query_id):
        raise ValueError(
            f"pairwise prompt: bundles belong to different tasks ({bundle_a.query_id} vs {bundle_b.query_id})"
        )
    return (prompts or shipped_prompts()).render(
        "judge_user.j2",
        task_text=task_text.strip(),
        label_a=label_a,
        label_b=label_b,
        evidence_a=bundle_a.variables(),
        evidence_b=bundle_b.variables(),
    )
