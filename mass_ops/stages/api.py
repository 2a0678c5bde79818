"""The stage functions by name: what the CLI (`mass-ops <stage>`), the DAG tasks (`mass_ops_airflow.cycle`) and
Python callers run. Each takes the validated `CycleConfig` first, attaches the cycle once, calls its family module
beside this file with that context, and returns a small JSON-able dict of ids and URIs (never big data: XCom).

Family modules are imported inside the functions so that importing this module (a DAG file, the CLI) stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import attach_cycle, open_cycle
from mass_ops.errors import InfrastructureError, InputError

# The public-benchmark stages (`mass_benchmarks` DAG, `mass-ops benchmark run`), re-exported by name: a whole trial in
# one process, or one instance at a time around a Kubernetes grader Job (`BenchmarkTrialOperator`).
from mass_ops.stages.benchmarks import BENCHMARK_SCOPE as BENCHMARK_SCOPE
from mass_ops.stages.benchmarks import benchmark_grader_result as benchmark_grader_result
from mass_ops.stages.benchmarks import benchmark_instance as benchmark_instance
from mass_ops.stages.benchmarks import benchmark_trial as benchmark_trial
from mass_ops.stages.benchmarks import benchmark_trial_record as benchmark_trial_record
from mass_ops.stages.benchmarks import benchmark_trial_tasks as benchmark_trial_tasks
from mass_ops.stages.common import episode_executor, jsonable


def _server_state_file(config: CycleConfig) -> Path:
    """Where the local backend records the model server it started (pid, argv, endpoint)."""
    from mass_ops.compute.local import SERVERS_DIR

    return SERVERS_DIR / f"{config.cycle_name}-inference.json"


def inference_up(config: CycleConfig, *, model_dir: str | None = None) -> dict[str, Any]:
    """Local backend: start `transformers serve` on the served model and wait until `/health` answers and
    `/v1/models` lists the served name (on Kubernetes the inference-server operator does this instead)."""
    from urllib.parse import urlsplit

    from mass_ops.compute.backend import ModelRequest, backend_for

    backend = backend_for(config)
    if not backend.runs_in_process:
        raise InputError("inference_up runs the local backend only; the DAG uses the inference-server operator")
    if config.compute.local_inference == "external":
        # Someone else serves the model (a vLLM of yours, a hosted endpoint): only its readiness is checked.
        from mass_ops.compute.readiness import probe

        report = probe(config.inference.endpoint, config.models.served_name, api_key_env=config.inference.api_key_env)
        if not report.ready:
            raise InfrastructureError(f"inference endpoint {config.inference.endpoint} is not ready: {report.problem}")
        return {"endpoint": config.inference.endpoint, "served_name": config.models.served_name, "pid": None}
    port = urlsplit(config.inference.endpoint).port or config.inference.server.port
    request = ModelRequest(
        model=model_dir or config.models.served_name,
        served_name=config.models.served_name,
        endpoint=config.inference.endpoint,
        state_file=_server_state_file(config),
        port=port,
    )
    server = backend.start_model(config, request)
    backend.wait_ready(config, server)
    return {"endpoint": config.inference.endpoint, "served_name": config.models.served_name, "pid": server.pid}


def inference_down(config: CycleConfig) -> dict[str, Any]:
    """Stop the local model server (a no-op when none is recorded); runs even when upstream stages failed."""
    from mass_ops.compute.backend import LocalBackend

    # What the local backend recorded, whatever the config's backend now (a teardown stops what was started).
    return {"stopped": LocalBackend().stop_model(_server_state_file(config))}


def search_tasks(config: CycleConfig) -> list[int]:
    """Tasks the RHI search covers (MASS_SPEC §1: the train candidates)."""
    return list(config.tasks.train_candidates)


def search_step(config: CycleConfig, task_id: int, version: int) -> dict[str, Any]:
    """One RHI version step of one task: episode v_k (and the reference at k = 0), judging, arbitration, and the
    proposal of v_{k+1} — or the retained workflow at the last version. Steps beyond `search.iterations` are no-ops
    so a DAG built for a larger budget can run a smaller one."""
    if version > config.search.iterations:
        return {"task_id": task_id, "version": version, "skipped": True}
    from mass_ops.search.driver import search_step as run_step

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        result = run_step(ctx, executor, task_id, version)
    return jsonable(asdict(result))


def search(config: CycleConfig, tasks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The whole RHI search: every task's chain concurrently, each chain sequential; one summary row per task."""
    from mass_ops.search.driver import search_tasks as run_tasks

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        return [result.as_row() for result in run_tasks(ctx, executor, tasks)]


def collection_units(config: CycleConfig) -> list[list[int]]:
    """(task, candidate) pairs of the eligible training tasks, known once the search has finished."""
    from mass_ops.stages.collect import eligible_tasks

    ctx = attach_cycle(config)
    return [
        [decision.task_id, candidate]
        for decision in eligible_tasks(ctx)
        if decision.collects
        for candidate in range(config.collection.candidates)
    ]


def collect_candidate(config: CycleConfig, task_id: int, candidate: int) -> dict[str, Any]:
    """One teacher candidate of one task (the DAG maps this over `collection_units`)."""
    from mass_ops.stages.collect import CollectionSkipped, candidate_request

    ctx = attach_cycle(config)
    try:
        request = candidate_request(ctx, task_id, candidate)
    except CollectionSkipped as skipped:
        return {"task_id": task_id, "candidate": candidate, "skipped": True, "reason": skipped.decision.reason}
    with episode_executor(ctx) as executor:
        (outcome,) = executor.run([request])
    return {
        "task_id": task_id,
        "candidate": candidate,
        "episode_id": outcome.episode_id,
        "status": outcome.status,
        "attempt": outcome.attempt,
    }


def collect_task(config: CycleConfig, task_id: int) -> dict[str, Any]:
    """Every teacher candidate of one task, as one unit (the per-task collection of the pipelined DAG); finished
    candidates are reused, so a rerun after `CollectionIncompleteError` redoes only the failed ones."""
    from mass_ops.stages.collect import collect_task as run_task

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        return jsonable(run_task(ctx, executor, task_id).as_row())


def collect(config: CycleConfig, tasks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Every teacher candidate of the eligible tasks in one batch; one summary row per task."""
    from mass_ops.stages.collect import collect_batch

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        return [result.as_row() for result in collect_batch(ctx, executor, tasks)]


def ranking_tasks(config: CycleConfig) -> list[int]:
    """Training tasks whose candidates are ranked (the eligible ones)."""
    from mass_ops.stages.collect import eligible_tasks

    return [d.task_id for d in eligible_tasks(attach_cycle(config)) if d.collects]


def rank_task(config: CycleConfig, task_id: int) -> dict[str, Any]:
    """Tournament, self-judge and Bradley–Terry for one task."""
    from mass_ops.stages.rank import run_rank

    (row,) = run_rank(config, [task_id])
    return jsonable(row)


def rank(config: CycleConfig, tasks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Rank every eligible task; one row per task."""
    from mass_ops.stages.rank import run_rank

    return [jsonable(row) for row in run_rank(config, tasks)]


def inner_loop(config: CycleConfig, tasks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Search → collection → ranking per task, pipelined: each task's next phase starts when its own previous phase
    is done, every chain concurrently through one episode pool (ISSUE #17.2); one row per task. Selection follows
    separately, once every task is ranked."""
    from mass_ops.stages.inner_loop import run_inner_loop

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        return [jsonable(result.as_row()) for result in run_inner_loop(ctx, executor, tasks)]


def select(config: CycleConfig) -> dict[str, Any]:
    """Ranks 1..train_ranks → training, validation_rank → validation, per eligible task."""
    from mass_ops.stages.rank import run_select

    rows = run_select(config)
    return {"tasks": [jsonable(r) for r in rows]}


def render(config: CycleConfig) -> dict[str, Any]:
    """Selected trajectories → windows with assistant-only masks → dataset shards and rows (MASS_SPEC §7)."""
    from mass_ops.stages.render import render as run

    return run(config)


def train(config: CycleConfig) -> dict[str, Any]:
    """A fresh LoRA on the BF16 parent under DeepSpeed ZeRO-3; checkpoints published and recorded."""
    from mass_ops.stages.train import train as run

    return run(config)


def select_checkpoint(config: CycleConfig) -> dict[str, Any]:
    """Minimum validation loss over saved steps > 0."""
    from mass_ops.stages.train import select_checkpoint as run

    return run(config)


def export(config: CycleConfig) -> dict[str, Any]:
    """Merge the selected adapter into BF16, quantise block-wise FP8, publish both."""
    from mass_ops.stages.export import export as run

    return run(config)


def register(config: CycleConfig) -> dict[str, Any]:
    """Register L(k+1) with its lineage."""
    from mass_ops.stages.register import register as run

    return run(config)


def rollout(
    config: CycleConfig,
    generation: str,
    *,
    tasks: Sequence[int] | None = None,
    split: str | None = None,
    count: int | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Bare-task evaluation rollouts of a registered generation (a new label = a new set; never overwritten)."""
    from mass_ops.evaluation.rollouts import run_rollouts

    ctx = attach_cycle(config)
    with episode_executor(ctx) as executor:
        rollout_set = run_rollouts(ctx, executor, generation, tasks=tasks, split=split, count=count, label=label)  # type: ignore[arg-type]
    return {
        "label": rollout_set.label,
        "generation": rollout_set.generation,
        "tasks": list(rollout_set.tasks),
        "count": rollout_set.count,
        "uri": ctx.artifacts.uri(rollout_set.key),
    }


def evaluation_up(config: CycleConfig) -> dict[str, Any]:
    """Local backend: serve L(k+1) and its parent L(k) from their registered weights (one `transformers serve`
    each) and wait until both are ready; on Kubernetes the inference-server operator does this."""
    from mass_ops.serving import evaluation_scope, serve_generations
    from mass_ops.stages.evaluate import evaluated_generations

    ctx = attach_cycle(config)
    servers = serve_generations(ctx, list(evaluated_generations(config)), evaluation_scope(config))
    return {"servers": [server.as_dict() for server in servers]}


def evaluation_down(config: CycleConfig) -> dict[str, Any]:
    """Stop the local evaluation servers of the cycle (a no-op when none runs)."""
    from mass_ops.serving import evaluation_scope, stop_generations

    return {"stopped": stop_generations(evaluation_scope(config))}


def rollout_units(config: CycleConfig) -> list[list[Any]]:
    """(generation, task, replicate) of every evaluation rollout: L(k+1) and L(k) over the rollout pool."""
    from mass_ops.stages.evaluate import rollout_units as units

    return [[generation, task, replicate] for generation, task, replicate in units(config)]


def rollout_unit(config: CycleConfig, generation: str, task_id: int, replicate: int) -> dict[str, Any]:
    """One evaluation rollout episode (the DAG maps this over `rollout_units`)."""
    from mass_ops.stages.evaluate import run_rollout_unit

    outcome = run_rollout_unit(attach_cycle(config), generation, int(task_id), int(replicate))
    return {
        "generation": generation,
        "task_id": int(task_id),
        "replicate": int(replicate),
        "episode_id": outcome.episode_id,
        "status": outcome.status,
    }


def evaluate(config: CycleConfig) -> dict[str, Any]:
    """Rollout sets of L(k+1) and L(k), paired, judged by every external judge (and the in-loop judge for the
    agreement table), summarized and recorded."""
    from mass_ops.stages.evaluate import evaluate as run

    return run(attach_cycle(config))


def promotion_request(config: CycleConfig) -> dict[str, Any]:
    """Whether L(k+1) waits for approval before it is served, and the evaluation headline the approval shows."""
    from mass_ops.stages.promotion import promotion_request as request

    return request(attach_cycle(config))


def promote(config: CycleConfig, approved_by: str | None = None) -> dict[str, Any]:
    """Record L(k+1) as promoted: nightly evaluation serves it and the next cycle may start from it."""
    from mass_ops.stages.promotion import promote as run

    return run(attach_cycle(config), approved_by)


def nightly_targets(config: CycleConfig) -> list[str]:
    """The generations tonight's evaluation covers (the newest served one that has a parent)."""
    from mass_ops.stages.nightly import nightly_config
    from mass_ops.stages.nightly import nightly_targets as targets

    return targets(open_cycle(nightly_config(config)))


def nightly_serving(config: CycleConfig, generations: Sequence[str]) -> list[str]:
    """The generations tonight's servers serve: the evaluated ones and their parents."""
    from mass_ops.stages.nightly import nightly_config, served_generations

    return served_generations(open_cycle(nightly_config(config)), list(generations))


def nightly_up(config: CycleConfig) -> dict[str, Any]:
    """Local backend: serve tonight's generations and their parents."""
    from mass_ops.serving import serve_generations
    from mass_ops.stages.nightly import NIGHTLY_SCOPE, nightly_config, nightly_targets, served_generations

    ctx = open_cycle(nightly_config(config))
    names = served_generations(ctx, nightly_targets(ctx))
    return {"servers": [server.as_dict() for server in serve_generations(ctx, names, NIGHTLY_SCOPE)]}


def nightly_down(config: CycleConfig) -> dict[str, Any]:
    """Stop the local nightly servers."""
    from mass_ops.serving import stop_generations
    from mass_ops.stages.nightly import NIGHTLY_SCOPE

    return {"stopped": stop_generations(NIGHTLY_SCOPE)}


def nightly_evaluate(config: CycleConfig, generation: str, date: str) -> dict[str, Any]:
    """Evaluate `generation` against its parent on the test split for the logical date `date`."""
    from mass_ops.stages.nightly import nightly_config
    from mass_ops.stages.nightly import nightly_evaluate as run

    return run(open_cycle(nightly_config(config)), generation, date)


def check_regression(config: CycleConfig, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tonight's results against the floor (0.5 − threshold) and the previous night; lists the regressions."""
    from mass_ops.stages.nightly import check_regression as check
    from mass_ops.stages.nightly import nightly_config

    return check(open_cycle(nightly_config(config)), [dict(r) for r in results])


def report(config: CycleConfig) -> dict[str, Any]:
    """Render the cycle's report (Markdown, self-contained HTML, figures) into the artifact store."""
    from mass_ops.stages.evaluate import write_report

    uris = write_report(attach_cycle(config))
    return {
        "cycle": config.cycle_name,
        "markdown": uris["markdown"],
        "html": uris["html"],
        "figures": len(uris["figures"]),
    }


def nightly_report(config: CycleConfig) -> dict[str, Any]:
    """Render the report of the nightly results' own cycle (`nightly_config`), named under `cycle` since it is not
    the run's cycle (the Airflow link to the report needs it)."""
    from mass_ops.stages.evaluate import write_report
    from mass_ops.stages.nightly import nightly_config

    ctx = open_cycle(nightly_config(config))
    uris = write_report(ctx)
    written = {"markdown": uris["markdown"], "html": uris["html"], "figures": len(uris["figures"])}
    return {"cycle": ctx.cycle_name, **written}


def nightly_benchmark_slice(
    config: CycleConfig, benchmarks: Sequence[str] | None, instances: Any, data_dir: str | None = None
) -> dict[str, Any]:
    """The nightly DAG's first check of its benchmark slice: NightlyError (one line) for an unknown benchmark or an
    instance count below 1, BenchmarkError for a missing dataset folder."""
    from mass_ops.stages.nightly import nightly_benchmark_slice as check

    return check(config, benchmarks, instances, data_dir)


def nightly_benchmark_units(
    config: CycleConfig,
    generations: Sequence[str],
    benchmarks: Sequence[str] | None,
    instances: Any,
    date: str,
    data_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Tonight's slice units, one per (benchmark, served generation), under the night's trial index."""
    from mass_ops.stages.nightly import nightly_benchmark_units as units

    return units(config, generations, benchmarks, instances, date, data_dir)


# The slice's trial stages, called by BenchmarkTrialOperator(stage_prefix="nightly_benchmark") with the signatures of
# the benchmark_* stages: recorded in the nightly cycle, run on tonight's servers.
def nightly_benchmark_trial(config: CycleConfig, *args: Any) -> dict[str, Any]:
    """`stages.nightly.nightly_benchmark_trial` (one slice trial in this process, local backend)."""
    from mass_ops.stages.nightly import nightly_benchmark_trial as run

    return run(config, *args)


def nightly_benchmark_trial_tasks(config: CycleConfig, *args: Any) -> dict[str, Any]:
    """`stages.nightly.nightly_benchmark_trial_tasks` (the slice's tasks, checked before any agent time)."""
    from mass_ops.stages.nightly import nightly_benchmark_trial_tasks as run

    return run(config, *args)


def nightly_benchmark_instance(config: CycleConfig, *args: Any) -> dict[str, Any]:
    """`stages.nightly.nightly_benchmark_instance` (one slice instance: its score or the grader job to run)."""
    from mass_ops.stages.nightly import nightly_benchmark_instance as run

    return run(config, *args)


def nightly_benchmark_grader_result(config: CycleConfig, *args: Any) -> dict[str, Any]:
    """`stages.nightly.nightly_benchmark_grader_result` (a slice instance graded from its Job's log, recorded once)."""
    from mass_ops.stages.nightly import nightly_benchmark_grader_result as run

    return run(config, *args)


def nightly_benchmark_trial_record(config: CycleConfig, *args: Any) -> dict[str, Any]:
    """`stages.nightly.nightly_benchmark_trial_record` (the night's trial row from its recorded instances)."""
    from mass_ops.stages.nightly import nightly_benchmark_trial_record as run

    return run(config, *args)


def bind_episode(config: CycleConfig, episode: Any) -> Any:
    """An episode pod's spec (`compute.kubernetes.EpisodeSpec`) bound to the exact request its stage runs for that
    unit (seed, condition, prompt), with the prompt stored where the pod's publisher fetches it; EpisodeUnitError
    (one line) when the unit's prompt is not known yet."""
    from mass_ops.stages.units import episode_request, publish_prompt

    ctx = attach_cycle(config)
    request = episode_request(ctx, episode)
    return episode.bound(request, publish_prompt(ctx, request))


def budget_stop_message(error: BaseException) -> str | None:
    """The one-line message of an error that is a budget stop (`store.budgets.BudgetExhaustedError`: raise the budget
    and rerun, never retry as a fault), else None."""
    from mass_ops.store.budgets import BudgetExhaustedError

    return str(error) if isinstance(error, BudgetExhaustedError) else None


def benchmark_units(config: CycleConfig, benchmarks: Sequence[str], trials: int) -> list[list[Any]]:
    """(benchmark, trial) of every trial a `mass_benchmarks` run maps over; InputError for an unknown benchmark or a
    trial count below 1."""
    from mass_ops.evaluation.benchmarks.sources import SUITE

    del config
    unknown = [name for name in benchmarks if name not in SUITE]
    if unknown or not benchmarks:
        raise InputError(f"benchmarks: {unknown or 'none'} chosen; choose from {list(SUITE)}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"benchmarks: trials must be a whole number ≥ 1, got {trials!r}")
    return [[name, trial] for name in dict.fromkeys(benchmarks) for trial in range(trials)]


def benchmark_up(config: CycleConfig, generation: str) -> dict[str, Any]:
    """Local backend: serve `generation` for the benchmark trials (found running when it already is)."""
    from mass_ops.compute.backend import backend_for
    from mass_ops.serving import serve_generations

    if not backend_for(config).runs_in_process:
        return {"servers": []}  # on Kubernetes the trials use the cycle's evaluation servers (evaluation_scope)
    ctx = attach_cycle(config)
    return {"servers": [server.as_dict() for server in serve_generations(ctx, [generation], BENCHMARK_SCOPE)]}


def benchmark_down(config: CycleConfig) -> dict[str, Any]:
    """Stop the local benchmark server (a no-op when none runs)."""
    from mass_ops.serving import stop_generations

    del config
    return {"stopped": stop_generations(BENCHMARK_SCOPE)}
