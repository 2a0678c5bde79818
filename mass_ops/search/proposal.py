"""The optimizer's answer: parsing, the structural guardrails and the optional design guardrails (MASS_SPEC §3.3).

Always applied: the answer is a JSON object whose ``improved_multi_agent_design`` starts with the start marker; an
echoed prompt suffix is cut. Optional (off in the paper preset): no fixed numeric caps on agents/rounds/time, and a
maximum design size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mass_ops.errors import InputError
from mass_ops.workflow import (
    WorkflowError,
    WorkflowPrompt,
    check_design_size,
    find_numeric_caps,
    normalize_generated_design,
)

DESIGN_FIELD = "improved_multi_agent_design"
LIST_FIELDS = (
    "changes_from_previous",
    "why_it_should_improve",
    "evidence_used",
    "expected_impact",
    "verification_checks",
)


class ProposalError(InputError):
    """The optimizer's answer cannot become the next workflow version; the message says why."""


@dataclass(frozen=True)
class Proposal:
    """A validated proposal: the normalised design block and the optimizer's explanation lists."""

    design: str
    notes: dict[str, list[str]] = field(default_factory=dict)


def _string_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item if isinstance(item, str) else str(item) for item in value]
    return [str(value)]


def parse_proposal(
    answer: dict[str, Any] | None,
    template: WorkflowPrompt,
    *,
    reject_numeric_caps: bool = False,
    max_design_chars: int | None = None,
) -> Proposal:
    """Validate the optimizer's JSON object and normalise its design against the task's prompt template."""
    if not isinstance(answer, dict):
        raise ProposalError(f"optimizer answer must be a JSON object, got {type(answer).__name__}")
    design = answer.get(DESIGN_FIELD)
    if not isinstance(design, str) or not design.strip():
        raise ProposalError(f"optimizer answer: {DESIGN_FIELD!r} must be a non-empty string")
    try:
        normalised = normalize_generated_design(design, template)
        if max_design_chars is not None:
            check_design_size(normalised, max_design_chars)
    except WorkflowError as exc:
        raise ProposalError(f"optimizer answer: {exc}") from None
    if reject_numeric_caps:
        caps = find_numeric_caps(normalised)
        if caps:
            raise ProposalError(f"optimizer answer: design imposes fixed numeric caps: {'; '.join(caps)}")
    return Proposal(design=normalised, notes={name: _string_list(answer.get(name)) for name in LIST_FIELDS})
