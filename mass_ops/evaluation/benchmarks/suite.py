"""A benchmark trial run one instance at a time, resumable per (benchmark, instance, trial) (MASS_SPEC §10).

Every adapter offers the same `BenchmarkAdapter` face: its tasks, its evaluator's version, and `grade` of one task's
workspace. `run_benchmark_trial` checks the grader can run here and every task's workspace seed before any agent
time, then per task runs its episode (under the benchmark's time limit or ``runtime.episode_wall_clock_s``, the
stricter), grades it and records its score; a rerun skips every task whose score is recorded. The trial's result is
recorded as its ``evaluations`` row. On Kubernetes the episode pod and the grader Job are split around
`instance_episode` / `prepare_instance` / `finish_instance`, grading the same workspace the same way.
Seeds, time limits and the Kubernetes split in depth: docs/public-benchmarks.md (`...benchmarks.suite`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.errors import BenchmarkError
from mass_ops.evaluation.benchmarks.grading import ContainerRunner, GraderJob, grader_bundle, require_grader_host
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkTask,
    TaskScore,
    TrialResult,
    benchmark_requests,
    materialized_workspaces,
    record_trial,
    run_trial,
)
from mass_ops.evaluation.benchmarks.seeds import check_seeds
from mass_ops.judge.workspaces import StoredWorkspace
from mass_ops.layout import report_prefix
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest

# An executor for one task's context (its config carries the task's time limit); see the module docstring.
ExecutorFor = Callable[[CycleContext], AbstractContextManager[EpisodeExecutor]]


class BenchmarkAdapter(Protocol):
    """What the suite runner needs from a benchmark (its name and container need are read-only)."""

    @property
    def name(self) -> str: ...

    @property
    def needs_container(self) -> bool: ...

    def tasks(self) -> list[BenchmarkTask]: ...

    def evaluator(self) -> str: ...

    def grade(
        self, task: BenchmarkTask, workspace: Path | None, runner: ContainerRunner | None
    ) -> tuple[float, dict[str, Any]]: ...


def fixed_executor(executor: EpisodeExecutor) -> ExecutorFor:
    """An `ExecutorFor` that hands out one executor whatever the context: the cycle's own time limit applies to
    every task (for callers that built their executor already)."""

    @contextlib.contextmanager
    def same(ctx: CycleContext) -> Iterator[EpisodeExecutor]:
        del ctx
        yield executor

    return same


def _as_executor_for(executor: EpisodeExecutor | ExecutorFor) -> ExecutorFor:
    # hasattr does not narrow this union for mypy: an object with `run` is the executor, anything else the factory.
    return fixed_executor(executor) if hasattr(executor, "run") else executor  # type: ignore[arg-type]


def instance_prefix(ctx: CycleContext, benchmark: str, generation: str, trial: int) -> str:
    return f"{report_prefix(ctx.cycle_name)}/benchmarks/{benchmark}/{generation}/t{trial}"


def instance_key(ctx: CycleContext, benchmark: str, generation: str, trial: int, task: str) -> str:
    """Artifact key of one task's recorded score in one trial."""
    return f"{instance_prefix(ctx, benchmark, generation, trial)}/instances/{task}.json"


def pending_key(ctx: CycleContext, benchmark: str, generation: str, trial: int, task: str) -> str:
    """Artifact key of one task's grading waiting for its grader Job (`prepare_instance`)."""
    return f"{instance_prefix(ctx, benchmark, generation, trial)}/grading/{task}.json"


# --- time limits ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeLimit:
    """The wall-clock limit a task's episode runs under (None: unlimited) and where it comes from."""

    seconds: int | None
    source: str  # "benchmark" (the task's official limit), "config" (runtime.episode_wall_clock_s) or "none"

    def as_details(self) -> dict[str, Any]:
        return {"time_limit_s": self.seconds, "time_limit_source": self.source}


def task_time_limit(ctx: CycleContext, task: BenchmarkTask) -> TimeLimit:
    """The stricter of the task's official agent limit and the cycle's episode wall-clock limit."""
    configured = ctx.config.runtime.episode_wall_clock_s
    official = None if task.time_limit_s is None else max(1, math.ceil(task.time_limit_s))
    if official is not None and (configured is None or official <= configured):
        return TimeLimit(official, "benchmark")
    if configured is not None:
        return TimeLimit(configured, "config")
    return TimeLimit(None, "none")


def limited_context(ctx: CycleContext, limit: TimeLimit) -> CycleContext:
    """`ctx` whose config stops an episode at `limit` (the runtime reads ``runtime.episode_wall_clock_s``)."""
    if limit.seconds == ctx.config.runtime.episode_wall_clock_s:
        return ctx
    runtime = ctx.config.runtime.model_copy(update={"episode_wall_clock_s": limit.seconds})
    return _replace_config(ctx, ctx.config.model_copy(update={"runtime": runtime}))


def _replace_config(ctx: CycleContext, config: Any) -> CycleContext:
    import dataclasses

    return dataclasses.replace(ctx, config=config)


def _run_episode(
    ctx: CycleContext, executor_for: ExecutorFor, task: BenchmarkTask, generation: str, trial: int
) -> tuple[EpisodeOutcome, TimeLimit]:
    limit = task_time_limit(ctx, task)
    with executor_for(limited_context(ctx, limit)) as executor:
        # An executor that only reads recorded episodes needs no seed: building one (a repository's pack) is waste.
        seeded = not getattr(executor, "reads_records_only", False)
        [outcome] = run_trial(ctx, executor, [task], generation, trial, seeded=seeded)
    return outcome, limit


# --- the episode run elsewhere (an episode pod) ---------------------------------------------------------------------

FINAL_EPISODE_STATUSES = ("succeeded", "model_failure")  # a final attempt is reused, never rerun (runtime.pool)


class EpisodeNotRecorded(BenchmarkError):
    """A benchmark instance's episode has no final recorded attempt where one was required (its pod must run
    first)."""


def instance_request(
    ctx: CycleContext, task: BenchmarkTask, generation: str, trial: int, *, seeded: bool = True
) -> EpisodeRequest:
    """The request of one task's episode in trial `trial` of `generation`: what the in-process path runs and what
    an episode pod must run for the grading to find it — with its workspace seed stored (`seeded=False`: without,
    to look its unit up)."""
    [request] = benchmark_requests(ctx, [task], generation, trial, seeded=seeded)
    return request


def recorded_episode(ctx: CycleContext, request: EpisodeRequest) -> EpisodeOutcome | None:
    """The final recorded attempt of `request`'s unit as an outcome (as the pool reuses it), or None when it has
    none; BenchmarkError when it was recorded for another prompt (a unit's prompt never changes)."""
    rows = ctx.repo.episode_attempts(ctx.cycle_id, **request.unit.identity())
    final = next((row for row in reversed(rows) if row.status in FINAL_EPISODE_STATUSES), None)
    if final is None:
        return None
    if final.prompt_sha256 and final.prompt_sha256 != request.prompt_sha256:
        raise BenchmarkError(
            f"episode {request.unit.slug}: recorded for another prompt ({final.prompt_sha256[:12]}…) than this "
            f"task's ({request.prompt_sha256[:12]}…); the dataset changed under a recorded trial"
        )
    import dataclasses

    unit = dataclasses.replace(request.unit, attempt=final.attempt)
    status = ctx.artifacts.get_json(unit.artifact_key("status"))
    artifacts = dict(final.artifacts or {})
    return EpisodeOutcome(request, final.id, final.attempt, final.status, status, artifacts, reused=True)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RecordedEpisodes:
    """An `EpisodeExecutor` that runs nothing: each request's recorded episode, or `EpisodeNotRecorded`. What the
    grading uses once the instance's episode ran in its own pod, so that it can never run it a second time."""

    ctx: CycleContext
    reads_records_only = True  # the requests it gets need no workspace seed (`_run_episode`)

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        outcomes = []
        for request in requests:
            outcome = recorded_episode(self.ctx, request)
            if outcome is None:
                raise EpisodeNotRecorded(
                    f"episode {request.unit.slug} is not recorded: its episode pod has not run it (run the pod first)"
                )
            outcomes.append(outcome)
        return outcomes

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        return StoredWorkspace(self.ctx.artifacts, outcome.artifacts["workspace"], "workspace").materialize(dest)


@dataclass(frozen=True)
class InstanceEpisode:
    """An instance whose episode must run before it can be graded: the request its pod runs and its time limit."""

    task: str
    request: EpisodeRequest
    time_limit: TimeLimit


def _recorded_score(ctx: CycleContext, key: str) -> TaskScore | None:
    """The score recorded under `key`, or None: an instance is scored once, and every step returns a recorded score
    as is."""
    return TaskScore.from_dict(ctx.artifacts.get_json(key)) if ctx.artifacts.exists(key) else None


def _record_score(ctx: CycleContext, key: str, scored: TaskScore) -> TaskScore:
    ctx.artifacts.put_json(key, scored.as_dict())
    return scored


def instance_episode(
    ctx: CycleContext, adapter: BenchmarkAdapter, generation: str, trial: int, task: BenchmarkTask
) -> TaskScore | InstanceEpisode | None:
    """Where one instance stands before its grading, running nothing: its recorded score; None when its episode is
    recorded (grade it: `prepare_instance` with `RecordedEpisodes`); else the `InstanceEpisode` to run first."""
    key = instance_key(ctx, adapter.name, generation, trial, task.name)
    if (recorded := _recorded_score(ctx, key)) is not None:
        return recorded
    if recorded_episode(ctx, instance_request(ctx, task, generation, trial, seeded=False)) is not None:
        return None
    return InstanceEpisode(task.name, instance_request(ctx, task, generation, trial), task_time_limit(ctx, task))


# --- grading split around a grader Job --------------------------------------------------------------------------------


def job_sha256(job: GraderJob) -> str:
    """Identity of a grading run: image, script, time limit and file bundle."""
    head = json.dumps([job.benchmark, job.instance, job.image, job.script, job.timeout_s], sort_keys=True)
    return hashlib.sha256(head.encode() + b"\0" + grader_bundle(job)).hexdigest()


class _GraderRequested(Exception):
    """Raised by `CapturingRunner` to stop an adapter's `grade` at the point it needs a container."""

    def __init__(self, job: GraderJob) -> None:
        super().__init__(job.instance)
        self.job = job


class CapturingRunner:
    """A `ContainerRunner` that runs nothing: it hands the adapter's `GraderJob` back to the caller."""

    def run(self, job: GraderJob) -> str:
        raise _GraderRequested(job)


@dataclass(frozen=True)
class ReplayRunner:
    """A `ContainerRunner` that answers the log of a grader Job that already ran, for that same job only."""

    log: str
    expected_sha256: str

    def run(self, job: GraderJob) -> str:
        actual = job_sha256(job)
        if actual != self.expected_sha256:
            raise BenchmarkError(
                f"{job.benchmark} instance {job.instance}: the grading asks for another job ({actual[:12]}) than the "
                f"one that ran ({self.expected_sha256[:12]}); its inputs changed — delete the pending grading to rerun"
            )
        return self.log


@dataclass(frozen=True)
class PendingGrading:
    """An instance waiting for its grader Job: the job, where its file bundle is stored, and the episode graded."""

    task: str
    job: GraderJob
    job_sha256: str
    bundle_uri: str
    bundle_sha256: str
    episode_id: int | None
    episode_status: str
    workspace_uri: str | None
    time_limit: TimeLimit

    def as_dict(self) -> dict[str, Any]:
        job = self.job
        return {
            "task": self.task,
            "job": {
                "benchmark": job.benchmark,
                "instance": job.instance,
                "image": job.image,
                "script": job.script,
                "timeout_s": job.timeout_s,
                "cpus": job.cpus,
                "memory": job.memory,
            },
            "job_sha256": self.job_sha256,
            "bundle_uri": self.bundle_uri,
            "bundle_sha256": self.bundle_sha256,
            "episode_id": self.episode_id,
            "episode_status": self.episode_status,
            "workspace_uri": self.workspace_uri,
            **self.time_limit.as_details(),
        }


def _score(
    task: BenchmarkTask, score: float, details: dict[str, Any], episode_id: int | None, status: str, limit: TimeLimit
) -> TaskScore:
    return TaskScore(task.name, score, episode_id, {**details, "episode_status": status, **limit.as_details()})


def run_instance(
    ctx: CycleContext,
    adapter: BenchmarkAdapter,
    executor_for: ExecutorFor,
    generation: str,
    trial: int,
    task: BenchmarkTask,
    runner: ContainerRunner | None,
) -> TaskScore:
    """Run, grade here and record one task (the recorded score when it has one)."""
    key = instance_key(ctx, adapter.name, generation, trial, task.name)
    if (recorded := _recorded_score(ctx, key)) is not None:
        return recorded
    outcome, limit = _run_episode(ctx, executor_for, task, generation, trial)
    with materialized_workspaces(ctx, [outcome]) as roots:
        score, details = adapter.grade(task, roots.get(task.name), runner)
    return _record_score(ctx, key, _score(task, score, details, outcome.episode_id, outcome.status, limit))


def prepare_instance(
    ctx: CycleContext,
    adapter: BenchmarkAdapter,
    executor_for: ExecutorFor,
    generation: str,
    trial: int,
    task: BenchmarkTask,
) -> TaskScore | PendingGrading:
    """Run one task's episode and start its grading: the recorded score when it has one, the score when the
    adapter grades without a container (DSBench; an empty SWE-bench patch), else the `PendingGrading` whose job a
    grader Job must run (stored, with its bundle, so `finish_instance` can end it in another process)."""
    key = instance_key(ctx, adapter.name, generation, trial, task.name)
    if (recorded := _recorded_score(ctx, key)) is not None:
        return recorded
    outcome, limit = _run_episode(ctx, executor_for, task, generation, trial)
    with materialized_workspaces(ctx, [outcome]) as roots:
        try:
            score, details = adapter.grade(task, roots.get(task.name), CapturingRunner())
        except _GraderRequested as requested:
            job = requested.job
        else:
            return _record_score(ctx, key, _score(task, score, details, outcome.episode_id, outcome.status, limit))
    bundle = grader_bundle(job)
    digest = job_sha256(job)
    # Content-addressed: a retry that prepares the same job stores nothing new.
    info = ctx.artifacts.put_bytes(
        f"{instance_prefix(ctx, adapter.name, generation, trial)}/bundles/{digest}.tar", bundle
    )
    pending = PendingGrading(
        task.name,
        job,
        digest,
        info.uri,
        info.sha256,
        outcome.episode_id,
        outcome.status,
        outcome.artifacts.get("workspace"),
        limit,
    )
    ctx.artifacts.put_json(pending_key(ctx, adapter.name, generation, trial, task.name), pending.as_dict())
    return pending


def finish_instance(
    ctx: CycleContext, adapter: BenchmarkAdapter, generation: str, trial: int, task: BenchmarkTask, log: str
) -> TaskScore:
    """Grade one task from its grader Job's log and record the score once (a recorded score is returned as is).
    The log is stored beside the score as the evidence."""
    key = instance_key(ctx, adapter.name, generation, trial, task.name)
    if (recorded := _recorded_score(ctx, key)) is not None:
        return recorded
    where = pending_key(ctx, adapter.name, generation, trial, task.name)
    if not ctx.artifacts.exists(where):
        raise BenchmarkError(f"{adapter.name} {task.name} trial {trial}: no grading is pending (prepare it first)")
    pending = ctx.artifacts.get_json(where)
    log_info = ctx.artifacts.put_bytes(
        f"{instance_prefix(ctx, adapter.name, generation, trial)}/grader_logs/{task.name}.log", log.encode()
    )
    limit = TimeLimit(pending.get("time_limit_s"), str(pending.get("time_limit_source") or "none"))
    runner = ReplayRunner(log, str(pending["job_sha256"]))
    uri = pending.get("workspace_uri")
    with contextlib.ExitStack() as stack:
        workspace = None
        if uri:
            scratch = Path(stack.enter_context(_scratch()))
            workspace = StoredWorkspace(ctx.artifacts, uri, "workspace").materialize(scratch)
        score, details = adapter.grade(task, workspace, runner)
    details = {**details, "grader_log": log_info.uri}
    scored = _score(task, score, details, pending.get("episode_id"), str(pending.get("episode_status")), limit)
    return _record_score(ctx, key, scored)


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mass-bench-") as folder:
        yield folder


# --- a whole trial ----------------------------------------------------------------------------------------------------


def trial_tasks(adapter: BenchmarkAdapter, limit: int | None) -> list[BenchmarkTask]:
    tasks: Sequence[BenchmarkTask] = adapter.tasks()
    return list(tasks if limit is None else tasks[:limit])


def record_benchmark_trial(
    ctx: CycleContext,
    adapter: BenchmarkAdapter,
    generation: str,
    trial: int,
    *,
    evaluator: str,
    limit: int | None,
    scores: Sequence[TaskScore] | None = None,
) -> TrialResult:
    """Record the trial from its tasks' scores (read from the store when not given); BenchmarkError naming the
    tasks without a recorded score."""
    tasks = trial_tasks(adapter, limit)
    if scores is None:
        keys = {t.name: instance_key(ctx, adapter.name, generation, trial, t.name) for t in tasks}
        missing = [name for name, key in keys.items() if not ctx.artifacts.exists(key)]
        if missing:
            raise BenchmarkError(
                f"{adapter.name} trial {trial} of {generation}: {len(missing)} task(s) have no recorded score "
                f"({', '.join(missing[:5])}); rerun the trial"
            )
        scores = [TaskScore.from_dict(ctx.artifacts.get_json(keys[t.name])) for t in tasks]
    metrics = {
        "evaluator": evaluator,
        "attempted": len(tasks),
        "scored": sum(1 for s in scores if s.score is not None),
        "limit": limit,
    }
    return record_trial(ctx, TrialResult(adapter.name, generation, trial, tuple(scores), metrics))


def run_benchmark_trial(
    ctx: CycleContext,
    adapter: BenchmarkAdapter,
    executor: EpisodeExecutor | ExecutorFor,
    generation: str,
    trial: int,
    *,
    runner: ContainerRunner | None,
    limit: int | None = None,
) -> TrialResult:
    """Run, grade and record trial `trial` of `generation` on `adapter`'s tasks (the first `limit` when given).
    `executor` is an `ExecutorFor` (each task's official time limit enforced), or one executor (the cycle's limit
    for every task)."""
    require_grader_host(adapter.name, needs_container=adapter.needs_container, runner=runner)
    evaluator = adapter.evaluator()  # raises EvaluatorNotInstalledError before any episode runs
    tasks = trial_tasks(adapter, limit)
    check_seeds([task.seed for task in tasks])  # a missing repository or dataset: one line, before any episode
    executor_for = _as_executor_for(executor)
    scores = [run_instance(ctx, adapter, executor_for, generation, trial, task, runner) for task in tasks]
    return record_benchmark_trial(ctx, adapter, generation, trial, evaluator=evaluator, limit=limit, scores=scores)
