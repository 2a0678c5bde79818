"""Public-benchmark stages (MASS_SPEC §10, ISSUE #18): a whole trial in one process, or one instance at a time
around a grader Job on Kubernetes.

`benchmark_trial` runs a trial here: each task's episode under its official time limit, graded in this process (a
container-graded benchmark needs a local engine, else it stops in one line before any agent time). On Kubernetes
the `BenchmarkTrialOperator` drives the same trial one instance at a time: `benchmark_trial_tasks` (checks first),
`benchmark_instance` (the episode, then either the score or the grader job to run), the operator's grader Job,
`benchmark_grader_result` (the Job's log graded and recorded once), and `benchmark_trial_record` (the trial row).
Each returns a small JSON-able dict (XCom).

With `episode_pod` (what the operator passes on Kubernetes) `benchmark_instance` runs no episode: when the
instance's episode is not recorded yet it returns the episode pod to run first — the spec bound to the exact request
the in-process path runs, its prompt stored for the pod's publisher, admitted against the budgets, with the task's
time limit and the generation's server — and once the pod has recorded it, it grades that recorded episode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.errors import InputError
from mass_ops.runtime.episode import EpisodeExecutor
from mass_ops.stages.common import episode_executor

BENCHMARK_SCOPE = "benchmarks"  # the local serving scope of the `mass_benchmarks` DAG's generation server


def _check_limit(benchmark: str, limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"benchmark {benchmark}: limit must be a whole number ≥ 1, got {limit!r}")


def _served(config: CycleConfig, generation: str) -> CycleContext:
    """The cycle's context pointed at `generation`'s server (local: the benchmarks' own; Kubernetes: the cycle's
    evaluation servers)."""
    from mass_ops.compute.backend import backend_for
    from mass_ops.serving import evaluation_scope, generation_server, serving_context

    ctx = attach_cycle(config)
    # Locally the benchmark stages serve the generation themselves; on the cluster the operator's servers do.
    scope = BENCHMARK_SCOPE if backend_for(config).runs_in_process else evaluation_scope(config)
    return serving_context(ctx, generation_server(ctx, generation, scope))


@contextlib.contextmanager
def _executor_for(ctx: CycleContext) -> Iterator[EpisodeExecutor]:
    # One executor per task context: its config carries the task's time limit, which the runtime enforces.
    with episode_executor(ctx) as executor:
        yield executor


def _task(adapter: Any, name: str) -> Any:
    from mass_ops.evaluation.benchmarks.errors import BenchmarkError

    found = next((t for t in adapter.tasks() if t.name == name), None)
    if found is None:
        raise BenchmarkError(f"benchmark {adapter.name}: no task {name!r} in its dataset")
    return found


def _summary(result: Any) -> dict[str, Any]:
    return {
        "benchmark": result.benchmark,
        "generation": result.generation,
        "trial": result.trial,
        "attempted": result.metrics.get("attempted"),
        "scored": result.metrics.get("scored"),
        "evaluator": result.metrics.get("evaluator"),
        "mean": None if result.unscored else result.mean,
    }


def benchmark_trial(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    limit: int | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Run, grade and record trial `trial` of `generation` on `benchmark` in this process (its first `limit` tasks
    when given), each task under its official time limit; resumable per instance. A benchmark whose grader needs a
    container stops before any episode when no engine runs here (one line) — on Kubernetes such a benchmark runs
    through `BenchmarkTrialOperator` instead."""
    return trial_on(_served, config, benchmark, generation, int(trial), limit, data_dir)


# Where a trial's episodes run and are recorded: given the config and the generation, the cycle's context on that
# generation's server (the full suite: `_served`; the nightly slice: the nightly cycle on tonight's servers).
ServedOn = Callable[[CycleConfig, str], CycleContext]


def trial_on(
    served_on: ServedOn,
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    limit: int | None,
    data_dir: str | None,
) -> dict[str, Any]:
    """`benchmark_trial` in the context `served_on` gives (shared by the full suite and the nightly slice)."""
    from mass_ops.compute.backend import backend_for
    from mass_ops.evaluation.benchmarks.grading import local_runner, require_grader_host
    from mass_ops.evaluation.benchmarks.sources import benchmark_adapter
    from mass_ops.evaluation.benchmarks.suite import run_benchmark_trial

    _check_limit(benchmark, limit)
    adapter = benchmark_adapter(benchmark, data_dir)
    # In-process the grader runs here (a container engine); on the cluster `benchmark_grader_job` runs it.
    runner = local_runner() if backend_for(config).runs_in_process else None
    require_grader_host(adapter.name, needs_container=adapter.needs_container, runner=runner)
    served = served_on(config, generation)
    result = run_benchmark_trial(served, adapter, _executor_for, generation, trial, runner=runner, limit=limit)
    return _summary(result)


def benchmark_trial_tasks(
    config: CycleConfig, benchmark: str, limit: int | None = None, data_dir: str | None = None
) -> dict[str, Any]:
    """The tasks of one trial (the first `limit`), checked before any agent time: the dataset reads and the
    evaluator is installed."""
    from mass_ops.evaluation.benchmarks.seeds import check_seeds
    from mass_ops.evaluation.benchmarks.sources import benchmark_adapter
    from mass_ops.evaluation.benchmarks.suite import trial_tasks

    del config
    _check_limit(benchmark, limit)
    adapter = benchmark_adapter(benchmark, data_dir)
    evaluator = adapter.evaluator()  # EvaluatorNotInstalledError here, before any episode
    tasks = trial_tasks(adapter, limit)
    # A missing repository, commit or dataset folder: one line now, not after earlier instances spent agent time.
    check_seeds([task.seed for task in tasks])
    return {
        "benchmark": adapter.name,
        "needs_container": adapter.needs_container,
        "evaluator": evaluator,
        "tasks": [t.name for t in tasks],
    }


def benchmark_instance(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    task: str,
    data_dir: str | None = None,
    episode_pod: bool = False,
) -> dict[str, Any]:
    """Run one task's episode (reused when finished) and start its grading: ``{"status": "recorded", "score"}``
    when it is scored (already, or by a grader that needs no container), else ``{"status": "grade", "job": …,
    "bundle_uri", "bundle_sha256"}`` — the grader Job to run (`compute.kubernetes.benchmark_grader_job`).

    `episode_pod`: the episode runs in its own pod, never here — see `instance_step`."""
    return instance_on(_served, config, benchmark, generation, int(trial), task, data_dir, episode_pod)


def instance_on(
    served_on: ServedOn,
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    task: str,
    data_dir: str | None,
    episode_pod: bool,
) -> dict[str, Any]:
    """`benchmark_instance` in the context `served_on` gives (shared by the full suite and the nightly slice)."""
    from mass_ops.evaluation.benchmarks.sources import benchmark_adapter

    adapter = benchmark_adapter(benchmark, data_dir)
    served = served_on(config, generation)
    return instance_step(served, adapter, generation, trial, _task(adapter, task), episode_pod=episode_pod)


def instance_step(
    served: CycleContext, adapter: Any, generation: str, trial: int, task: Any, *, episode_pod: bool
) -> dict[str, Any]:
    """The next step of one instance in `served` (the cycle's context on `generation`'s server): as
    `benchmark_instance` says; with `episode_pod`, ``{"status": "episode", …}`` (`_episode_pod`) while its episode
    is not recorded, ``{"status": "budget_exhausted", "message"}`` when a budget leaves no room for that pod, and
    the grading of the recorded episode (`RecordedEpisodes`: nothing runs here) once it is."""
    from mass_ops.evaluation.benchmarks.scoring import TaskScore
    from mass_ops.evaluation.benchmarks.suite import (
        ExecutorFor,
        InstanceEpisode,
        RecordedEpisodes,
        fixed_executor,
        instance_episode,
        prepare_instance,
    )

    executor_for: ExecutorFor = _executor_for
    if episode_pod:
        state = instance_episode(served, adapter, generation, trial, task)
        if isinstance(state, InstanceEpisode):
            return _episode_pod(served, state, trial)
        executor_for = fixed_executor(RecordedEpisodes(served))
    prepared = prepare_instance(served, adapter, executor_for, generation, trial, task)
    if isinstance(prepared, TaskScore):
        return {"status": "recorded", "task": prepared.task, "score": prepared.score}
    pending = prepared.as_dict()
    return {"status": "grade", **{k: pending[k] for k in ("task", "job", "bundle_uri", "bundle_sha256")}}


def _episode_pod(served: CycleContext, state: Any, trial: int) -> dict[str, Any]:
    """The episode pod of an instance: ``{"status": "episode", "task", "cycle", "episode", "wall_clock_s",
    "server"}`` — `episode` the fields of the bound `compute.kubernetes.EpisodeSpec` (its prompt stored where the
    pod's publisher fetches it), `cycle` the cycle it is recorded in (the pod's config is that cycle's),
    `wall_clock_s` the task's time limit (None: none), `server` the generation's server; or the budget stop."""
    import dataclasses

    from mass_ops.compute.kubernetes import EpisodeSpec
    from mass_ops.runtime.admission import admit_episode
    from mass_ops.stages.units import publish_prompt

    request = state.request
    unit = request.unit
    spec = EpisodeSpec(kind="benchmark", task_id=unit.task_id, candidate=trial, generation=unit.generation)
    bound = spec.bound(request, publish_prompt(served, request))
    stop = admit_episode(served, bound, lambda: request)
    if stop is not None:
        return {"status": "budget_exhausted", "task": state.task, "message": stop.message}
    fields = {k: v for k, v in dataclasses.asdict(bound).items() if v is not None}
    config = served.config
    return {
        "status": "episode",
        "task": state.task,
        "cycle": served.cycle_name,
        "episode": fields,
        "wall_clock_s": state.time_limit.seconds,
        "server": {"endpoint": config.inference.endpoint, "served_name": config.models.served_name},
    }


def benchmark_grader_result(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    task: str,
    log: str,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Grade one task from its grader Job's log with the benchmark's official grading and record the score once
    (a recorded score is returned unchanged), with the evaluator's version."""
    from mass_ops.evaluation.benchmarks.sources import benchmark_adapter
    from mass_ops.evaluation.benchmarks.suite import finish_instance

    adapter = benchmark_adapter(benchmark, data_dir)
    ctx = attach_cycle(config)
    scored = finish_instance(ctx, adapter, generation, int(trial), _task(adapter, task), log)
    return {"task": scored.task, "score": scored.score, "evaluator": scored.details.get("evaluator")}


def benchmark_trial_record(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    limit: int | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Record the trial's row from its tasks' recorded scores (InputError naming tasks without one)."""
    from mass_ops.evaluation.benchmarks.sources import benchmark_adapter
    from mass_ops.evaluation.benchmarks.suite import record_benchmark_trial

    _check_limit(benchmark, limit)
    adapter = benchmark_adapter(benchmark, data_dir)
    ctx = attach_cycle(config)
    result = record_benchmark_trial(ctx, adapter, generation, int(trial), evaluator=adapter.evaluator(), limit=limit)
    return _summary(result)
