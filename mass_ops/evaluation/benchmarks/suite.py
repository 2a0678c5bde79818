"""A benchmark trial run one instance at a time, resumable per (benchmark, instance, trial) (MASS_SPEC §10).

Every adapter (Terminal-Bench 2.0, SWE-bench Verified, DSBench, AstaBench E2E-Bench-Hard) offers the same
`BenchmarkAdapter` face: its tasks, its evaluator's version, and `grade` of one task's workspace. `run_benchmark_trial`
first checks the grader can run here (a container engine or cluster when the benchmark needs one, the evaluator
installed) — before any agent time — then for each task runs its episode, grades it and records the task's score as
an artifact; a rerun after an interruption skips every task whose score is recorded (and the episode executor
reuses finished episodes), so no finished instance runs or is graded twice. The trial's result, with the
evaluator's version and tasks attempted vs scored, is recorded as the trial's ``evaluations`` row.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.grading import ContainerRunner, require_grader_host
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkTask,
    TaskScore,
    TrialResult,
    materialized_workspaces,
    record_trial,
    run_trial,
)
from mass_ops.layout import report_prefix
from mass_ops.runtime.episode import EpisodeExecutor


class BenchmarkAdapter(Protocol):
    """What the suite runner needs from a benchmark."""

    name: str
    needs_container: bool

    def tasks(self) -> list[BenchmarkTask]: ...

    def evaluator(self) -> str: ...

    def grade(
        self, task: BenchmarkTask, workspace: Path | None, runner: ContainerRunner | None
    ) -> tuple[float, dict[str, Any]]: ...


def instance_key(ctx: CycleContext, benchmark: str, generation: str, trial: int, task: str) -> str:
    """Artifact key of one task's recorded score in one trial."""
    return f"{report_prefix(ctx.cycle_name)}/benchmarks/{benchmark}/{generation}/t{trial}/instances/{task}.json"


def run_benchmark_trial(
    ctx: CycleContext,
    adapter: BenchmarkAdapter,
    executor: EpisodeExecutor,
    generation: str,
    trial: int,
    *,
    runner: ContainerRunner | None,
    limit: int | None = None,
) -> TrialResult:
    """Run, grade and record trial `trial` of `generation` on `adapter`'s tasks (the first `limit` when given)."""
    require_grader_host(adapter.name, needs_container=adapter.needs_container, runner=runner)
    evaluator = adapter.evaluator()  # raises EvaluatorNotInstalledError before any episode runs
    tasks: Sequence[BenchmarkTask] = adapter.tasks()
    if limit is not None:
        tasks = tasks[:limit]
    scores = []
    for task in tasks:
        key = instance_key(ctx, adapter.name, generation, trial, task.name)
        if ctx.artifacts.exists(key):
            scores.append(TaskScore.from_dict(ctx.artifacts.get_json(key)))
            continue
        [outcome] = run_trial(ctx, executor, [task], generation, trial)
        with materialized_workspaces(ctx, [outcome]) as roots:
            score, details = adapter.grade(task, roots.get(task.name), runner)
        scored = TaskScore(task.name, score, outcome.episode_id, {**details, "episode_status": outcome.status})
        ctx.artifacts.put_json(key, scored.as_dict())
        scores.append(scored)
    metrics = {
        "evaluator": evaluator,
        "attempted": len(tasks),
        "scored": sum(1 for s in scores if s.score is not None),
        "limit": limit,
    }
    return record_trial(ctx, TrialResult(adapter.name, generation, trial, tuple(scores), metrics))
