"""The planned shape of a cycle: stage graph, unit counts, training launch and resource plan.

Counts are upper bounds where the outcome decides (collection only runs for tasks whose retained workflow beats the
reference; arbitration calls only happen when two versions beat it). Window counts are unknown until render.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError
from mass_ops.layout import next_generation_key
from mass_ops.seeds import next_cycle_seed_base
from mass_ops.train.lora_targets import lora_target_pattern

if TYPE_CHECKING:
    from mass_ops.cost.estimate import CycleEstimate, StageWork

STAGES: tuple[str, ...] = (
    "validate_config",
    "inference_up",
    "search",
    "collect",
    "rank",
    "select",
    "inference_down",
    "render",
    "train",
    "select_checkpoint",
    "export",
    "register",
    "evaluate",
    "report",
)


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

    def as_dict(self) -> dict:
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


def build_plan(config: CycleConfig, training_command: list[str]) -> CyclePlan:
    """Compute the plan of one cycle from its config."""
    tasks = config.tasks
    search_tasks = list(tasks.train_candidates)
    versions = config.search.iterations + 1
    rhi_episodes = len(search_tasks) * (1 + versions)
    baseline_judgements = len(search_tasks) * versions
    arbitration_max = len(search_tasks) * config.search.iterations
    proposals = len(search_tasks) * config.search.iterations

    collect_tasks = list(tasks.train)
    collection_episodes = len(collect_tasks) * config.collection.candidates
    comparisons_per_task = {q: ranking_pairs_per_task(config, q) for q in collect_tasks}
    ranking_calls = sum(comparisons_per_task.values())
    train_traj = len(collect_tasks) * config.collection.train_ranks
    val_traj = len(collect_tasks)

    t = config.training
    windows_per_step = t.effective_windows_per_step
    rollout_tasks = config.rollout_tasks()
    rollouts = len(rollout_tasks) * config.evaluation.rollout_count
    pairs = rollouts
    external = pairs * len(config.evaluation.judges) * len(config.evaluation.judge_seeds)

    per_task = sorted(set(comparisons_per_task.values()))
    stages = [
        StagePlan("validate_config", {"config_hash": config.config_hash()[:16]}),
        StagePlan("inference_up", {"served_name": config.models.served_name, "backend": config.inference.backend}),
        StagePlan(
            "search",
            {
                "tasks": len(search_tasks),
                "versions_per_task": versions,
                "episodes": rhi_episodes,
                "baseline_judge_calls": baseline_judgements,
                "arbitration_calls_max": arbitration_max,
                "optimizer_calls": proposals,
            },
        ),
        StagePlan(
            "collect",
            {"tasks": len(collect_tasks), "candidates": config.collection.candidates, "episodes": collection_episodes},
            upper_bound=True,
        ),
        StagePlan(
            "rank",
            {
                "comparisons_per_task": per_task[0] if len(per_task) == 1 else "/".join(map(str, per_task)),
                "self_judge_calls": ranking_calls,
            },
            upper_bound=True,
        ),
        StagePlan("select", {"train_trajectories": train_traj, "val_trajectories": val_traj}, upper_bound=True),
        StagePlan("inference_down", {}),
        StagePlan("render", {"window": t.window, "context_overlap": t.context_overlap, "windows": "after render"}),
        StagePlan(
            "train",
            {
                "steps": t.steps,
                "windows_per_step": windows_per_step,
                "windows_drawn": t.steps * windows_per_step,
                "validations": count_validations(t.steps, t.val_every, t.val_at_start),
                "checkpoints": count_checkpoints(t.steps, t.save_every),
            },
        ),
        StagePlan("select_checkpoint", {"criterion": "minimum validation loss, step 0 excluded"}),
        StagePlan("export", {"formats": "+".join(config.export.formats), "fp8_block": config.export.fp8_block_size}),
        StagePlan("register", {"generation": config.generation + 1}),
        StagePlan(
            "evaluate",
            {
                "rollout_tasks": len(rollout_tasks),
                "rollouts_per_generation": rollouts,
                "pairs": pairs,
                "external_judgements": external,
                "self_judge_calls": pairs,
            },
        ),
        StagePlan("report", {}),
    ]
    resources = ResourcePlan(
        inference_gpus=config.inference.server.gpus,
        inference_capacity=config.inference.max_concurrent_requests,
        episode_concurrency=config.inference.max_concurrent_requests,
        training_nodes=t.nnodes,
        training_ranks=t.replicas,
        training_gpus=t.replicas,
        reference_training_gpus=t.replicas * t.gpus_per_rank,
    )
    totals = {
        "rhi_episodes": rhi_episodes,
        "collection_episodes": collection_episodes,
        "comparisons_per_ranked_task": max(per_task) if per_task else 0,
        "train_trajectories": train_traj,
        "val_trajectories": val_traj,
        "episodes_total": rhi_episodes + collection_episodes + 2 * rollouts,
    }
    return CyclePlan(
        cycle=config.cycle_name,
        generation=config.generation,
        stages=stages,
        training_command=training_command,
        windows_per_step=windows_per_step,
        resources=resources,
        totals=totals,
        lora_target_pattern=lora_target_pattern(config.training.lora_target_modules),
    )


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
    what `cost.estimate` prices. Counts that are upper bounds (arbitration, collection) stay upper bounds."""
    from mass_ops.cost.estimate import StageWork, WorkItem

    counts = {stage.stage: stage.counts for stage in plan.stages}
    served = config.models.served_name
    search, evaluate = counts["search"], counts["evaluate"]
    versions = int(search["versions_per_task"])
    per_judge = int(evaluate["pairs"]) * len(config.evaluation.judge_seeds)
    external = [
        WorkItem("external_judge", per_judge, judge.model, on_server=False) for judge in config.evaluation.judges
    ]
    return [
        StageWork(
            "search",
            (
                WorkItem("episode", int(search["episodes"]), served, episode=True, chain=versions),
                WorkItem("judge", int(search["baseline_judge_calls"]) + int(search["arbitration_calls_max"]), served),
                WorkItem("optimizer", int(search["optimizer_calls"]), served, chain=versions - 1),
            ),
        ),
        StageWork("collect", (WorkItem("episode", int(counts["collect"]["episodes"]), served, episode=True),)),
        StageWork("rank", (WorkItem("judge", int(counts["rank"]["self_judge_calls"]), served),)),
        StageWork("train", train_steps=config.training.steps, train_gpus=plan.resources.training_gpus, servers=0),
        StageWork(
            "evaluate",
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

    measured: dict = {}
    step_s = None
    parent_name = None
    if lineage:
        measured, step_s, parent_name = _lineage_figures(config)
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
    )


def _lineage_figures(config: CycleConfig) -> tuple[dict, float | None, str | None]:
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
