"""Rank and select stages: self-judged ring tournament + Bradley–Terry per task, then the train/val split
(MASS_SPEC §1 rank/select, §5 self-judge, §6).

Per eligible task: the completed teacher episodes are scheduled by `tournament_pairs` (seed ranking.seed + q),
match i is judged once by the current model with seed ranking.seed + 1000·q + i (labels candidate-a/candidate-b),
verdicts go to the `ranking` ledger keyed ``<a>_vs_<b>`` (a rerun judges only missing pairs), and the Bradley–Terry
scores with 95% bootstrap intervals become `rankings` rows. Selection puts ranks 1..train_ranks into train and
rank validation_rank into val.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

from mass_ops.compute.limits import EndpointSlots
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.critical_path import server_priority
from mass_ops.errors import InputError
from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, build_bundle
from mass_ops.judge.invalid_verdicts import InvalidVerdictBudget
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import CANDIDATE_A_LABEL, CANDIDATE_B_LABEL
from mass_ops.judge.workspaces import EvidenceCache, StoredWorkspace
from mass_ops.layout import episode_name, teacher_condition
from mass_ops.llm import LLMClient
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling, open_client
from mass_ops.ranking import (
    MatchResult,
    RankedEntry,
    RankingError,
    bootstrap_intervals,
    bradley_terry,
    rank,
    tournament_pairs,
)
from mass_ops.seeds import match_seed, schedule_seed
from mass_ops.selection import Selection, select_trajectories
from mass_ops.stages.collect import eligible_tasks
from mass_ops.store.schema import Comparison, Ledger

logger = logging.getLogger(__name__)

# The reference counts ranking evidence tokens with the o200k tokenizer of this model name (MASS_SPEC §5).
RANKING_TOKEN_MODEL = "gpt-5.5"
# The Bradley-Terry fit counts an invalid verdict as a tie; the stored verdicts are the schema's four.
_MATCH_OUTCOMES: dict[str, Literal["A", "B", "tie"]] = {"A": "A", "B": "B", "tie": "tie", "invalid": "tie"}
CONFIDENCE_LEVEL = 0.95


class RankStageError(InputError):
    """A task cannot be ranked or selected (too few completed candidates, missing workspace, not ranked yet)."""


@dataclass(frozen=True)
class Candidate:
    """A completed teacher episode taking part in its task's tournament."""

    name: str
    episode_id: int
    workspace_uri: str


def match_key(a: str, b: str) -> str:
    """Ledger key of the match with `a` shown as A and `b` as B."""
    return f"{a}_vs_{b}"


def ranking_candidates(ctx: CycleContext, task_id: int) -> list[Candidate]:
    """The succeeded collection episodes of a task (candidates 0..N-1 of this generation), named as the reference
    names them: ``t{q}_L{g}_s{seed}``."""
    condition = teacher_condition(task_id, ctx.config.generation)
    limit = ctx.config.collection.candidates
    candidates = []
    for episode in ctx.repo.completed_episodes(ctx.cycle_id, task_id, "collection"):
        if episode.candidate is None or episode.candidate >= limit or episode.condition != condition:
            continue
        uri = (episode.artifacts or {}).get("workspace")
        if not uri:
            raise RankStageError(f"task {task_id}: episode {episode.unit_key} has no workspace artifact to judge")
        candidates.append(Candidate(episode_name(condition, episode.seed), episode.id, uri))
    return sorted(candidates, key=lambda c: c.name)


@dataclass(frozen=True)
class TaskRanking:
    """A task's tournament and Bradley–Terry result."""

    task_id: int
    candidates: int
    matches: int
    judged_now: int
    invalid: int
    ranked: tuple[RankedEntry, ...]

    def as_row(self) -> dict[str, Any]:
        best = self.ranked[0] if self.ranked else None
        return {
            "task": self.task_id,
            "candidates": self.candidates,
            "matches": self.matches,
            "judged_now": self.judged_now,
            "invalid_verdicts": self.invalid,
            "best": best.name if best else None,
            "best_score": round(best.score, 4) if best else None,
        }


def _ranking_caps(config: CycleConfig) -> EvidenceCaps:
    if config.is_remote_backend:
        return EvidenceCaps.remote(RANKING_TOKEN_MODEL)
    return EvidenceCaps.local(RANKING_TOKEN_MODEL)


def _tournament_candidates(ctx: CycleContext, task_id: int) -> list[Candidate]:
    """The task's candidates; raises RankStageError when fewer than validation_rank completed."""
    candidates = ranking_candidates(ctx, task_id)
    needed = ctx.config.collection.validation_rank
    if len(candidates) < needed:
        raise RankStageError(
            f"task {task_id}: {len(candidates)} completed collection episodes, need at least validation_rank = "
            f"{needed}; rerun collection for the failed candidates or lower the budget"
        )
    return candidates


class _TaskTournament:
    """Plays one task's matches with the current model as judge: each candidate's evidence is built once, and
    invalid verdicts count against the task's budget (shared by the concurrent matches)."""

    def __init__(
        self,
        ctx: CycleContext,
        task_id: int,
        judge: PairwiseJudge,
        by_name: dict[str, Candidate],
        budget: InvalidVerdictBudget,
    ) -> None:
        self.ctx = ctx
        self.task_id = task_id
        self.judge = judge
        self.by_name = by_name
        self.budget = budget
        self.task_text = ctx.catalogue.task(task_id).task_text
        caps = _ranking_caps(ctx.config)
        self.bundles: EvidenceCache[EvidenceBundle] = EvidenceCache(
            lambda root, source: build_bundle(
                root,
                task_id=task_id,
                task_text=self.task_text,
                location=source.location,
                caps=caps,
                name=source.name,
                prompts=ctx.prompts,
            )
        )
        self.priority = server_priority(ctx.config, "ranking")

    def bundle(self, candidate: Candidate) -> EvidenceBundle:
        source = StoredWorkspace(self.ctx.artifacts, candidate.workspace_uri, candidate.name)
        return self.bundles.get(candidate.name, source)

    def play(self, index: int, a: str, b: str) -> Comparison:
        """Judge match `index` (`a` shown as A) and record it in the ranking ledger."""
        config, task_id = self.ctx.config, self.task_id
        key = match_key(a, b)
        seed = match_seed(config.ranking.seed, task_id, index)
        case = PairwiseCase(
            unit=CallUnit(f"task{task_id}/ranking/{key}", "self_judge", task_id),
            task_id=task_id,
            task_text=self.task_text,
            label_a=CANDIDATE_A_LABEL,
            label_b=CANDIDATE_B_LABEL,
            bundle_a=self.bundle(self.by_name[a]),
            bundle_b=self.bundle(self.by_name[b]),
            seed=seed,
            priority=self.priority,
        )
        outcome = self.judge.judge(case)
        if outcome.verdict == "invalid":
            # Beyond judge.max_invalid_fraction the task fails here, unrecorded: a rerun judges the match again.
            self.budget.admit(case.unit.key, outcome.rationale)
        return self.ctx.repo.record_comparison(
            self.ctx.cycle_id,
            task_id,
            Ledger.RANKING.value,
            key,
            side_a=a,
            side_b=b,
            judge_model=config.models.served_name,
            verdict=outcome.verdict,
            episode_a_id=self.by_name[a].episode_id,
            episode_b_id=self.by_name[b].episode_id,
            judge_provider=config.inference.backend,
            seed=seed,
            rationale=outcome.rationale,
            llm_call_id=outcome.call_id,
            usage=outcome.usage or None,
        )


def _match_results(pairs: Sequence[tuple[str, str]], recorded: dict[str, Comparison]) -> tuple[list[MatchResult], int]:
    """Every scheduled match's recorded result (an invalid verdict counts as a tie) and how many were invalid."""
    matches = []
    invalid = 0
    for a, b in pairs:
        row = recorded[match_key(a, b)]
        invalid += row.verdict == "invalid"
        outcome = _MATCH_OUTCOMES.get(row.verdict)
        if outcome is None:
            raise RankingError(f"match {a} vs {b}: stored verdict {row.verdict!r} is not A, B, tie or invalid")
        matches.append(MatchResult.from_verdict(a, b, outcome))
    return matches, invalid


def _record_scores(
    ctx: CycleContext, task_id: int, by_name: dict[str, Candidate], matches: Sequence[MatchResult]
) -> list[RankedEntry]:
    """Fit Bradley–Terry (with bootstrap intervals when configured) and record each candidate's score and rank."""
    config = ctx.config
    names = list(by_name)
    ranked = rank(bradley_terry(names, matches))
    intervals = {}
    if config.ranking.bootstrap_samples >= 2:
        intervals = bootstrap_intervals(
            names,
            matches,
            config.ranking.bootstrap_samples,
            seed=schedule_seed(config.ranking.seed, task_id),
            level=CONFIDENCE_LEVEL,
        )
    for entry in ranked:
        interval = intervals.get(entry.name)
        ctx.repo.record_ranking(
            ctx.cycle_id,
            by_name[entry.name].episode_id,
            score=entry.score,
            rank=entry.rank,
            ci_low=interval.low if interval else None,
            ci_high=interval.high if interval else None,
        )
    return ranked


def rank_task(ctx: CycleContext, task_id: int, judge: PairwiseJudge) -> TaskRanking:
    """Judge the task's missing tournament matches (concurrently within the endpoint's capacity), fit
    Bradley–Terry and record every candidate's score, interval and rank."""
    config = ctx.config
    candidates = _tournament_candidates(ctx, task_id)
    by_name = {c.name: c for c in candidates}
    pairs = tournament_pairs(
        list(by_name), config.ranking.opponents_per_episode, seed=schedule_seed(config.ranking.seed, task_id)
    )
    recorded = {row.key: row for row in ctx.repo.comparisons(ctx.cycle_id, Ledger.RANKING, task_id=task_id)}
    scheduled = {match_key(a, b) for a, b in pairs}
    budget = InvalidVerdictBudget(
        f"rank task {task_id}",
        max_fraction=config.judge.max_invalid_fraction,
        planned=len(pairs),
        already_invalid=sum(1 for key, row in recorded.items() if key in scheduled and row.verdict == "invalid"),
    )
    tournament = _TaskTournament(ctx, task_id, judge, by_name, budget)
    todo = [(i, a, b) for i, (a, b) in enumerate(pairs) if match_key(a, b) not in recorded]
    if todo:
        workers = EndpointSlots.of(config).workers(len(todo))  # the endpoint's limit, as for episodes
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"rank-t{task_id}") as pool:
            for future in [pool.submit(tournament.play, i, a, b) for i, a, b in todo]:
                row = future.result()
                recorded[row.key] = row
    matches, invalid = _match_results(pairs, recorded)
    ranked = _record_scores(ctx, task_id, by_name, matches)
    if invalid:
        logger.warning("task %s: %d of %d matches had invalid verdicts (counted as ties)", task_id, invalid, len(pairs))
    return TaskRanking(task_id, len(candidates), len(pairs), len(todo), invalid, tuple(ranked))


def rank_tasks(
    ctx: CycleContext, task_ids: Sequence[int] | None = None, *, client: LLMClient | None = None
) -> list[TaskRanking]:
    """Rank every eligible task (those collection ran for), one after another; matches within a task run
    concurrently."""
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    owned = client is None
    active = open_client(ctx.config) if client is None else client
    try:
        judge = PairwiseJudge(
            active,
            ledger,
            lambda seed: in_loop_sampling(ctx.config, seed),
            invalid_retries=ctx.config.judge.invalid_retries,
            swap_consistent=ctx.config.search.swap_consistent,
            position_bias_sample=ctx.config.judge.position_bias_sample,
            prompts=ctx.prompts,
            verdict_parsing=ctx.config.judge.verdict_parsing,
        )
        results = []
        for decision in eligible_tasks(ctx, task_ids):
            if not decision.collects:
                logger.warning("task %s not ranked: %s", decision.task_id, decision.reason)
                continue
            results.append(rank_task(ctx, decision.task_id, judge))
        return results
    finally:
        if owned:
            active.close()


@dataclass(frozen=True)
class TaskSelection:
    """Trajectories selected from one task."""

    task_id: int
    train: int
    val: int

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def select(ctx: CycleContext) -> Selection:
    """Ranks 1..train_ranks → train, validation_rank → val for every eligible training task; recorded idempotently."""
    config = ctx.config
    ranked: dict[int, list[RankedEntry]] = {}
    episode_ids: dict[tuple[int, str], int] = {}
    for decision in eligible_tasks(ctx):
        if not decision.collects:
            continue
        rows = ctx.repo.rankings(ctx.cycle_id, decision.task_id)
        if not rows:
            raise RankStageError(f"task {decision.task_id}: no ranking recorded; run the rank stage first")
        entries = []
        for row in rows:
            name = str(row.episode_id)
            entries.append(RankedEntry(name=name, score=row.score, rank=row.rank))
            episode_ids[(decision.task_id, name)] = row.episode_id
        ranked[decision.task_id] = entries
    selection = select_trajectories(
        ranked,
        train_ranks=config.collection.train_ranks,
        validation_rank=config.collection.validation_rank,
        test_tasks=config.tasks.test,
    )
    for split, chosen in (("train", selection.train), ("val", selection.val)):
        for item in chosen:
            ctx.repo.record_selection(ctx.cycle_id, episode_ids[(item.task, item.episode)], split, rank=item.rank)
    return selection


def run_rank(
    config: CycleConfig, tasks: Sequence[int] | None = None, *, client: LLMClient | None = None
) -> list[dict[str, Any]]:
    """The `rank` command: tournament + Bradley–Terry for the eligible training tasks; one row per task."""
    return [result.as_row() for result in rank_tasks(attach_cycle(config), tasks, client=client)]


def run_select(config: CycleConfig) -> list[dict[str, Any]]:
    """The `select` command: record train/val trajectories; one row per task with its counts."""
    selection = select(attach_cycle(config))
    return [TaskSelection(task, train, val).as_row() for task, (train, val) in selection.counts_by_task().items()]
