"""`mass-ops demo`: one MASS cycle on the embedded default, on a laptop CPU.

It builds a tiny Qwen3-architecture model with random weights and the real Qwen3 tokenizer, publishes it as L0 in a
local artifact folder, serves it with `transformers serve`, and runs the cycle's stages in order with the `demo`
preset: RHI search, teacher collection, ranking, selection, render, ZeRO-3 LoRA training on CPU, checkpoint
selection, BF16 merge + FP8 export, registration of L1, rollouts of L1 and L0, their pairwise evaluation, and the
report. A random model's outputs are noise: the demo shows that every part is real and connected, not that the
model improves.

The cycle runs as one run of the `mass_cycle` DAG through Airflow's machinery (see `airflow_home` beside this file):
the same DAG file, operators and stage functions a production deployment uses, on the local backend. This package
is the Airflow side of the demo; `mass-ops demo` imports it lazily, so the core package never imports Airflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from mass_ops.config import CycleConfig, load_config
from mass_ops.errors import InfrastructureError

# transformers serve lists a model under the path it was given, so the demo serves it from a path relative to the
# working directory and uses that path as the served name.
DEMO_MODEL_DIR = "runs/demo/models/L0-bf16"
DEMO_STORAGE_ENV = {"MASS_METADATA_URL": "sqlite:///runs/demo/mass-ops.db", "MASS_ARTIFACT_URL": "runs/demo/artifacts"}
DEMO_STORAGE = [
    f"storage.metadata_url={DEMO_STORAGE_ENV['MASS_METADATA_URL']}",
    f"storage.artifact_url={DEMO_STORAGE_ENV['MASS_ARTIFACT_URL']}",
]


def demo_config(overrides: list[str] | None = None) -> CycleConfig:
    """The demo preset pointed at `runs/demo/` and at the locally served tiny model."""
    return load_config("demo", [*DEMO_STORAGE, f"models.served_name={DEMO_MODEL_DIR}", *(overrides or [])])


def inspect_commands(config: CycleConfig, overrides: list[str] | None = None) -> list[list[str]]:
    """The `mass-ops` commands that read the demo's cycle back (status, a repair dry run, the report), with the
    config the demo ran with: the demo preset (whose storage is `runs/demo/`) and the same overrides, so the config
    hash matches and the stage commands accept it. Relative paths: run them from the folder the demo ran in."""
    sets = [arg for value in (f"models.served_name={DEMO_MODEL_DIR}", *(overrides or [])) for arg in ("--set", value)]
    base = ["--config", "demo", *sets]
    cycle = config.cycle_name
    return [
        ["mass-ops", "status", cycle, *base],
        ["mass-ops", "repair", cycle, *base, "--dry-run"],
        ["mass-ops", "report", *base],
    ]


def prepare_parent(config: CycleConfig) -> Path:
    """Build the tiny L0 (idempotent) and publish it to the artifact store under `models.parent_bf16`."""
    from mass_ops.models.tiny import build_tiny_qwen3
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops.store.model_folders import publish_model

    model_dir = build_tiny_qwen3(Path(DEMO_MODEL_DIR), max_position_embeddings=config.inference.context_window_tokens)
    publish_model(open_artifact_store(config.storage.artifact_url), config.models.parent_bf16, model_dir)
    return model_dir


def run_demo(
    config: CycleConfig,
    console: Console | None = None,
    overrides: list[str] | None = None,
    *,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run the whole demo cycle as one `mass_cycle` DAG run through Airflow's own machinery (`dag.test()` on the
    demo's private Airflow home); returns where the report and the new model are, and the wall-clock per stage.

    By default Airflow's records (and every child process's output) go to a file under `runs/demo/logs/`, each task's
    part of it also to the Airflow home's log folder (the UI's Logs tab, `task_logs`), and the terminal shows the live
    view of `live` (one plain line per finished task instance when it is not a TTY); `verbose` prints everything as
    it comes instead. Raises InfrastructureError naming the failed tasks when the run
    does not succeed (rerunning resumes: every stage skips the units it already finished).
    """
    from mass_ops_airflow.demo import airflow_home as demo_airflow
    from mass_ops_airflow.demo import live

    console = console or Console()
    started = time.monotonic()
    demo_airflow.use_demo_airflow()  # before anything imports airflow

    if verbose:

        def step(name: str, call: Callable[[], Any]) -> Any:
            console.rule(f"[bold]{name}")
            t0 = time.monotonic()
            result = call()
            console.print(f"{name}: done in {time.monotonic() - t0:.1f} s", markup=False)
            return result

        step("build and publish the tiny L0 model", lambda: prepare_parent(config))
        step("Airflow database and pools", demo_airflow.prepare_database)
        dag = demo_airflow.load_dag()
        demo_airflow.quiet_waiting_notes()
        run = step("mass_cycle DAG run", lambda: dag.test(run_conf=demo_airflow.demo_run_conf(overrides)))
        log_path = None
    else:
        log_path = live.new_log_path()
        console.print(f"Airflow logs: {log_path}", markup=False, highlight=False, soft_wrap=True)
        with live.redirected_output(log_path) as terminal:
            view = Console(file=terminal)  # a TTY when the terminal is one: the live table; else plain lines
            with view.status("building the tiny L0 model and the Airflow database"):
                prepare_parent(config)
                demo_airflow.prepare_database()
                dag = demo_airflow.load_dag()
            demo_airflow.quiet_waiting_notes()
            from mass_ops_airflow.demo.task_logs import TaskLogFiles  # imports Airflow: only once redirected

            # Each task's lines also go where the UI's Logs tab reads them (`mass-ops demo --ui` on this home).
            task_logs = TaskLogFiles(log_path).install()
            try:
                run = _watched_run(dag, overrides, view, log_path)
            finally:
                task_logs.finish()
    states = demo_airflow.task_states(run)
    if str(run.state) != "success":
        failed = ", ".join(demo_airflow.failed_tasks(run)) or "none failed"
        where = f"see {log_path}" if log_path else "see the output above"
        counts = ", ".join(f"{n} {state}" for state, n in states.items())
        raise InfrastructureError(
            f"mass_cycle run {run.run_id} ended {run.state}; failed tasks: {failed} ({counts}); {where}"
        )
    report = demo_airflow.xcom_result(run, "report") or {}
    registered = demo_airflow.xcom_result(run, "register") or {}
    evaluated = demo_airflow.xcom_result(run, "evaluate") or {}
    return {
        "cycle": config.cycle_name,
        "inspect": inspect_commands(config, overrides),
        "report": report.get("html"),
        "report_markdown": report.get("markdown"),
        "generation": registered,
        "evaluation": evaluated,
        "run_id": run.run_id,
        "task_states": states,
        "timings_s": _task_durations(run),
        "total_s": round(time.monotonic() - started, 1),
        "log": str(log_path) if log_path else None,
    }


def _watched_run(dag: Any, overrides: list[str] | None, view: Console, log_path: Path) -> Any:
    """`dag.test()` with a second thread polling the run's task instances into the live view (or plain lines)."""
    from mass_ops_airflow.demo import airflow_home as demo_airflow
    from mass_ops_airflow.demo import live

    after = live.newest_run_id(dag.dag_id)
    progress = live.DemoProgress(order=dag.task_ids, log_path=log_path)
    on_finished = None if view.is_terminal else (lambda ti: view.print(live.finished_line(ti), markup=False))
    watcher = live.RunWatcher(lambda: live.airflow_snapshots(dag.dag_id, after), progress, on_finished=on_finished)
    watcher.start()
    try:
        if view.is_terminal:
            with Live(progress, console=view, refresh_per_second=2, transient=False):
                run = dag.test(run_conf=demo_airflow.demo_run_conf(overrides))
                watcher.stop()
        else:
            run = dag.test(run_conf=demo_airflow.demo_run_conf(overrides))
    finally:
        watcher.stop()
    return run


def _task_durations(run: Any) -> dict[str, float]:
    """Seconds spent per task id (mapped instances summed), in the order the tasks started."""
    durations: dict[str, float] = {}
    instances = sorted(run.get_task_instances(), key=lambda ti: (ti.start_date is None, ti.start_date))
    for ti in instances:
        if ti.duration:
            durations[ti.task_id] = round(durations.get(ti.task_id, 0.0) + float(ti.duration), 1)
    return durations
