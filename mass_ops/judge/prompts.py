"""Pairwise judge prompts: domain personas, the relative rubric, labels and the verdict schema (MASS_SPEC §5).

The same prompt serves the RHI judge (a version against the bare reference), champion arbitration and the
self-judge of the ranking tournament; only the labels differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.errors import InputError
from mass_ops.judge.evidence import EvidenceBundle

Winner = Literal["A", "B", "tie"]
WINNERS: tuple[str, ...] = ("A", "B", "tie")

# Labels of the RHI ledgers and the ranking tournament.
REFERENCE_LABEL = "no-harness-single-agent-baseline"
CANDIDATE_A_LABEL = "candidate-a"
CANDIDATE_B_LABEL = "candidate-b"


def version_label(version: int) -> str:
    """Label of workflow version k in judge prompts."""
    return f"multi-agent-design-v{version}"


class JudgeOutputError(InputError):
    """The judge answered with JSON that is not a valid verdict."""


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
    """(who the judge is, what it weighs) for a task, by id range: 1–99 finance, 200–299 pharmacy, 300–399
    robotics, anything else a general reviewer."""
    for ids, who, focus in _PERSONAS:
        if task_id in ids:
            return who, focus
    return _DEFAULT_PERSONA


def judge_system_prompt(task_id: int) -> str:
    """System prompt of a pairwise judge for `task_id`."""
    who, focus = persona(task_id)
    return (
        f"You are {who} acting as a strict, evidence-driven reviewer of two research workspaces produced for the "
        f"same task. You pay particular attention to {focus}.\n"
        "Rules:\n"
        "- The Task block is the only contract. Judge each workspace by how well it fulfils that task.\n"
        "- The workspaces are evidence only: rely on the directory tree, preflight and excerpts you are shown and "
        "never assume or invent contents that are not shown.\n"
        "- Use the task's explicit Deliverables list as a checklist.\n"
        "- Cite concrete file paths, JSON keys or report sections for every claim.\n"
        "- Choose A or B when one workspace is clearly better overall; answer tie only when they are genuinely "
        "comparable.\n"
        "- Answer with one JSON object and nothing else."
    )


RUBRIC = """# Relative rubric (compare A with B on each point, then decide overall)
1. Deliverable coverage: every required file, section and plot exists and is complete.
2. Numerical and empirical rigor: sound baselines, validation without leakage, uncertainty, numbers consistent
   between the report and the results files.
3. Reproducibility: pinned requirements, a single entry point that regenerates the results, fixed seeds, tests.
4. Presentation: a clear conference-style report whose claims are supported by the evidence.
5. Engineering: correct, organised, runnable code.
6. Task alignment: answers the question asked, with the methods and evaluations the task requires."""

OUTPUT_SCHEMA = """# Output
Return exactly one JSON object with these keys and nothing else:
{"winner": "A" | "B" | "tie", "rationale": "<non-empty justification citing paths, keys or sections>"}"""


def judge_user_prompt(
    task_text: str,
    label_a: str,
    label_b: str,
    bundle_a: EvidenceBundle,
    bundle_b: EvidenceBundle,
) -> str:
    """The pairwise message: task, labels, both bundles, rubric and schema. Both bundles must be of one task."""
    if (bundle_a.task_id, bundle_a.query_id) != (bundle_b.task_id, bundle_b.query_id):
        raise ValueError(
            f"pairwise prompt: bundles belong to different tasks ({bundle_a.query_id} vs {bundle_b.query_id})"
        )
    return "\n\n".join(
        [
            f"# Task\n{task_text.strip()}",
            "# Labels (for orientation only)\n"
            f"- Workspace A: {label_a}\n- Workspace B: {label_b}\n"
            "The labels only say how each run was produced; judge the evidence, not the label.",
            bundle_a.render("Workspace A"),
            bundle_b.render("Workspace B"),
            RUBRIC,
            OUTPUT_SCHEMA,
        ]
    )


@dataclass(frozen=True)
class PairwiseVerdict:
    """A valid judge answer."""

    winner: Winner
    rationale: str


def parse_verdict(answer: dict[str, Any] | None) -> PairwiseVerdict:
    """Validate a parsed judge answer against {winner: A|B|tie, rationale: non-empty string}.

    The winner is matched after trimming and ignoring case ("a", " Tie "); anything else raises JudgeOutputError.
    """
    if not isinstance(answer, dict):
        raise JudgeOutputError(f"judge answer must be a JSON object, got {type(answer).__name__}")
    winner = answer.get("winner")
    normalised = {w.lower(): w for w in WINNERS}.get(winner.strip().lower()) if isinstance(winner, str) else None
    if normalised is None:
        raise JudgeOutputError(f"judge answer: 'winner' must be one of A, B, tie; got {winner!r}")
    rationale = answer.get("rationale")
    if not isinstance(rationale, str) or not rationale.strip():
        raise JudgeOutputError("judge answer: 'rationale' must be a non-empty string")
    return PairwiseVerdict(winner=normalised, rationale=rationale.strip())  # type: ignore[arg-type]
