"""Pairwise judge prompts: domain personas, labels, the verdict schema and its parser (MASS_SPEC §5). The texts are
the templates ``judge_system.j2`` and ``judge_user.j2`` (`mass_ops.prompts`); this module chooses their variables.

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


_PERSONAS: tuple[tuple[range, str, str], ...] = (
    (
        range(1, 100),
        "a senior quantitative researcher",
        "out-of-sample discipline and freedom from look-ahead leakage, honest baselines, uncertainty estimates, "
        "reproducibility, and whether the narrative matches the numbers",
    ),
    (
        range(200, 300),
        "a senior researcher in pharmacy",
        "validation design, integrity of data and protocol, and honest statements of limitations",
    ),
    (
        range(300, 400),
        "a senior researcher in robotics",
        "experimental design, the sim-to-real gap, evaluation methodology and reproducibility",
    ),
)
_DEFAULT_PERSONA = ("a senior research reviewer", "rigor, completeness and reproducibility of the evidence")


def persona(task_id: int) -> tuple[str, str]:
    """(who the judge is, what it weighs) for a task — the template's `reviewer` and `focus` — by id range: 1–99
    finance, 200–299 pharmacy, 300–399 robotics, anything else a general reviewer."""
    for ids, who, focus in _PERSONAS:
        if task_id in ids:
            return who, focus
    return _DEFAULT_PERSONA


def judge_system_prompt(task_id: int, *, prompts: PromptSet | None = None) -> str:
    """System prompt of a pairwise judge for `task_id` (template ``judge_system.j2``)."""
    who, focus = persona(task_id)
    return (prompts or shipped_prompts()).render("judge_system.j2", task_id=task_id, reviewer=who, focus=focus)


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
