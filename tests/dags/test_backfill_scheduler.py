"""Backfill as operators do it: `airflow backfill create` run by a real `airflow scheduler` (LocalExecutor, Postgres)
over nightly dates of `mass_nightly_eval` where one night failed reruns that night's missing work only, and records
no evaluation twice (slow: Airflow's scheduler and API server as subprocesses on a private home).

The nightly stages are the stand-in of `backfill_site/` (a ledger of evaluations keyed by night and generation, the
way the real stage keys its results); the scheduler, its workers and the task processes all load it. Nothing waits
on a clock: the test polls the metadata database for the scheduler's heartbeat and the backfill's completion, and
fails at once with the components' own last log lines when one of them exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.deploy.demo_ui_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
STAND_IN_SITE = Path(__file__).with_name("backfill_site")
DAG_ID = "mass_nightly_eval"
NIGHTS = ["2026-11-01", "2026-11-02"]  # the first succeeds, the second fails
NEW_NIGHT = "2026-11-03"  # no run yet when the repair starts
FAILED = ("2026-11-02", "L2")  # the night whose second evaluation fails the first time
READY_TIMEOUT_S = 300.0
BACKFILL_TIMEOUT_S = 600.0


@dataclass
class Airflow:
    """A private Airflow: its environment, its database and the component processes started on it."""

    home: Path
    url: str
    env: dict[str, str]
    processes: dict[str, subprocess.Popen[bytes]]

    def cli(self, *args: str) -> str:
        """`airflow ARGS` on this home; a failure fails the test with its output."""
        argv = [str(Path(sys.executable).with_name("airflow")), *args]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.fail(
                f"airflow {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        return done.stdout

    def start(self, name: str, *args: str) -> None:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - the component holds it until it stops
        argv = [str(Path(sys.executable).with_name("airflow")), *args]
        self.processes[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def check_alive(self) -> None:
        """Fail now, with its last log lines, when a component has exited."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = "\n".join((self.home / f"{name}.log").read_text(errors="replace").splitlines()[-40:])
                pytest.fail(f"airflow {name} exited with {process.returncode}; its last lines:\n{tail}")

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll `ready` every second; fail fast when a component dies, or at the bound."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout_s:.0f} s")
            time.sleep(1)

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def _environment(home: Path, database_url: str, port: int, ledger: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MASS_"))}
    paths = [str(STAND_IN_SITE), str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(paths),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            # One secret for the scheduler (signs the task tokens) and the API server (checks them).
            "AIRFLOW__API_AUTH__JWT_SECRET": "backfill-test-secret-" + "x" * 32,
            # The scheduler runs the backfills only: no run of tonight's schedule mixes in.
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "MASS_NIGHTLY_DEADLINE_HOURS": "0",
            "MASS_TEST_STAGE_LEDGER": str(ledger),
        }
    )
    return env


@pytest.fixture
def airflow(tmp_path: Path, postgres_url: str) -> Iterator[Airflow]:
    """Airflow on a fresh Postgres database: migrated, pools set, DAGs serialized, the nightly DAG unpaused, then
    the API server (the task processes' execution API) and the scheduler, ready."""
    home = tmp_path / "airflow"
    home.mkdir()
    port = free_port()
    env = _environment(home, postgres_url, port, tmp_path / "ledger.db")
    instance = Airflow(home=home, url=f"http://127.0.0.1:{port}", env=env, processes={})
    instance.cli("db", "migrate")
    instance.cli("pools", "set", "mass_inference", "2", "backfill test")
    instance.cli("pools", "set", "mass_gpu", "1", "backfill test")
    instance.cli("dags", "reserialize")
    instance.cli("dags", "unpause", DAG_ID)
    engine = sa.create_engine(postgres_url, poolclass=sa.pool.NullPool)
    try:
        instance.start("api-server", "api-server")
        instance.start("scheduler", "scheduler")
        instance.wait_for("the API server's health", lambda: _healthy(instance.url), READY_TIMEOUT_S)
        instance.wait_for("the scheduler's heartbeat", lambda: _scheduler_beats(engine), READY_TIMEOUT_S)
        yield instance
    finally:
        instance.stop()
        engine.dispose()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v2/monitor/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _scheduler_beats(engine: sa.Engine) -> bool:
    query = "SELECT count(*) FROM job WHERE job_type = 'SchedulerJob' AND state = 'running'"
    with engine.connect() as connection:
        return bool(connection.exec_driver_sql(query).scalar())


def _backfill(
    airflow: Airflow, engine: sa.Engine, first: str, last: str, *reprocess: str, until_complete: bool = False
) -> int:
    """`airflow backfill create` over [first, last] (nights at 03:00 UTC), then wait until every run it holds has
    finished and, with `until_complete`, until the scheduler marks the backfill complete (it does every 30 s; a DAG
    takes a new backfill only then); returns its id."""
    airflow.cli(
        "backfill", "create", "--dag-id", DAG_ID, "--from-date", f"{first}T00:00:00+00:00",
        "--to-date", f"{last}T23:00:00+00:00", "--max-active-runs", "1", *reprocess,
    )  # fmt: skip
    with engine.connect() as connection:
        backfill_id = int(connection.exec_driver_sql("SELECT max(id) FROM backfill").scalar())

    def finished() -> bool:
        query = (
            "SELECT count(*) FILTER (WHERE r.state NOT IN ('success', 'failed')), count(r.id), count(b.id) "
            f"FROM backfill_dag_run b LEFT JOIN dag_run r ON r.id = b.dag_run_id WHERE b.backfill_id = {backfill_id} "
            "AND b.dag_run_id IS NOT NULL"
        )
        with engine.connect() as connection:
            unfinished, runs, rows = connection.exec_driver_sql(query).one()
            if not until_complete:
                return unfinished == 0 and runs == rows
            completed = f"SELECT completed_at FROM backfill WHERE id = {backfill_id}"
            return unfinished == 0 and runs == rows and connection.exec_driver_sql(completed).scalar() is not None

    airflow.wait_for(f"the runs of backfill {backfill_id}", finished, BACKFILL_TIMEOUT_S)
    return backfill_id


def _runs(engine: sa.Engine) -> dict[str, tuple[str, str]]:
    """(state, run_type) of the nightly DAG's runs by night."""
    query = f"SELECT logical_date, state, run_type FROM dag_run WHERE dag_id = '{DAG_ID}'"
    with engine.connect() as connection:
        return {str(row[0].date()): (row[1], row[2]) for row in connection.exec_driver_sql(query)}


def _tries(engine: sa.Engine) -> dict[tuple[str, str, int], int]:
    """try_number of each task instance of the nightly DAG, by (night, task, map index)."""
    query = (
        "SELECT r.logical_date, t.task_id, t.map_index, t.try_number FROM task_instance t "
        f"JOIN dag_run r ON r.dag_id = t.dag_id AND r.run_id = t.run_id WHERE t.dag_id = '{DAG_ID}'"
    )
    with engine.connect() as connection:
        return {(str(r[0].date()), r[1], r[2]): r[3] for r in connection.exec_driver_sql(query)}


def _ledger(path: Path) -> tuple[Counter[tuple[str, str]], list[tuple[str, str, str]]]:
    with contextlib.closing(sqlite3.connect(path)) as ledger:
        units = Counter(ledger.execute("SELECT night, generation FROM evaluations").fetchall())
        calls = ledger.execute("SELECT night, generation, outcome FROM calls").fetchall()
    return units, calls


@pytest.mark.slow(seconds=120)
@pytest.mark.postgres
@pytest.mark.timeout(READY_TIMEOUT_S + 2 * BACKFILL_TIMEOUT_S + 300)
def test_backfill_of_failed_nights_reruns_only_their_missing_work(
    airflow: Airflow, postgres_url: str, tmp_path: Path
) -> None:
    engine = sa.create_engine(postgres_url, poolclass=sa.pool.NullPool)
    ledger = tmp_path / "ledger.db"
    try:
        # Two nights, the second of which fails: one of its two evaluations fails (no retry), the other is recorded.
        Path(f"{ledger}.fail").write_text("|".join(FAILED) + "\n")
        _backfill(airflow, engine, NIGHTS[0], NIGHTS[-1], until_complete=True)
        assert {night: state for night, (state, _) in _runs(engine).items()} == {
            NIGHTS[0]: "success",
            NIGHTS[1]: "failed",
        }
        tries_before = _tries(engine)

        # The operator's repair: a backfill over those nights and the next one, reprocessing failed runs only.
        Path(f"{ledger}.fail").unlink()
        second = _backfill(airflow, engine, NIGHTS[0], NEW_NIGHT, "--reprocess-behavior", "failed")

        runs = _runs(engine)
        assert {night: state for night, (state, _) in runs.items()} == dict.fromkeys([*NIGHTS, NEW_NIGHT], "success")
        with engine.connect() as connection:
            query = (
                f"SELECT logical_date, dag_run_id, exception_reason FROM backfill_dag_run WHERE backfill_id = {second}"
            )
            rows = {str(r[0].date()): (r[1], r[2]) for r in connection.exec_driver_sql(query)}
        # The night that had succeeded was left alone; the failed one was taken over; the new one created.
        assert rows[NIGHTS[0]][0] is None and rows[NIGHTS[0]][1], rows
        assert rows[NIGHTS[1]][0] is not None and rows[NEW_NIGHT][0] is not None, rows
        tries_after = _tries(engine)
        # Task instances of the good nights did not run again; the failed night's evaluations ran once more.
        assert {k: v for k, v in tries_after.items() if k in tries_before and k[0] != NIGHTS[1]} == {
            k: v for k, v in tries_before.items() if k[0] != NIGHTS[1]
        }
        for index in (0, 1):
            key = (NIGHTS[1], "nightly_evaluate", index)
            assert tries_after[key] == tries_before[key] + 1, (key, tries_before[key], tries_after[key])

        # Every (night, generation) evaluated exactly once; the failed night's recorded evaluation was reused.
        units, calls = _ledger(ledger)
        nights = [*NIGHTS, NEW_NIGHT]
        assert units == Counter({(night, generation): 1 for night in nights for generation in ("L1", "L2")})
        evaluated = Counter((night, generation) for night, generation, outcome in calls if outcome == "evaluated")
        assert set(evaluated.values()) == {1}
        assert sorted(call for call in calls if call[0] == NIGHTS[1]) == sorted(
            [(NIGHTS[1], "L1", "evaluated"), (NIGHTS[1], "L2", "failed"), (NIGHTS[1], "L1", "reused"),
             (NIGHTS[1], "L2", "evaluated")]
        )  # fmt: skip
        assert not [call for call in calls if call[0] != NIGHTS[1] and call[2] != "evaluated"], calls
    finally:
        engine.dispose()
