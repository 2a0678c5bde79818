"""RHI workflow search (MASS_SPEC §3): `champion` holds the BEST-H rule, `prompt` the optimizer prompt, `proposal`
the parsing and guardrails of its answer, `driver` the resumable per-version step, the per-task chain and the
concurrent multi-task search."""

from mass_ops.search.champion import ChampionState, arbitration_key, baseline_key, derive_champion
from mass_ops.search.driver import (
    SearchEpisodeError,
    SearchError,
    SearchFailedError,
    StepResult,
    TaskSearchResult,
    search_step,
    search_task,
    search_task_ids,
    search_tasks,
)
from mass_ops.search.proposal import Proposal, ProposalError, parse_proposal

__all__ = [
    "ChampionState",
    "Proposal",
    "ProposalError",
    "SearchEpisodeError",
    "SearchError",
    "SearchFailedError",
    "StepResult",
    "TaskSearchResult",
    "arbitration_key",
    "baseline_key",
    "derive_champion",
    "parse_proposal",
    "search_step",
    "search_task",
    "search_task_ids",
    "search_tasks",
]
