"""`mass-ops …`: a thin shell over the stage functions (Typer + Rich).

Every command that takes a config accepts `--config PRESET|FILE` and repeatable `--set a.b=c`. A bad config or bad
input prints one line per problem on stderr and exits with status 2; nothing is written before validation passes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from mass_ops.config import ConfigError, CycleConfig, config_json_schema, load_config
from mass_ops.errors import EXIT_INPUT, MassOpsError, exit_code_for
from mass_ops.prompts.cli import prompts_app
from mass_ops.stages.registry import COLLECT, EXPORT, JOBS, RANK, RENDER, REPORT, SEARCH, SELECT, TRAIN, VALIDATE

if TYPE_CHECKING:
    from collections.abc import Callable

    from mass_ops.cost.estimate import CycleEstimate

app = typer.Typer(no_args_is_help=True, add_completion=False, help="MASS self-improvement cycles as a pipeline.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect and validate cycle configs.")
app.add_typer(config_app, name="config")


def _mount_episode_app() -> None:
    from mass_ops.runtime.cli import episode_app

    app.add_typer(episode_app, name="episode")


db_app = typer.Typer(no_args_is_help=True, help="The metadata schema: create, upgrade, downgrade.")
app.add_typer(db_app, name="db")
store_app = typer.Typer(no_args_is_help=True, help="The artifact store: staging leftovers and unreferenced files.")
app.add_typer(store_app, name="store")
tasks_app = typer.Typer(no_args_is_help=True, help="The task catalogue: list shipped tasks, import MASS-format ones.")
app.add_typer(tasks_app, name="tasks")
app.add_typer(prompts_app, name="prompts")

console = Console()
err_console = Console(stderr=True)

ConfigOption = Annotated[str, typer.Option("--config", "-c", help="Preset (paper, cycle2, demo) or YAML/JSON file.")]
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a key: a.b=c (repeatable).")]


def fail(lines: list[str] | str, code: int = 2) -> typer.Exit:
    """Print problems on stderr, one per line, and return the Exit to raise."""
    for line in [lines] if isinstance(lines, str) else lines:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def failure(title: str, exc: BaseException, *, resume_hint: str = "rerun to resume") -> typer.Exit:
    """One line for a failed command, with the exit status of its kind (`mass_ops.errors`): bad input exits 2, a
    failed dependency or unit exits 1. An error that is not one of mass-ops' own (a library's stray ValueError) is an
    internal error, exit 1 — never reported as bad input."""
    code = exit_code_for(exc)
    if code == EXIT_INPUT:
        return fail(f"{title}: {exc}")
    if code is not None:
        return fail(f"{title} failed: {exc}; {resume_hint}", code=code)
    return fail(f"{title} failed: internal error ({type(exc).__name__}: {exc}); {resume_hint}", code=1)


# What a command turns into one line; anything else (a bug) keeps its traceback.
HANDLED = (MassOpsError, ValueError, RuntimeError, OSError)


def shown_config(cfg: CycleConfig) -> dict[str, Any]:
    """The config as JSON for printing: store URLs with their passwords masked (they come from MASS_METADATA_URL /
    MASS_ARTIFACT_URL and may carry credentials)."""
    from mass_ops.store.urls import mask_url

    data = cfg.model_dump(mode="json")
    for key in ("metadata_url", "artifact_url"):
        data["storage"][key] = mask_url(data["storage"][key])
    return data


def resolve_config(config: str, overrides: list[str] | None) -> CycleConfig:
    """Load and validate a config, turning `ConfigError` into exit 2."""
    try:
        return load_config(config, overrides or ())
    except ConfigError as exc:
        raise fail(exc.problems) from None


@config_app.command("show")
def config_show(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Print the validated config as JSON."""
    cfg = resolve_config(config, set_)
    console.print_json(json.dumps(shown_config(cfg)))


@config_app.command("validate")
def config_validate(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Validate a config and its prompt templates; prints its cycle name and hash."""
    from mass_ops.prompts import check_templates

    cfg = resolve_config(config, set_)
    try:
        cfg.require_catalogue()
        check_templates(cfg)
    except ConfigError as exc:
        raise fail(exc.problems) from None
    console.print(f"ok: cycle {cfg.cycle_name} config {cfg.config_hash()}")


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the cycle config."""
    sys.stdout.write(json.dumps(config_json_schema(), indent=2) + "\n")


@app.command()
def plan(
    config: ConfigOption = "paper",
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    next_of: Annotated[
        str | None,
        typer.Option(
            "--next-of",
            help="Plan the cycle after CYCLE (read from this config's metadata store): L(k+1) as parent, seeds one "
            "stride on; prints the --set lines that start it.",
        ),
    ] = None,
    show_config: Annotated[
        bool, typer.Option("--show-config", help="Also print the resolved config as JSON (secrets masked).")
    ] = False,
) -> None:
    """Print the stage graph with planned counts, the training command, the resources and the cost estimate."""
    from mass_ops.ops.plan import (
        build_plan,
        cycle_estimate,
        frozen_cycle_config,
        next_cycle_config,
        next_cycle_overrides,
    )
    from mass_ops.train.plan import training_command_for

    cfg = resolve_config(config, set_)
    if next_of is not None:
        try:
            previous = frozen_cycle_config(cfg, next_of)
            following = next_cycle_overrides(previous)
            cfg = next_cycle_config(previous)
        except HANDLED as exc:
            raise failure("plan --next-of", exc) from None
        if not as_json:
            lines = " ".join(f"--set {key}={json.dumps(value)}" for key, value in following.items())
            console.print(
                f"next cycle of {next_of}: {cfg.cycle_name}; start it with: {lines}", markup=False, soft_wrap=True
            )
    cycle_plan = build_plan(cfg, training_command_for(cfg))
    estimate = cycle_estimate(cfg, cycle_plan)
    if as_json:
        payload = {"config": shown_config(cfg), "plan": cycle_plan.as_dict(), "estimate": estimate.as_dict()}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    if show_config:
        console.print_json(json.dumps(shown_config(cfg)))
    print_plan(cycle_plan, cfg)
    print_estimate(estimate, cfg)


def print_plan(cycle_plan: Any, cfg: CycleConfig) -> None:
    """The stage graph with its planned counts, the totals, the training launch and the resources, readable at 80
    columns (see `mass_ops.console`)."""
    from mass_ops.console import Column, heading, human, label, print_command, print_prose, print_table

    gen = cfg.generation
    heading(console, f"cycle {cycle_plan.cycle}: L{gen} -> RHI -> teacher collection -> SFT -> L{gen + 1}")
    print_prose(console, "Stage graph and planned counts:")
    for i, stage in enumerate(cycle_plan.stages, 1):
        counts = ", ".join(f"{label(k)} {human(v)}" for k, v in stage.counts.items())
        bound = " (upper bound)" if stage.upper_bound else ""
        print_prose(console, f"{i:>2}. {stage.stage}" + (f": {counts}{bound}" if counts else ""), hanging="      ")
    rows = [[label(key), human(value)] for key, value in cycle_plan.totals.items()]
    print_table(console, "Totals", [Column("what"), Column("count", numeric=True)], rows)
    print_prose(console, f"effective batch: {cycle_plan.windows_per_step} windows per optimizer step")
    print_prose(console, "LoRA targets:")
    console.print(f"  {cycle_plan.lora_target_pattern}", markup=False, highlight=False, soft_wrap=True)
    print_prose(console, "training command:")
    print_command(console, cycle_plan.training_command)
    r = cycle_plan.resources
    print_prose(
        console,
        f"resources: inference {r.inference_gpus} GPU (capacity {r.inference_capacity} concurrent requests); "
        f"episodes {r.episode_concurrency} pods at once; training {r.training_nodes} node(s) × "
        f"{r.training_ranks // r.training_nodes} rank(s) = {r.training_gpus} GPU(s) "
        f"(reference topology: {r.reference_training_gpus} GPUs); export 1 CPU job",
    )


def print_estimate(estimate: CycleEstimate, cfg: CycleConfig) -> None:
    """The per-stage cost estimate as two tables (work and tokens; hours and money), with what it was made from and
    the budget it is checked against. "±" figures appear only when the estimate carries a spread."""
    from mass_ops.console import Column, print_prose, print_table
    from mass_ops.cost.estimate import check_budget

    rows = [*estimate.stages, estimate.total]
    spread = any(s.prompt_tokens_sd or s.completion_tokens_sd for s in rows)

    def tokens(value: int, sd: int) -> str:
        return f"{value / 1e6:,.1f}" + (f"±{sd / 1e6:,.1f}" if sd else "")

    title = "Estimate per stage: work" + (" (± one standard deviation)" if spread else "")
    print_table(
        console,
        title,
        [Column("stage"), Column("episodes", True), Column("LLM calls", True), Column("prompt Mtok", True),
         Column("completion Mtok", True)],
        [[s.stage, f"{s.episodes:,}", f"{s.llm_calls:,}", tokens(s.prompt_tokens, s.prompt_tokens_sd),
          tokens(s.completion_tokens, s.completion_tokens_sd)] for s in rows],
    )  # fmt: skip
    print_table(
        console,
        "Estimate per stage: time and cost",
        [Column("stage"), Column("serving GPU-h", True), Column("training GPU-h", True), Column("wall-clock h", True),
         Column("USD", True)],
        [[s.stage, f"{s.serving_gpu_hours:,.1f}", f"{s.training_gpu_hours:,.1f}", f"{s.wall_clock_s / 3600:,.1f}",
          f"{s.cost_usd:,.2f}"] for s in rows],
    )  # fmt: skip
    source = (
        f"measured on {estimate.lineage_cycle}" if estimate.lineage_cycle else "defaults (mass_ops/cost/estimate.py)"
    )
    print_prose(
        console,
        f"per-unit figures: {source}; prices: config.prices (serving {cfg.prices.serving_gpu_hour_usd} USD/GPU-h, "
        f"training {cfg.prices.training_gpu_hour_usd} USD/GPU-h)",
    )
    if estimate.unpriced_models:
        print_prose(
            console, f"not priced (no prices.models entry, counted at 0 USD): {', '.join(estimate.unpriced_models)}"
        )
    check = check_budget(estimate, cfg.budgets.cycle_cost_usd, cfg.budgets.cycle_tokens)
    for line in check.problems:
        print_prose(console, f"over budget: {line}")


def _metadata_url(config: str | None, overrides: list[str] | None, url: str | None) -> str:
    if url:
        return url
    return resolve_config(config or "demo", overrides).storage.metadata_url


UrlOption = Annotated[str | None, typer.Option("--url", help="Metadata URL; default: the config's storage.")]
OptionalConfig = Annotated[str | None, typer.Option("--config", "-c", help="Preset or file naming the storage.")]


def _migrate(direction: Literal["upgrade", "downgrade"], revision: str, target: str) -> None:
    """Move the schema at `target` to `revision` and print where it now stands; a failure exits as `db <direction>`."""
    from mass_ops.store.metadata import mask_url
    from mass_ops.store.migrations import current, downgrade, upgrade

    step = upgrade if direction == "upgrade" else downgrade
    try:
        step(target, revision)
        # soft_wrap: a long URL is one line for the terminal to fold, never cut by a newline inside it (copy-paste)
        console.print(
            f"{mask_url(target)} at revision {current(target)}", markup=False, highlight=False, soft_wrap=True
        )
    except HANDLED as exc:
        raise failure(f"db {direction}", exc, resume_hint="fix the store and run it again") from None


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument()] = "head",
    config: OptionalConfig = None,
    set_: SetOption = None,
    url: UrlOption = None,
) -> None:
    """Create the metadata schema or upgrade it to REVISION (default head); Postgres or SQLite."""
    _migrate("upgrade", revision, _metadata_url(config, set_, url))


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision; 'base' drops every table.")],
    config: OptionalConfig = None,
    set_: SetOption = None,
    url: UrlOption = None,
) -> None:
    """Take the metadata schema down to REVISION."""
    _migrate("downgrade", revision, _metadata_url(config, set_, url))


@db_app.command("current")
def db_current(config: OptionalConfig = None, set_: SetOption = None, url: UrlOption = None) -> None:
    """Print the schema revision of the metadata database."""
    from mass_ops.store.migrations import current

    try:
        console.print(str(current(_metadata_url(config, set_, url))), markup=False)
    except HANDLED as exc:
        raise failure("db current", exc, resume_hint="fix the store and run it again") from None


@store_app.command("gc")
def store_gc(
    config: ConfigOption = "demo",
    set_: SetOption = None,
    apply: Annotated[
        bool, typer.Option("--apply", help="Remove what is found (default: a dry run that lists).")
    ] = False,
    delete_unreferenced: Annotated[
        bool, typer.Option("--delete-unreferenced", help="With --apply, also delete artifacts no row references.")
    ] = False,
    grace_s: Annotated[
        float | None, typer.Option("--grace-s", help="Leave anything younger (default $MASS_STORE_GC_GRACE_S, 6 h).")
    ] = None,
) -> None:
    """List (or with --apply remove) staging leftovers of killed writers and artifacts that no metadata row
    references; referenced artifacts are never touched. One tab-separated line per item, then a summary."""
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops.store.gc import gc
    from mass_ops.store.repository import MetadataRepository

    if delete_unreferenced and not apply:
        raise fail("store gc: --delete-unreferenced deletes, so it needs --apply")
    cfg = resolve_config(config, set_)
    try:
        report = gc(
            # Opened without creating anything: the location is checked for the store marker before it is trusted.
            open_artifact_store(cfg.storage.artifact_url, create=False),
            MetadataRepository.from_url(cfg.storage.metadata_url),
            dry_run=not apply,
            delete_unreferenced=delete_unreferenced,
            grace_s=grace_s,
        )
    except HANDLED as exc:
        raise failure("store gc", exc, resume_hint="run it again") from None
    sys.stdout.write("".join(f"{line}\n" for line in report.lines()))  # plain: tab-separated for scripts
    if report.failures:
        raise typer.Exit(1)


@store_app.command("init")
def store_init(config: ConfigOption = "demo", set_: SetOption = None) -> None:
    """Mark the configured artifact store as a mass-ops store (what `store gc` requires). A run's first probe marks
    a store by itself; this is for a store an older mass-ops wrote, before stores carried the marker."""
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops.store.artifacts import STORE_MARKER

    cfg = resolve_config(config, set_)
    try:
        store = open_artifact_store(cfg.storage.artifact_url)
        written = store.mark()
        held = len(store.list())
    except HANDLED as exc:
        raise failure("store init", exc, resume_hint="run it again") from None
    state = "marked" if written else "already marked"
    sys.stdout.write(f"{store.url}: {state} as a mass-ops artifact store ({STORE_MARKER}); {held} artifacts\n")


@tasks_app.command("list")
def tasks_list(
    catalogue: Annotated[str, typer.Option(help="'builtin' or a MASS-format task directory.")] = "builtin",
) -> None:
    """List the tasks of a catalogue with their domain and split."""
    from mass_ops.tasks.importer import load_catalogue

    try:
        cat = load_catalogue(None if catalogue == "builtin" else catalogue)
    except ValueError as exc:
        raise fail(str(exc)) from None
    table = Table(title=f"Tasks ({cat.source})")
    for column in ("id", "domain", "split", "sft", "agents", "bare bytes"):
        table.add_column(column)
    for task in cat:
        split = task.split + (" (excluded)" if task.excluded else "")
        table.add_row(
            str(task.id),
            task.domain,
            split,
            "yes" if task.in_sft else "no",
            str(len(task.initial_agents)),
            str(len(task.bare_prompt.encode())),
        )
    console.print(table)


@tasks_app.command("import")
def tasks_import(
    src: Annotated[Path, typer.Argument(help="MASS-format task directory (bare/, initial/, splits.json, ...).")],
    dest: Annotated[
        Path | None, typer.Option(help="Where to store the validated copy; default catalogues/<name>.")
    ] = None,
) -> None:
    """Validate a MASS-format task directory and copy it atomically; point `tasks.catalogue` at the copy."""
    from mass_ops.tasks.importer import import_task_dir

    target = dest or Path("catalogues") / src.resolve().name
    try:
        cat = import_task_dir(src, target)
    except ValueError as exc:
        raise fail(str(exc)) from None
    console.print(
        f"imported {len(cat)} tasks into {target}; use --set tasks.catalogue={target}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


TasksOption = Annotated[list[int] | None, typer.Option("--tasks", help="Subset of task ids (repeatable).")]


def _summary(title: str, rows: list[dict[str, Any]]) -> None:
    """A Rich table with one row per task (columns from the first row)."""
    if not rows:
        console.print(f"{title}: nothing to do", markup=False)
        return
    table = Table(title=title)
    columns = list(rows[0])
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    console.print(table)


def _stage(title: str, call: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run a stage; domain errors (bad input, refused state) are one line and exit 2."""
    try:
        rows = call()
    except HANDLED as exc:
        # A failed unit (e.g. episodes that kept failing on infrastructure) leaves finished units recorded.
        raise failure(title, exc) from None
    _summary(title, rows)
    return rows


@app.command(VALIDATE.command)
def validate(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Open the cycle: check the catalogue, create/upgrade the schema, freeze the config by hash."""
    from mass_ops.ops import api as ops

    cfg = resolve_config(config, set_)
    _stage(VALIDATE.label, lambda: [ops.validate_config(cfg)])


@app.command(SEARCH.command)
def search(config: ConfigOption = "paper", set_: SetOption = None, tasks: TasksOption = None) -> None:
    """RHI workflow search per task (all tasks concurrently, each task's versions in sequence)."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(SEARCH.label, lambda: stages.search(cfg, tasks))


@app.command(COLLECT.command)
def collect(config: ConfigOption = "paper", set_: SetOption = None, tasks: TasksOption = None) -> None:
    """Teacher collection under each task's retained workflow."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(COLLECT.label, lambda: stages.collect(cfg, tasks))


@app.command(RANK.command)
def rank(config: ConfigOption = "paper", set_: SetOption = None, tasks: TasksOption = None) -> None:
    """Ring tournament, self-judge and Bradley–Terry per eligible task."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(RANK.label, lambda: stages.rank(cfg, tasks))


@app.command("inner-loop")
def inner_loop(config: ConfigOption = "paper", set_: SetOption = None, tasks: TasksOption = None) -> None:
    """Search, collection and ranking per task, pipelined: a task collects as soon as its own search is done and
    ranks as soon as its own collection is; selection follows with `select`."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage("inner loop", lambda: stages.inner_loop(cfg, tasks))


@app.command(SELECT.command)
def select_cmd(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Ranks 1..train_ranks to training, validation_rank to validation."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(SELECT.label, lambda: stages.select(cfg)["tasks"])


@app.command(RENDER.command)
def render_cmd(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Render the selected trajectories into training windows."""
    from mass_ops.stages.render import run_render

    cfg = resolve_config(config, set_)
    _stage(RENDER.label, lambda: run_render(cfg))


@app.command(TRAIN.command)
def train_cmd(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Fine-tune a fresh LoRA (DeepSpeed ZeRO-3); resumes from the newest published checkpoint."""
    from mass_ops.stages.train import run_train

    cfg = resolve_config(config, set_)
    _stage(TRAIN.label, lambda: run_train(cfg))


@app.command(EXPORT.command)
def export_cmd(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Select the checkpoint, merge to BF16, quantise to FP8 and register the next generation."""
    from mass_ops.stages.register import run_export

    cfg = resolve_config(config, set_)
    _stage(EXPORT.label, lambda: run_export(cfg))


@app.command("rollout")
def rollout_cmd(
    generation: Annotated[str, typer.Option(help="Registered generation to roll out, e.g. L1.")],
    config: ConfigOption = "paper",
    set_: SetOption = None,
    tasks: TasksOption = None,
    split: Annotated[str | None, typer.Option(help="train, test or all (default: the config's pool).")] = None,
    count: Annotated[int | None, typer.Option(min=1, help="Replicates per task.")] = None,
    label: Annotated[str | None, typer.Option(help="Name of this rollout set (default: from pool and count).")] = None,
) -> None:
    """Bare-task evaluation rollouts of one generation, recorded as a new rollout set."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(
        "rollouts",
        lambda: [stages.rollout(cfg, generation, tasks=tasks, split=split, count=count, label=label)],
    )


benchmark_app = typer.Typer(no_args_is_help=True, help="Public benchmarks: run a trial of a generation.")
app.add_typer(benchmark_app, name="benchmark")


@benchmark_app.command("run")
def benchmark_run(
    benchmark: Annotated[str, typer.Option(help="tb2, swe, ds or asta.")],
    generation: Annotated[str, typer.Option(help="Registered generation, e.g. L1.")],
    trial: Annotated[int, typer.Option(min=0, help="Trial number (the paper runs 0, 1, 2).")],
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first K tasks.")] = None,
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder (else $MASS_BENCHMARK_DATA).")] = None,
    config: ConfigOption = "paper",
    set_: SetOption = None,
) -> None:
    """Run, grade and record one trial (resumable per instance; nothing is downloaded)."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(
        f"benchmark {benchmark}",
        lambda: [stages.benchmark_trial(cfg, benchmark, generation, trial, limit, data_dir)],
    )


@benchmark_app.command("grader-files")
def benchmark_grader_files(
    uri: Annotated[str, typer.Option(help="The grader bundle's artifact URI.")],
    sha256: Annotated[str, typer.Option(help="Its SHA-256, as the operator stored it.")],
    out: Annotated[Path, typer.Option(help="Where to write the bundle.")],
    config: ConfigOption = "paper",
    set_: SetOption = None,
) -> None:
    """Fetch a grader Job's file bundle from the store and write it once its hash checks (the Job's init step)."""
    from mass_ops.evaluation.benchmarks.grading import write_grader_bundle
    from mass_ops.store.artifact_backends import open_artifact_store

    cfg = resolve_config(config, set_)
    try:
        store = open_artifact_store(cfg.storage.artifact_url)
        write_grader_bundle(store.get_bytes(store.key_of(uri)), sha256, out)
    except HANDLED as exc:
        raise failure("benchmark grader-files", exc) from None


@app.command(REPORT.command)
def report_cmd(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Write the cycle's report (Markdown + HTML with figures) and print where it is."""
    from mass_ops.stages import api as stages

    cfg = resolve_config(config, set_)
    _stage(REPORT.label, lambda: [stages.report(cfg)])


CycleArgument = Annotated[str, typer.Argument(help="Cycle name, as recorded in the metadata store.")]


@app.command("status")
def status_cmd(
    cycle: CycleArgument,
    config: ConfigOption = "paper",
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    # A flag plus --interval rather than an optional value (--watch [SECONDS]): Typer is dropping flag_value.
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C or --watch-count.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.5, help="Seconds between refreshes.")] = 10.0,
    watch_count: Annotated[int | None, typer.Option("--watch-count", min=1, help="Stop after N refreshes.")] = None,
) -> None:
    """Where a cycle stands, from the metadata store only (CLI and Airflow runs alike): per stage units planned /
    done / failed / budget-stopped / pending, tokens and cost against budgets, elapsed and ETA."""
    import time

    from mass_ops.ops.status import cycle_status

    cfg = resolve_config(config, set_)
    shown = 0
    try:
        while True:
            try:
                current = cycle_status(cfg, cycle)
            except HANDLED as exc:
                raise failure("status", exc, resume_hint="check the store and the cycle name") from None
            if as_json:
                sys.stdout.write(json.dumps(current.as_dict()) + "\n")
            else:
                print_status(current)
            shown += 1
            if not watch or (watch_count is not None and shown >= watch_count):
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def print_status(current: Any) -> None:
    """A `ops.status.CycleStatus` as tables that fit 80 columns: units per stage, spend and time per stage,
    then budgets."""
    from mass_ops.console import Column, heading, print_path, print_prose, print_table

    eta = "" if current.eta_s is None else f", ETA of started stages {_duration(current.eta_s)}"
    heading(console, f"cycle {current.cycle}: {current.cycle_status}, elapsed {_duration(current.elapsed_s)}{eta}")
    shown = [s for s in current.stages if s.started or s.planned]

    print_table(
        console,
        "Units per stage",
        [Column("stage"), Column("planned", True), Column("done", True), Column("failed", True),
         Column("budget-stopped", True), Column("pending", True), Column("in flight", True)],
        [[s.stage, str(s.planned), str(s.done), str(s.failed), str(s.budget_exhausted), str(s.pending),
          str(s.in_flight)] for s in shown],
    )  # fmt: skip
    print_table(
        console,
        "Spend and time per stage",
        [Column("stage"), Column("tokens", True), Column("USD", True), Column("elapsed", True), Column("ETA", True)],
        [[s.stage, f"{s.tokens:,}", f"{s.cost_usd:,.2f}", _duration(s.elapsed_s) if s.started else "not started",
          "done" if s.started and s.planned and s.done == s.planned else _duration(s.eta_s)] for s in shown],
    )  # fmt: skip
    print_prose(console, f"pending = in flight or not started; {current.in_flight_note}")
    for s in current.stages:
        if s.note:
            print_prose(console, f"{s.stage}: {s.note}")
    listed = [u for u in current.units if u.state in ("failed", "budget_exhausted") or u.leased]
    for unit in listed:  # what needs a decision, and the episodes at work right now
        print_prose(console, f"{unit.stage}: {unit.key} {unit.state} ({unit.detail})")
    if current.budgets:
        print_table(
            console,
            "Budgets",
            [Column("scope"), Column("tokens", True), Column("token limit", True), Column("USD", True),
             Column("USD limit", True), Column("requests", True), Column("exhausted")],
            [[b.scope, f"{b.tokens:,}", "none" if b.token_limit is None else f"{b.token_limit:,}",
              f"{b.cost_usd:,.4f}", "none" if b.cost_limit is None else f"{b.cost_limit:,.2f}", f"{b.requests:,}",
              "yes" if b.exhausted else "no"] for b in current.budgets],
            caption=f"limits from {current.budgets_from}; spend from the ledger",
        )  # fmt: skip
    else:
        print_prose(console, "budgets: no spend recorded in the ledger yet")
    print_prose(console, f"total: {current.tokens:,} tokens, {current.cost_usd:,.2f} USD")
    if current.store:
        print_path(console, "metadata store", current.store)


@app.command("repair")
def repair_cmd(
    cycle: CycleArgument,
    config: ConfigOption = "paper",
    set_: SetOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what is missing or failed and the commands; change nothing.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    dag_run_id: Annotated[
        str | None, typer.Option("--dag-run-id", help="The Airflow run of the cycle, for the REST call.")
    ] = None,
) -> None:
    """List the missing or failed units of a cycle per stage, the Airflow clear (REST and CLI) and the mass-ops
    commands that redo them; without --dry-run, run those stages (each redoes only its missing units)."""
    from mass_ops.ops.repair import plan_repair, run_repair

    cfg = resolve_config(config, set_)
    config_args = ["--config", config, *(arg for value in set_ or [] for arg in ("--set", value))]
    try:
        plan = plan_repair(cfg, cycle)
    except HANDLED as exc:
        raise failure("repair", exc, resume_hint="check the store and the cycle name") from None
    if as_json:
        sys.stdout.write(json.dumps(plan.as_dict(config_args, dag_run_id)) + "\n")
    else:
        for line in plan.lines(config_args, dag_run_id, width=console.width):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if dry_run or plan.nothing_to_repair:
        return
    try:
        rows = run_repair(cfg, plan)
    except HANDLED as exc:
        raise failure("repair", exc) from None
    for row in rows:
        console.print(f"repaired {row['stage']}: {row['units']} unit(s) redone", markup=False, soft_wrap=True)


JOB_NAMES = ", ".join(stage.name for stage in JOBS)


@app.command("stage")
def stage_cmd(
    name: Annotated[str, typer.Argument(help=f"One of: {JOB_NAMES}.")],
    config: ConfigOption = "paper",
    set_: SetOption = None,
) -> None:
    """Run one whole-cycle stage and print its result as one JSON line (what Kubernetes Jobs run)."""
    from mass_ops.ops.api import STAGE_FUNCTIONS

    stage = next((s for s in JOBS if s.name == name), None)
    if stage is None:
        raise fail(f"stage {name!r}: unknown; choose one of {JOB_NAMES}")
    cfg = resolve_config(config, set_)
    try:
        result = STAGE_FUNCTIONS[stage](cfg)
    except HANDLED as exc:
        raise failure(name, exc) from None
    sys.stdout.write(json.dumps(result, default=str) + "\n")


@app.command()
def demo(
    set_: SetOption = None,
    ui: Annotated[
        bool, typer.Option("--ui", help="Serve the demo's Airflow web UI (airflow standalone) until Ctrl-C.")
    ] = False,
    port: Annotated[
        int | None, typer.Option("--port", min=1, max=65535, help="Port of the UI on 127.0.0.1 (default 8080).")
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", help="Print Airflow's task-runner logs as they come instead of the live view."),
    ] = False,
) -> None:
    """A whole demo cycle on the embedded default: tiny random Qwen3 on CPU, SQLite, a local artifact folder.

    The terminal shows one line per stage of the DAG run (a plain line per finished task when it is not a TTY);
    Airflow's logs go to a file under runs/demo/logs/."""
    if port is not None and not ui:
        raise fail("demo: --port is the port of the web UI; use it with --ui")
    if ui:
        from mass_ops_airflow.demo.ui import DEFAULT_PORT, run_ui

        raise typer.Exit(run_ui(set_, port=port or DEFAULT_PORT, console=console, err_console=err_console))
    from mass_ops_airflow.demo import demo_config, run_demo
    from mass_ops_airflow.demo.live import print_summary

    from mass_ops.ops.plan import build_plan
    from mass_ops.train.plan import training_command_for

    try:
        cfg = demo_config(set_)
    except ConfigError as exc:
        raise fail(exc.problems) from None
    cycle_plan = build_plan(cfg, training_command_for(cfg))
    from mass_ops.console import label, print_prose

    planned = ", ".join(f"{count} {label(what)}" for what, count in cycle_plan.totals.items())
    print_prose(console, f"demo cycle {cfg.cycle_name}: planned {planned}")
    try:
        result = run_demo(cfg, console, set_, verbose=verbose)
    except HANDLED as exc:
        raise failure("demo", exc, resume_hint="rerun to resume (finished units are kept)") from None
    console.rule("done")
    print_summary(console, result)


_mount_episode_app()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
