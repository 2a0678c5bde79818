"""Every stage of mass-ops, declared once: name, label, CLI command, DAG task ids, unit kinds, cost category.

`STAGES` lists them in the order of a cycle, then the nightly and benchmark DAGs. The CLI, `plan`, `status`,
`repair`, the cost estimate and the report take their stage lists, names, labels, order and cost lines from here
(`COST_CATEGORIES`, `episode_cost_category`, `call_cost_category`); tests/stages/test_registry.py ties every task of
every DAG in dags/ to a stage here (or to `NON_STAGE_TASKS`), every stage to its function and every command to the
CLI.

It sits on the floor and imports nothing of mass_ops, so the stage layer, the domain packages (the report, the
estimate) and the DAG files all read it without an import cycle and without loading the platform;
`mass_ops.stages.registry` re-exports it. Unit kinds are the `store.schema` values (`EpisodeKind`, `CallPurpose`) as
plain strings, checked against the enums by the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

CYCLE_DAG = "mass_cycle"  # = mass_ops_airflow.CYCLE_DAG_ID (mass_ops never imports the Airflow side)
NIGHTLY_DAG = "mass_nightly_eval"
BENCHMARKS_DAG = "mass_benchmarks"


@dataclass(frozen=True)
class Stage:
    """One stage. `dag_tasks` may end in ``*`` for a numbered family (the search steps); `clear_tasks` are the DAG
    tasks `repair` clears (downstream follows), when not `dag_tasks`."""

    name: str
    label: str  # what people read in the CLI's tables
    command: str | None = None  # `mass-ops <command>` runs (and redoes) the stage
    job: bool = False  # `mass-ops stage <name>` runs it whole (what a Kubernetes Job runs)
    per_task: bool = False  # its command and function take the task ids to (re)do
    dag: str = CYCLE_DAG
    dag_tasks: tuple[str, ...] = ()
    clear_tasks: tuple[str, ...] | None = None
    episode_kinds: tuple[str, ...] = ()  # the episodes it records (store.schema.EpisodeKind)
    call_purposes: tuple[str, ...] = ()  # the model calls it records (store.schema.CallPurpose)
    call_prefix: str | None = None  # unit keys of its calls start so (evaluation's ``eval/``), whatever the purpose
    cost_category: str | None = None  # the line of the cost estimate and the report its spend goes to
    planned: bool = True  # `mass-ops plan` lists it (cycle stages)
    tracked: bool = False  # `status` counts its units and `repair` redoes them

    def owns_task(self, task_id: str) -> bool:
        """Whether the DAG task `task_id` (group-qualified, e.g. ``inner_loop.step_v3``) belongs to this stage."""
        return any(fnmatchcase(task_id, pattern) for pattern in self.dag_tasks)

    @property
    def repair_tasks(self) -> tuple[str, ...]:
        return self.dag_tasks if self.clear_tasks is None else self.clear_tasks


INNER_LOOP = "inner_loop"  # the cycle DAG's task group mapped per task: search steps, then collect_task, rank_task

VALIDATE = Stage("validate_config", "validate_config", command="validate", job=True, dag_tasks=("validate_config",))
INFERENCE_UP = Stage("inference_up", "inference server up", dag_tasks=("inference_up",))
SEARCH = Stage(
    "search",
    "RHI search",
    command="search",
    per_task=True,
    dag_tasks=("search_tasks", f"{INNER_LOOP}.reference_episode", f"{INNER_LOOP}.episode_v0", f"{INNER_LOOP}.step_v*"),
    episode_kinds=("reference", "search"),
    call_purposes=("judge", "optimizer", "arbitration"),
    cost_category="search",
    tracked=True,
)
COLLECT = Stage(
    "collect",
    "teacher collection",
    command="collect",
    per_task=True,
    dag_tasks=(f"{INNER_LOOP}.collect_task",),
    episode_kinds=("collection",),
    cost_category="collect",
    tracked=True,
)
RANK = Stage(
    "rank",
    "ranking",
    command="rank",
    per_task=True,
    dag_tasks=(f"{INNER_LOOP}.rank_task",),
    call_purposes=("self_judge",),
    cost_category="rank",
    tracked=True,
)
SELECT = Stage("select", "selection", command="select", dag_tasks=("select",), tracked=True)
INFERENCE_DOWN = Stage("inference_down", "inference server down", dag_tasks=("inference_down",))
RENDER = Stage("render", "render", command="render", job=True, dag_tasks=("render",), tracked=True)
TRAIN = Stage("train", "training", command="train", job=True, dag_tasks=("train",), cost_category="train", tracked=True)
SELECT_CHECKPOINT = Stage("select_checkpoint", "checkpoint selection", job=True, dag_tasks=("select_checkpoint",))
# `status` and `repair` follow checkpoint selection, export and registration as one stage, `mass-ops export`.
EXPORT = Stage(
    "export",
    "export",
    command="export",
    job=True,
    dag_tasks=("export",),
    clear_tasks=SELECT_CHECKPOINT.dag_tasks,
    tracked=True,
)
REGISTER = Stage("register", "registration", job=True, dag_tasks=("register",))
# The evaluation's rollout episodes (its own units in `status`); `mass-ops plan` counts them under evaluate.
ROLLOUT = Stage(
    "rollout",
    "rollouts",
    dag_tasks=("rollout_units", "rollout"),
    clear_tasks=("rollout",),
    episode_kinds=("rollout",),
    cost_category="evaluate",
    planned=False,
    tracked=True,
)
EVALUATE = Stage(
    "evaluate",
    "evaluation",
    dag_tasks=("evaluation_inference_up", "evaluate", "evaluation_inference_down"),
    clear_tasks=("evaluate",),
    call_purposes=("external_judge",),
    call_prefix="eval/",
    cost_category="evaluate",
    tracked=True,
)
REPORT = Stage("report", "report", command="report", job=True, dag_tasks=("report",))
PROMOTE = Stage("promote", "promotion", dag_tasks=("promotion_request", "approve_promotion", "promote"), planned=False)
NIGHTLY_EVALUATE = Stage(
    "nightly_evaluate",
    "nightly evaluation",
    dag=NIGHTLY_DAG,
    dag_tasks=(
        "nightly_targets",
        "serving_targets",
        "nightly_inference_up",
        "nightly_evaluate",
        "nightly_inference_down",
    ),
    episode_kinds=("rollout",),
    cost_category="evaluate",
    planned=False,
)
CHECK_REGRESSION = Stage(
    "check_regression", "regression check", dag=NIGHTLY_DAG, dag_tasks=("check_regression",), planned=False
)
NIGHTLY_BENCHMARK = Stage(
    "nightly_benchmark",
    "nightly benchmark slice",
    dag=NIGHTLY_DAG,
    dag_tasks=("benchmark_slice_units", "benchmark_slice_trial", "benchmark_slice_scores"),
    episode_kinds=("benchmark",),
    cost_category="benchmark",
    planned=False,
)
NIGHTLY_REPORT = Stage(
    "nightly_report", "nightly report", dag=NIGHTLY_DAG, dag_tasks=("nightly_report",), planned=False
)
BENCHMARK = Stage(
    "benchmark",
    "benchmark trials",
    dag=BENCHMARKS_DAG,
    dag_tasks=("benchmark_units", "benchmarks_up", "benchmark_trial", "benchmarks_down"),
    episode_kinds=("benchmark",),
    cost_category="benchmark",
    planned=False,
)

STAGES: tuple[Stage, ...] = (
    VALIDATE,
    INFERENCE_UP,
    SEARCH,
    COLLECT,
    RANK,
    SELECT,
    INFERENCE_DOWN,
    RENDER,
    TRAIN,
    SELECT_CHECKPOINT,
    EXPORT,
    REGISTER,
    ROLLOUT,
    EVALUATE,
    REPORT,
    PROMOTE,
    NIGHTLY_EVALUATE,
    CHECK_REGRESSION,
    NIGHTLY_BENCHMARK,
    NIGHTLY_REPORT,
    BENCHMARK,
)
# DAG tasks that are no stage's work: the cycle's hand-over to the next cycle and a join of the nightly DAG.
NON_STAGE_TASKS: dict[str, tuple[str, ...]] = {CYCLE_DAG: ("continue_cycle",), NIGHTLY_DAG: ("benchmark_slice_done",)}

PLANNED: tuple[Stage, ...] = tuple(s for s in STAGES if s.planned)
TRACKED: tuple[Stage, ...] = tuple(s for s in STAGES if s.tracked)
JOBS: tuple[Stage, ...] = tuple(s for s in STAGES if s.job)


def stage_of_task(dag: str, task_id: str) -> Stage | None:
    """The stage that DAG `dag`'s task `task_id` belongs to, or None (a non-stage task, or an unknown one)."""
    return next((s for s in STAGES if s.dag == dag and s.owns_task(task_id)), None)


def stage_of_episode(kind: str, stages: tuple[Stage, ...] = TRACKED) -> Stage | None:
    """The stage of `stages` that records episodes of `kind`, or None."""
    return next((s for s in stages if kind in s.episode_kinds), None)


# -- the lines of the cost estimate and the report ---------------------------------------------------------------------

# Every cost category, once, in the order of the stages: the report's stage rows and the estimate's lines.
COST_CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(s.cost_category for s in STAGES if s.cost_category))


def cost_category(stage: Stage) -> str:
    """`stage`'s cost category; ValueError for a stage whose work neither the estimate nor the report prices."""
    if stage.cost_category is None:
        raise ValueError(f"stage {stage.name!r} has no cost category")
    return stage.cost_category


def episode_cost_category(kind: str) -> str | None:
    """The cost category episodes of `kind` go to (the first stage recording them that has one), or None."""
    return next((s.cost_category for s in STAGES if kind in s.episode_kinds and s.cost_category), None)


def call_cost_category(unit_key: str, purpose: str) -> str | None:
    """The cost category of a model call: a stage whose `call_prefix` starts `unit_key` (evaluation's ``eval/``
    holds its own judge calls too), else the stage that records calls of `purpose`; None for neither."""
    stage = next((s for s in STAGES if s.call_prefix and unit_key.startswith(s.call_prefix)), None)
    stage = stage or next((s for s in STAGES if purpose in s.call_purposes), None)
    return stage.cost_category if stage else None
