"""The planned shape of a cycle: stage graph, unit counts, training launch and resource plan.

Counts are upper bounds where the outcome decides (collection only runs for tasks whose retained workflow beats the
reference; arbitration calls only happen when two versions beat it). Window counts are unknown until render.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from mass_ops import stage_registry as r
from mass_ops.config import CycleConfig
from mass_ops.cost.estimate import DEFAULT_TRAIN_STEP_S
from mass_ops.errors import InputError
from mass_ops.layout import next_generation_key, training_prefix
from mass_ops.seeds import next_cycle_seed_base
from mass_ops.train.lora_targets import lora_target_pattern

if TYPE_CHECKING:
    from mass_ops.cost.estimate import CycleEstimate, StageWork, UnitFigures


@dataclass(frozen=True)
class StagePlan:
    """Planned work of one stage: a line per count, `upper_bound` when outcomes can only shrink it."""

    stage: str
    counts: dict[str, int | str]
    upper_bound: bool = False


@dataclass(frozen=True)
class ResourcePlan:
    """What each kind of job asks of the cluster (or the laptop)."""

    inference_gpus: int
    inference_capacity: int
    episode_concurrency: int
    training_nodes: int
    training_ranks: int
    training_gpus: int
    reference_training_gpus: int


# Without a measured throughput, a training step takes DEFAULT_TRAIN_STEP_S (defined once, in cost.estimate): the
# plan's tokens/s is the planned tokens of a step over that, so the plan and the cost estimate agree.


@dataclass(frozen=True)
class TrainingTime:
    """The training job's planned duration: tokens per optimizer step over tokens per second, for the configured
    steps and GPUs. `source` says where tokens/s came from (the parent generation's cycle, or the default)."""

    tokens_per_step: float
    tokens_per_s: float
    steps: int
    gpus: int
    source: str
    measured_cycle: str | None = None

    @property
    def step_s(self) -> float:
        return self.tokens_per_step / self.tokens_per_s

    @property
    def wall_clock_h(self) -> float:
        return self.steps * self.step_s / 3600

    @property
    def gpu_hours(self) -> float:
        return self.wall_clock_h * self.gpus


@dataclass(frozen=True)
class MeasuredThroughput:
    """Training throughput measured on a finished run: all tokens over all step time of its logged steps, and the
    mean tokens of a window (what a step of another batch size would process)."""

    cycle: str
    run: str
    steps: int
    tokens_per_s: float
    tokens_per_window: float


def _positive_number(value: object) -> TypeGuard[int | float]:
    """Whether `value` is a number above zero (a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def measured_throughput(cycle: str, run: str, rows: list[dict[str, Any]]) -> MeasuredThroughput | None:
    """The throughput of a training log's step rows (those with `tokens_per_s`, `step_s` and `windows`); None when
    no row has all three (a log written before the trainer recorded throughput)."""
    tokens = seconds = 0.0
    windows = steps = 0
    for row in rows:
        rate, step_s, count = row.get("tokens_per_s"), row.get("step_s"), row.get("windows")
        if not (_positive_number(rate) and _positive_number(step_s) and _positive_number(count)):
            continue
        tokens += float(rate) * float(step_s)
        seconds += float(step_s)
        windows += int(count)
        steps += 1
    if not steps or tokens <= 0:
        return None
    return MeasuredThroughput(cycle, run, steps, tokens / seconds, tokens / windows)


def training_time(config: CycleConfig, measured: MeasuredThroughput | None) -> TrainingTime:
    """The planned training duration: with a measurement, this config's windows per step × the measured tokens of
    a window (at most `training.window`) over the measured tokens/s; else full windows over DEFAULT_TRAIN_STEP_S."""
    t = config.training
    windows = t.effective_windows_per_step
    if measured is None:
        tokens_per_step = float(windows * t.window)
        return TrainingTime(
            tokens_per_step,
            tokens_per_step / DEFAULT_TRAIN_STEP_S,
            t.steps,
            t.replicas,
            f"default: {DEFAULT_TRAIN_STEP_S:g} s per step (no finished training run of the parent generation's cycle)",
        )
    tokens_per_step = windows * min(measured.tokens_per_window, float(t.window))
    return TrainingTime(
        tokens_per_step,
        measured.tokens_per_s,
        t.steps,
        t.replicas,
        f"measured on cycle {measured.cycle} (run {measured.run}, {measured.steps} logged steps)",
        measured_cycle=measured.cycle,
    )


@dataclass(frozen=True)
class CyclePlan:
    """Everything `mass-ops plan` reports."""

    cycle: str
    generation: int
    stages: list[StagePlan]
    training_command: list[str]
    windows_per_step: int
    resources: ResourcePlan
    totals: dict[str, int] = field(default_factory=dict)
    # The regex of the modules LoRA adapts (MASS_SPEC §8: the reference's set on any Qwen3-family model).
    lora_target_pattern: str = ""
    training_time: TrainingTime | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        return asdict(self)


def ranking_pairs_per_task(config: CycleConfig, task_id: int) -> int:
    """Unique comparisons of one task's tournament, from the real schedule of `mass_ops.ranking`."""
    from mass_ops.ranking import tournament_pairs
    from mass_ops.seeds import schedule_seed

    names = [f"c{i:03d}" for i in range(config.collection.candidates)]
    seed = schedule_seed(config.ranking.seed, task_id)
    return len(tournament_pairs(names, opponents=config.ranking.opponents_per_episode, seed=seed))


def count_validations(steps: int, val_every: int, at_start: bool) -> int:
    """Validation passes: step 0 (optional), every `val_every`, and the final step."""
    points = set(range(val_every, steps + 1, val_every)) | {steps}
    if at_start:
        points.add(0)
    return len(points)


def count_checkpoints(steps: int, save_every: int) -> int:
    """Saved checkpoints: every `save_every` steps plus the final step."""
    return len(set(range(save_every, steps + 1, save_every)) | {steps})


def build_plan(config: CycleConfig, training_command: list[str], *, lineage: bool = True) -> CyclePlan:
    """Compute the plan of one cycle from its config; with `lineage`, the training time uses the tokens/s measured
    on the parent generation's cycle when this config's metadata store holds its finished training run."""
    comparisons = {q: ranking_pairs_per_task(config, q) for q in config.tasks.train}
    timing = training_time(config, parent_training_throughput(config) if lineage else None)
    # Each planned stage's counts; the order (and a stage with nothing to count) comes from the registry.
    details = {
        r.VALIDATE: StagePlan(r.VALIDATE.name, {"config_hash": config.config_hash()[:16]}),
        r.INFERENCE_UP: StagePlan(
            r.INFERENCE_UP.name, {"served_name": config.models.served_name, "backend": config.inference.backend}
        ),
        r.SEARCH: _search_plan(config),
        **_collection_plans(config, comparisons),
        **_training_plans(config, timing),
        r.EVALUATE: _evaluation_plan(config),
    }
    return CyclePlan(
        cycle=config.cycle_name,
        generation=config.generation,
        stages=[details.get(stage, StagePlan(stage.name, {})) for stage in r.PLANNED],
        training_command=training_command,
        windows_per_step=config.training.effective_windows_per_step,
        resources=_resources(config),
        totals=_totals(details, comparisons),
        lora_target_pattern=lora_target_pattern(config.training.lora_target_modules),
        training_time=timing,
    )


def _search_plan(config: CycleConfig) -> StagePlan:
    """RHI: per task, a reference episode and one per version; a baseline judgement per version, an arbitration
    (at most) and a proposal per iteration."""
    tasks = len(config.tasks.train_candidates)
    iterations = config.search.iterations
    versions = iterations + 1
    counts: dict[str, int | str] = {
        "tasks": tasks,
        "versions_per_task": versions,
        "episodes": tasks * (1 + versions),
        "baseline_judge_calls": tasks * versions,
        "arbitration_calls_max": tasks * iterations,
        "optimizer_calls": tasks * iterations,
    }
    return StagePlan(r.SEARCH.name, counts)


def _collection_plans(config: CycleConfig, comparisons: Mapping[int, int]) -> dict[r.Stage, StagePlan]:
    """Collection, ranking and selection over the training tasks: upper bounds, as a task only goes on when its
    retained workflow qualifies. `comparisons`: the ranking pairs of each task."""
    tasks = len(config.tasks.train)
    candidates = config.collection.candidates
    per_task = sorted(set(comparisons.values()))
    ranked: dict[str, int | str] = {
        "comparisons_per_task": per_task[0] if len(per_task) == 1 else "/".join(map(str, per_task)),
        "self_judge_calls": sum(comparisons.values()),
    }
    selected: dict[str, int | str] = {
        "train_trajectories": tasks * config.collection.train_ranks,
        "val_trajectories": tasks,
    }
    return {
        r.COLLECT: StagePlan(
            r.COLLECT.name, {"tasks": tasks, "candidates": candidates, "episodes": tasks * candidates}, upper_bound=True
        ),
        r.RANK: StagePlan(r.RANK.name, ranked, upper_bound=True),
        r.SELECT: StagePlan(r.SELECT.name, selected, upper_bound=True),
    }


def _training_plans(config: CycleConfig, timing: TrainingTime) -> dict[r.Stage, StagePlan]:
    """Render, train (steps, validations, checkpoints and the planned time), checkpoint selection, export and
    registration."""
    t = config.training
    windows_per_step = t.effective_windows_per_step
    train: dict[str, int | str] = {
        "steps": t.steps,
        "windows_per_step": windows_per_step,
        "windows_drawn": t.steps * windows_per_step,
        "validations": count_validations(t.steps, t.val_every, t.val_at_start),
        "checkpoints": count_checkpoints(t.steps, t.save_every),
        "tokens_per_step": round(timing.tokens_per_step),
        "tokens_per_s": round(timing.tokens_per_s),
        "wall_clock_h": f"{timing.wall_clock_h:.2f}",
        "gpu_hours": f"{timing.gpu_hours:.2f}",
        "throughput": timing.source,
    }
    return {
        r.RENDER: StagePlan(
            r.RENDER.name, {"window": t.window, "context_overlap": t.context_overlap, "windows": "after render"}
        ),
        r.TRAIN: StagePlan(r.TRAIN.name, train),
        r.SELECT_CHECKPOINT: StagePlan(
            r.SELECT_CHECKPOINT.name, {"criterion": "minimum validation loss, step 0 excluded"}
        ),
        r.EXPORT: StagePlan(
            r.EXPORT.name, {"formats": "+".join(config.export.formats), "fp8_block": config.export.fp8_block_size}
        ),
        r.REGISTER: StagePlan(r.REGISTER.name, {"generation": config.generation + 1}),
    }


def _evaluation_plan(config: CycleConfig) -> StagePlan:
    """Rollouts of both generations on the rollout tasks, one pair per rollout, each judged by every external judge
    and seed and by the self-judge."""
    rollout_tasks = config.rollout_tasks()
    rollouts = len(rollout_tasks) * config.evaluation.rollout_count
    judges = len(config.evaluation.judges) * len(config.evaluation.judge_seeds)
    counts: dict[str, int | str] = {
        "rollout_tasks": len(rollout_tasks),
        "rollouts_per_generation": rollouts,
        "pairs": rollouts,
        "external_judgements": rollouts * judges,
        "self_judge_calls": rollouts,
    }
    return StagePlan(r.EVALUATE.name, counts)


def _resources(config: CycleConfig) -> ResourcePlan:
    t = config.training
    return ResourcePlan(
        inference_gpus=config.inference.server.gpus,
        inference_capacity=config.inference.max_concurrent_requests,
        episode_concurrency=config.inference.max_concurrent_requests,
        training_nodes=t.nnodes,
        training_ranks=t.replicas,
        training_gpus=t.replicas,
        reference_training_gpus=t.replicas * t.gpus_per_rank,
    )


def _totals(details: Mapping[r.Stage, StagePlan], comparisons: Mapping[int, int]) -> dict[str, int]:
    """The plan's totals, read from its stages' counts (episodes: two generations roll out)."""

    def count(stage: r.Stage, key: str) -> int:
        value = details[stage].counts[key]
        if not isinstance(value, int):
            raise TypeError(f"{stage.name}.{key} is not a count: {value!r}")
        return value

    rhi, collection = count(r.SEARCH, "episodes"), count(r.COLLECT, "episodes")
    return {
        "rhi_episodes": rhi,
        "collection_episodes": collection,
        "comparisons_per_ranked_task": max(comparisons.values(), default=0),
        "train_trajectories": count(r.SELECT, "train_trajectories"),
        "val_trajectories": count(r.SELECT, "val_trajectories"),
        "episodes_total": rhi + collection + 2 * count(r.EVALUATE, "rollouts_per_generation"),
    }


def next_cycle_overrides(config: CycleConfig) -> dict[str, Any]:
    """The config keys that turn `config` (cycle L(k) → L(k+1)) into the next cycle L(k+1) → L(k+2): L(k+1) is the
    parent and is served under its generation name, the exported models move one generation, and the search and
    collection seed bases move one stride (MASS_SPEC §2: this is how cycle2 follows paper). Everything else is kept.
    The CLI (`mass-ops plan --next-of CYCLE`) and the cycle DAG's continuation use this one function."""
    from mass_ops.compute.kubernetes import generation_name

    g = config.generation + 1
    return {
        "generation": g,
        "models.parent_bf16": config.models.next_bf16,
        "models.served_name": generation_name(g),
        "models.next_bf16": next_generation_key(config.models.next_bf16, g),
        "models.next_fp8": next_generation_key(config.models.next_fp8, g),
        "search.seed_base": next_cycle_seed_base(config.search.seed_base),
        "collection.seed_base": next_cycle_seed_base(config.collection.seed_base),
    }


def next_cycle_config(config: CycleConfig) -> CycleConfig:
    """The next cycle's validated config: `config` with `next_cycle_overrides` applied and its name left to be
    derived (`<preset>-L<generation>`), so that it names a new cycle."""
    from mass_ops.config import validate_config

    data = config.model_dump(mode="json")
    data["name"] = None
    for dotted, value in next_cycle_overrides(config).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate_config(data)


def frozen_cycle_config(config: CycleConfig, cycle: str) -> CycleConfig:
    """The config frozen in the metadata store (of `config`'s storage) for the cycle named `cycle`; InputError when
    no such cycle was opened there."""
    from mass_ops.config import validate_config
    from mass_ops.store.repository import MetadataRepository

    repo = MetadataRepository.from_url(config.storage.metadata_url)
    row = repo.get_cycle(cycle)
    if row is None:
        raise InputError(f"--next-of {cycle}: no cycle of that name in {config.storage.metadata_url}")
    return validate_config(row.config)


def cycle_work(config: CycleConfig, plan: CyclePlan) -> list[StageWork]:
    """The planned work of the stages that cost something (model calls, episodes, GPU time), from `plan`'s counts:
    what `cost.estimate` prices, one line per cost category of the stage registry, in its order. Counts that are upper
    bounds (arbitration, collection) stay upper bounds."""
    from mass_ops.cost.estimate import StageWork, WorkItem

    counts = {stage.stage: stage.counts for stage in plan.stages}
    served = config.models.served_name
    search, evaluate = counts[r.SEARCH.name], counts[r.EVALUATE.name]
    versions = int(search["versions_per_task"])
    per_judge = int(evaluate["pairs"]) * len(config.evaluation.judge_seeds)
    external = [
        WorkItem("external_judge", per_judge, judge.model, on_server=False) for judge in config.evaluation.judges
    ]
    return [
        StageWork(
            r.cost_category(r.SEARCH),
            (
                WorkItem("episode", int(search["episodes"]), served, episode=True, chain=versions),
                WorkItem("judge", int(search["baseline_judge_calls"]) + int(search["arbitration_calls_max"]), served),
                WorkItem("optimizer", int(search["optimizer_calls"]), served, chain=versions - 1),
            ),
        ),
        StageWork(
            r.cost_category(r.COLLECT),
            (WorkItem("episode", int(counts[r.COLLECT.name]["episodes"]), served, episode=True),),
        ),
        StageWork(r.cost_category(r.RANK), (WorkItem("judge", int(counts[r.RANK.name]["self_judge_calls"]), served),)),
        StageWork(
            r.cost_category(r.TRAIN),
            train_steps=config.training.steps,
            train_gpus=plan.resources.training_gpus,
            servers=0,
        ),
        StageWork(
            r.cost_category(r.EVALUATE),
            (
                WorkItem("episode", 2 * int(evaluate["rollouts_per_generation"]), served, episode=True),
                WorkItem("judge", int(evaluate["self_judge_calls"]), served),
                *external,
            ),
            servers=2,  # L(k+1) and L(k) are served side by side
        ),
    ]


def cycle_estimate(config: CycleConfig, plan: CyclePlan, *, lineage: bool = True) -> CycleEstimate:
    """The pre-run estimate of the cycle (`cost.estimate`): per-unit figures measured on the parent generation's
    cycle when this config's metadata store holds it (and `lineage`), else the documented defaults. A store that
    cannot be read leaves the defaults: `plan` works offline."""
    from mass_ops.cost.estimate import Capacity, estimate_cycle

    measured: dict[str, UnitFigures] = {}
    step_s = None
    parent_name = None
    if lineage:
        measured, step_s, parent_name = _lineage_figures(config)
        if plan.training_time is not None and plan.training_time.measured_cycle is not None:
            step_s = plan.training_time.step_s  # the parent's tokens/s at this config's tokens per step
    capacity = Capacity(
        concurrency=config.inference.max_concurrent_requests,
        server_gpus=config.inference.server.gpus,
        self_hosted=not config.is_remote_backend and config.models.served_name not in config.prices.models,
    )
    return estimate_cycle(
        config.cycle_name,
        cycle_work(config, plan),
        capacity,
        config.prices,
        measured,
        train_step_s=step_s,
        lineage_cycle=parent_name,
        scale=config.preset,
    )


def _lineage_figures(config: CycleConfig) -> tuple[dict[str, UnitFigures], float | None, str | None]:
    """(figures, seconds per training step, parent cycle name) of the parent generation's cycle, or empty."""
    from sqlalchemy.exc import SQLAlchemyError

    from mass_ops.cost.lineage import measured_figures, measured_step_seconds, parent_cycle
    from mass_ops.stages.common import TRAINING_RUN_KEY
    from mass_ops.store.errors import StorageError
    from mass_ops.store.repository import MetadataRepository

    url = config.storage.metadata_url
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        if not database or not Path(database).is_file():
            return {}, None, None  # nothing recorded yet; opening it would create the file
    try:
        repo = MetadataRepository.from_url(config.storage.metadata_url)
        parent = parent_cycle(repo, config.generation)
        if parent is None:
            return {}, None, None
        return (
            measured_figures(repo, parent.id),
            measured_step_seconds(repo, parent.id, TRAINING_RUN_KEY),
            parent.name,
        )
    except (SQLAlchemyError, StorageError, OSError):
        return {}, None, None


def parent_training_throughput(config: CycleConfig) -> MeasuredThroughput | None:
    """The throughput logged by the finished training run of the parent generation's cycle (the cycle that
    registered L(generation)), read from this config's stores; None when there is none or a store cannot be read
    (`plan` works offline, and never creates an SQLite file)."""
    from sqlalchemy.exc import SQLAlchemyError

    from mass_ops.cost.lineage import parent_cycle
    from mass_ops.stages.common import TRAINING_RUN_KEY
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops.store.errors import StorageError
    from mass_ops.store.repository import MetadataRepository
    from mass_ops.store.schema import RunStatus
    from mass_ops.train.checkpoints import log_rows

    url = config.storage.metadata_url
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        if not database or not Path(database).is_file():
            return None
    try:
        repo = MetadataRepository.from_url(url)
        parent = parent_cycle(repo, config.generation)
        if parent is None:
            return None
        run = repo.get_training_run(parent.id, TRAINING_RUN_KEY)
        if run is None or run.status != RunStatus.SUCCEEDED:
            return None
        artifacts = open_artifact_store(config.storage.artifact_url)
        keys = [f"{training_prefix(parent.name)}/{run.key}/train_log.jsonl"]
        if run.log_uri:
            with contextlib.suppress(ValueError):
                key = artifacts.key_of(run.log_uri)
                keys.insert(0, key if key.endswith(".jsonl") else f"{key.rstrip('/')}/train_log.jsonl")
        for key in keys:
            if artifacts.exists(key):
                text = artifacts.get_bytes(key).decode("utf-8", errors="replace")
                return measured_throughput(parent.name, run.key, log_rows(text, key, strict=False))
        return None
    except (SQLAlchemyError, StorageError, OSError):
        return None


def estimate_summary(config: CycleConfig) -> dict[str, Any]:
    """`plan --json`'s `estimate` for `config` and its check against the cycle budget: what the trigger form's
    estimate page shows (plain JSON)."""
    from mass_ops.cost.estimate import check_budget
    from mass_ops.train.plan import training_command_for

    estimate = cycle_estimate(config, build_plan(config, training_command_for(config)))
    check = check_budget(estimate, config.budgets.cycle_cost_usd, config.budgets.cycle_tokens)
    return {
        "cycle": config.cycle_name,
        "estimate": estimate.as_dict(),
        "budget": {
            "cycle_cost_usd": config.budgets.cycle_cost_usd,
            "cycle_tokens": config.budgets.cycle_tokens,
            "over_budget": check.over_budget,
            "problems": check.problems,
        },
    }
