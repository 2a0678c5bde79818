"""Evaluation rollouts: bare-task episodes of one model generation over a task pool (MASS_SPEC §1 rollout, §10).

Replicate i of task q runs the bare prompt with seed `rollout_seed(rollout_seed_base, q, i)` and condition
``t{q}_bare``; the seeds do not depend on the generation, so the rollouts of L(k) and L(k+1) are paired by
(task, replicate). Episodes are recorded as kind ``rollout`` with `generation` set, and the generation is part of the
unit's identity (its slug and artifact folder) so that two generations never share artifacts.

A *rollout set* is the manifest of one run of this stage: its label, generation, task pool, replicate count and one
entry per episode. It is an `evaluations` row (kind ``rollouts``) keyed by cycle and label, written once: the
reference release overwrites ``evaluation/rollouts.json`` on every run, mass-ops keeps every set, and a different
pool or count under an existing label is refused (pick a new label). Rerunning the same set reuses every finished
episode through the executor and rewrites nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.layout import EpisodeUnit, bare_condition, report_prefix
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest
from mass_ops.seeds import rollout_seed
from mass_ops.store.schema import Evaluation

ROLLOUT_SET_KIND = "rollouts"
Split = Literal["train", "test", "all"]


class RolloutError(InputError):
    """A rollout set cannot be built or used (unknown task or generation, label clash, unfinished episodes)."""


def resolve_rollout_tasks(
    config: CycleConfig, *, tasks: Sequence[int] | None = None, split: Split | None = None
) -> list[int]:
    """The task pool: explicit `tasks`, else the tasks of `split` (MASS_SPEC §1), else `config.rollout_tasks()`.

    Explicit ids must be train candidates or test tasks; duplicates are an error.
    """
    if tasks is not None and split is not None:
        raise RolloutError("rollouts: give --tasks or --split, not both")
    if tasks is not None:
        chosen = [int(task) for task in tasks]
        known = set(config.tasks.train_candidates) | set(config.tasks.test)
        stray = sorted(set(chosen) - known)
        if stray:
            raise RolloutError(f"rollouts: tasks {stray} are neither train candidates nor test tasks of this cycle")
        dupes = sorted({task for task in chosen if chosen.count(task) > 1})
        if dupes:
            raise RolloutError(f"rollouts: tasks {dupes} are listed more than once")
    elif split is not None:
        if split not in ("train", "test", "all"):
            raise RolloutError(f"rollouts: split must be train, test or all, got {split!r}")
        chosen = config.tasks.for_split(split)
    else:
        chosen = config.rollout_tasks()
    if not chosen:
        raise RolloutError("rollouts: the task pool is empty")
    return chosen


def _count(config: CycleConfig, count: int | None) -> int:
    value = config.evaluation.rollout_count if count is None else count
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RolloutError(f"rollouts: count must be an integer ≥ 1, got {value!r}")
    return value


def _check_generation_name(generation: str) -> str:
    if not isinstance(generation, str) or not generation.strip() or any(c in generation for c in "/ \t\n"):
        raise RolloutError(f"rollouts: generation must be a model name without spaces or '/', got {generation!r}")
    return generation


def rollout_requests(
    ctx: CycleContext, generation: str, tasks: Sequence[int] | None = None, count: int | None = None
) -> list[EpisodeRequest]:
    """One bare-task request per (task, replicate), in task-then-replicate order."""
    generation = _check_generation_name(generation)
    pool = resolve_rollout_tasks(ctx.config, tasks=tasks)
    replicates = _count(ctx.config, count)
    base = ctx.config.evaluation.rollout_seed_base
    requests = []
    for task_id in pool:
        prompt = ctx.catalogue.task(task_id).bare_prompt
        for replicate in range(replicates):
            unit = EpisodeUnit(
                cycle=ctx.cycle_name,
                task_id=task_id,
                kind="rollout",
                seed=rollout_seed(base, task_id, replicate),
                candidate=replicate,
                generation=generation,
            )
            requests.append(EpisodeRequest(unit, bare_condition(task_id), prompt, generation=generation))
    return requests


@dataclass(frozen=True)
class RolloutEntry:
    """One rollout of a set: (task, replicate), its seed and the recorded episode (final attempt)."""

    task: int
    replicate: int
    seed: int
    episode_id: int
    unit_key: str
    status: str
    workspace: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "replicate": self.replicate,
            "seed": self.seed,
            "episode_id": self.episode_id,
            "unit_key": self.unit_key,
            "status": self.status,
            "workspace": self.workspace,
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RolloutEntry:
        return cls(
            task=int(row["task"]),
            replicate=int(row["replicate"]),
            seed=int(row["seed"]),
            episode_id=int(row["episode_id"]),
            unit_key=str(row["unit_key"]),
            status=str(row["status"]),
            workspace=row.get("workspace"),
        )


@dataclass(frozen=True)
class RolloutSet:
    """The manifest of one rollout run (see the module docstring)."""

    cycle: str
    label: str
    generation: str
    tasks: tuple[int, ...]
    count: int
    entries: tuple[RolloutEntry, ...]

    @property
    def key(self) -> str:
        return rollout_set_key(self.cycle, self.label)

    def spec(self) -> dict[str, Any]:
        """What the set was asked to be: a rerun under the same label must ask for the same."""
        return {"generation": self.generation, "tasks": list(self.tasks), "count": self.count}

    def as_results(self) -> dict[str, Any]:
        return {
            "cycle": self.cycle,
            "label": self.label,
            **self.spec(),
            "entries": [entry.as_dict() for entry in self.entries],
        }

    @classmethod
    def from_results(cls, results: dict[str, Any]) -> RolloutSet:
        return cls(
            cycle=str(results["cycle"]),
            label=str(results["label"]),
            generation=str(results["generation"]),
            tasks=tuple(int(t) for t in results["tasks"]),
            count=int(results["count"]),
            entries=tuple(RolloutEntry.from_dict(row) for row in results["entries"]),
        )


def rollout_set_key(cycle: str, label: str) -> str:
    """Evaluation key of a rollout set."""
    return f"{cycle}/{ROLLOUT_SET_KIND}/{label}"


def rollout_manifest_key(cycle: str, label: str) -> str:
    """Artifact key of a rollout set's manifest (the compatibility form of ``evaluation/rollouts.json``)."""
    return f"{report_prefix(cycle)}/rollouts/{label}.json"


def default_label(generation: str, tasks: Sequence[int], count: int) -> str:
    """Deterministic label of a set: the generation plus a digest of pool and count, so a retried run resumes the
    same set while another pool or count makes a new one."""
    digest = hashlib.sha256(json.dumps({"tasks": list(tasks), "count": count}).encode()).hexdigest()[:8]
    return f"{generation}-{digest}"


def _check_label(label: str) -> str:
    if not isinstance(label, str) or not label or len(label) > 100 or any(c in label for c in "/ \t\n"):
        raise RolloutError(f"rollouts: label must be 1-100 characters without spaces or '/', got {label!r}")
    return label


def _entry(outcome: EpisodeOutcome, unit_key: str) -> RolloutEntry:
    unit = outcome.request.unit
    return RolloutEntry(
        task=int(unit.task_id),
        replicate=int(unit.candidate or 0),
        seed=unit.seed,
        episode_id=outcome.episode_id,
        unit_key=unit_key,
        status=outcome.status,
        workspace=outcome.artifacts.get("workspace"),
    )


def find_rollout_set(ctx: CycleContext, label: str) -> RolloutSet | None:
    """The recorded set `label` of this cycle, or None."""
    rows = [
        row for row in ctx.repo.evaluations(kind=ROLLOUT_SET_KIND) if row.key == rollout_set_key(ctx.cycle_name, label)
    ]
    return RolloutSet.from_results(rows[0].results) if rows else None


def load_rollout_set(ctx: CycleContext, label: str) -> RolloutSet:
    """The recorded set `label` of this cycle; RolloutError naming the known labels when absent."""
    found = find_rollout_set(ctx, label)
    if found is None:
        known = ", ".join(s.label for s in rollout_sets(ctx)) or "none"
        raise RolloutError(f"rollout set {label!r} is not recorded in cycle {ctx.cycle_name} (recorded: {known})")
    return found


def rollout_sets(ctx: CycleContext) -> list[RolloutSet]:
    """Every rollout set recorded for this cycle, oldest first."""
    prefix = f"{ctx.cycle_name}/{ROLLOUT_SET_KIND}/"
    rows: list[Evaluation] = [row for row in ctx.repo.evaluations(kind=ROLLOUT_SET_KIND) if row.key.startswith(prefix)]
    return [RolloutSet.from_results(row.results) for row in rows]


def run_rollouts(
    ctx: CycleContext,
    executor: EpisodeExecutor,
    generation: str,
    *,
    tasks: Sequence[int] | None = None,
    split: Split | None = None,
    count: int | None = None,
    label: str | None = None,
) -> RolloutSet:
    """Run (or reuse) the rollouts of `generation` and record the set once every episode has a final status.

    The generation must be a registered model (the set is an evaluation of it). Episodes that ended in an
    infrastructure failure leave the set unrecorded and raise: rerun once the endpoint is healthy (the executor
    makes new attempts and reuses everything else).
    """
    generation = _check_generation_name(generation)
    model = ctx.repo.get_generation(generation)
    if model is None:
        raise RolloutError(f"rollouts: generation {generation!r} is not a registered model; register it first")
    pool = resolve_rollout_tasks(ctx.config, tasks=tasks, split=split)
    replicates = _count(ctx.config, count)
    label = _check_label(label or default_label(generation, pool, replicates))
    wanted = {"generation": generation, "tasks": pool, "count": replicates}
    existing = find_rollout_set(ctx, label)
    if existing is not None:
        if existing.spec() != wanted:
            raise RolloutError(
                f"rollout set {label!r} already exists with {existing.spec()}; this run asks for {wanted}: "
                "choose a new label (sets are never overwritten)"
            )
        return existing
    requests = rollout_requests(ctx, generation, pool, replicates)
    outcomes = executor.run(requests)
    if len(outcomes) != len(requests):
        raise RolloutError(f"rollouts: the executor returned {len(outcomes)} outcomes for {len(requests)} requests")
    entries = []
    for outcome in outcomes:
        row = ctx.repo.get_episode(outcome.episode_id)
        if row is None or row.kind != "rollout" or row.generation != generation:
            raise RolloutError(f"rollouts: episode {outcome.episode_id} is not a recorded rollout of {generation}")
        entries.append(_entry(outcome, row.unit_key))
    # A set is frozen once recorded: an episode that did not finish (infrastructure, or its budget spent) must be
    # redone first, or it would count as the generation's result forever.
    failed = [e.unit_key for e in entries if e.status == "infra_failure"]
    if failed:
        raise RolloutError(
            f"rollouts: {len(failed)} episode(s) ended in infrastructure failures ({', '.join(failed[:5])}); "
            "rerun once the endpoint is healthy — finished episodes are reused"
        )
    stopped = [e.unit_key for e in entries if e.status == "budget_exhausted"]
    if stopped:
        raise RolloutError(
            f"rollouts: {len(stopped)} episode(s) were stopped by a spent budget ({', '.join(stopped[:5])}); raise "
            "the budget (config budgets.*) and rerun — finished episodes are reused"
        )
    rollout_set = RolloutSet(ctx.cycle_name, label, generation, tuple(pool), replicates, tuple(entries))
    manifest = ctx.artifacts.put_json(rollout_manifest_key(ctx.cycle_name, label), rollout_set.as_results())
    recorded = ctx.repo.record_evaluation(
        rollout_set.key,
        ROLLOUT_SET_KIND,
        generation_id=model.id,
        results=rollout_set.as_results(),
        cycle_id=ctx.cycle_id,
        results_uri=manifest.uri,
        results_sha256=manifest.sha256,
    )
    # A concurrent run may have recorded the same label first: its row is the truth.
    return RolloutSet.from_results(recorded.results)
