"""The demo's own Airflow: a private AIRFLOW_HOME with a SQLite database, the repository's DAGs and the two pools.

`mass-ops demo` runs the `mass_cycle` DAG through Airflow's machinery (`dag.test()`: the scheduler's dependency
logic, the task runner, deferral to triggers, mapping, setup/teardown) and `mass-ops demo --ui` starts
`airflow standalone` on the same home, so a run started from the web UI is recorded in the same place.

Airflow reads its configuration once, at first import: `use_demo_airflow` must run before anything imports airflow.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sized
from pathlib import Path
from typing import Any

from mass_ops.errors import InputError
from mass_ops_airflow import CYCLE_DAG_ID
from mass_ops_airflow.demo import DEMO_MODEL_DIR, DEMO_STORAGE_ENV
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

DEMO_AIRFLOW_HOME = Path("runs/demo/airflow")
DAGS_DIR_ENV = "MASS_DAGS_DIR"
# Pool slots of the demo: the tiny model server takes 2 requests at once (inference.max_concurrent_requests).
DEMO_POOLS = {INFERENCE_POOL: 2, GPU_POOL: 1}


# The logger of `dag.test()`, and its note for a second in which no task instance can run (one is deferred, or the
# scheduling logic is still skipping or expanding the rest).
DAG_TEST_LOGGER = "airflow.sdk.definitions.dag"
_NOTHING_TO_RUN = "No tasks to run."
WAITING_NOTE = "waiting: %d unfinished task instances, none runnable yet"


# The `dags/` folder of the clone this package is installed from (an editable install: plugins/mass_ops_airflow/).
CHECKOUT_DAGS = Path(__file__).resolve().parents[3] / "dags"
# Where a wheel of mass-ops puts the DAG files (pyproject's `data-files`), below its install scheme's data folder:
# the environment's prefix, or ~/.local for `pip install --user`. Found through the distribution's file list.
DAGS_DISTRIBUTION = "mass-ops"
INSTALLED_DAGS = ("share", "mass-ops", "dags")


class DemoAirflowError(InputError):
    """The demo's Airflow cannot be prepared (Airflow already imported with another home, no DAG folder): one line
    saying what to set, exit 2 — the install or the environment, not a bug."""


class WaitingNote(logging.Filter):
    """Shortens the warning `dag.test()` logs each second in which nothing can run: it lists every unfinished task
    instance in full (kilobytes a line) though nothing is wrong; the demo shows how many, at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_NOTHING_TO_RUN) and record.args:
            waiting = record.args[0] if isinstance(record.args, tuple) else record.args  # a set of task instances
            record.msg, record.args = WAITING_NOTE, (len(waiting) if isinstance(waiting, Sized) else 0,)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def installed_dags(path: list[str] | None = None) -> Path | None:
    """The DAG folder an installed (non-editable) mass-ops wheel carries, from its RECORD; None when no installed
    distribution lists the cycle DAG there. `path`: where to look for distributions (default `sys.path`)."""
    from importlib.metadata import distributions

    wanted = (*INSTALLED_DAGS, f"{CYCLE_DAG_ID}.py")
    for dist in distributions(name=DAGS_DISTRIBUTION, path=sys.path if path is None else path):
        for file in dist.files or ():
            if file.parts[-len(wanted) :] == wanted:
                return Path(str(dist.locate_file(file))).resolve().parent
    return None


def dags_folder(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of the DAG files the demo's Airflow loads, the first that holds the cycle DAG of: `$MASS_DAGS_DIR`
    when set (taken as is); `dags/` of the working directory (a clone of mass-ops); the `dags/` of the clone this
    package is installed from (editable), so the demo runs from any folder (its `runs/demo/` is made there); the
    DAG files an installed wheel carries (`installed_dags`). None holds it: `./dags`, and `use_demo_airflow` names
    `MASS_DAGS_DIR`."""
    configured = (os.environ if environ is None else environ).get(DAGS_DIR_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    here = Path("dags").resolve()
    for candidate in (here, CHECKOUT_DAGS):
        if (candidate / f"{CYCLE_DAG_ID}.py").is_file():
            return candidate
    return installed_dags() or here


def quiet_waiting_notes() -> None:
    """Install `WaitingNote` on the logger of `dag.test()` (once)."""
    logger = logging.getLogger(DAG_TEST_LOGGER)
    if not any(isinstance(f, WaitingNote) for f in logger.filters):
        logger.addFilter(WaitingNote())


def airflow_environment(home: Path = DEMO_AIRFLOW_HOME) -> dict[str, str]:
    """The environment variables that point Airflow at the demo's home, database and DAG folder."""
    root = home.resolve()
    return {
        "AIRFLOW_HOME": str(root),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder()),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{root / 'airflow.db'}",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # The demo's DAG runs one cycle: each stage gets the whole laptop.
        "AIRFLOW__CORE__PARALLELISM": "4",
        "MASS_DEFAULT_PRESET": "demo",
        # Storage is the deployment's, never a trigger's: the demo's comes from the environment of its Airflow.
        **DEMO_STORAGE_ENV,
    }


def demo_run_conf(overrides: list[str] | None = None) -> dict[str, Any]:
    """The `mass_cycle` params of the demo: the demo preset pointed at `runs/demo/` and the local tiny model."""
    return {"preset": "demo", "overrides": [f"models.served_name={DEMO_MODEL_DIR}", *(overrides or [])]}


def use_demo_airflow(home: Path = DEMO_AIRFLOW_HOME, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Export the demo's Airflow environment into this process; refuse when Airflow is already imported elsewhere."""
    if not (dags_folder() / f"{CYCLE_DAG_ID}.py").is_file():
        raise DemoAirflowError(
            f"no {CYCLE_DAG_ID}.py in {dags_folder()} (no clone's or installed DAG files found); set {DAGS_DIR_ENV} "
            "to the dags/ folder of a mass-ops clone"
        )
    env = airflow_environment(home)
    if "airflow" in sys.modules and os.environ.get("AIRFLOW_HOME") != env["AIRFLOW_HOME"]:
        raise DemoAirflowError("Airflow was imported before the demo could point it at its own home")
    home.mkdir(parents=True, exist_ok=True)
    target = os.environ if environ is None else dict(environ)
    target.update(env)
    return env


def prepare_database() -> None:
    """Create or upgrade the demo's Airflow database and its pools (idempotent)."""
    from airflow.models.pool import Pool
    from airflow.utils.db import initdb

    initdb()
    for name, slots in DEMO_POOLS.items():
        Pool.create_or_update_pool(name, slots, "mass-ops demo", include_deferred=True)


def load_dag(dag_id: str = CYCLE_DAG_ID) -> Any:
    """Execute `dags/<dag_id>.py` and return its DAG (the file Airflow's DAG processor parses)."""
    import importlib.util

    path = dags_folder() / f"{dag_id}.py"
    spec = importlib.util.spec_from_file_location(f"mass_ops_dag_{dag_id}", path)
    if spec is None or spec.loader is None:
        raise DemoAirflowError(f"cannot load the DAG file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def task_states(run: Any) -> dict[str, int]:
    """How many task instances of the run ended in each state (``{"success": 40, "skipped": 12}``)."""
    counts: dict[str, int] = {}
    for ti in run.get_task_instances():
        state = str(ti.state) if ti.state else "none"
        counts[state] = counts.get(state, 0) + 1
    return dict(sorted(counts.items()))


def failed_tasks(run: Any) -> list[str]:
    """``task_id[map_index]`` of every failed task instance of the run."""
    return sorted(
        f"{ti.task_id}[{ti.map_index}]" if ti.map_index >= 0 else ti.task_id
        for ti in run.get_task_instances()
        if str(ti.state) == "failed"
    )


def xcom_result(run: Any, task_id: str) -> Any:
    """The return value (XCom) of an unmapped task of the run, or None."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key="return_value")
        ).first()
        return None if row is None else XComModel.deserialize_value(row)
