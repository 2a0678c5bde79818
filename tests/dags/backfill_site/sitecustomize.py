"""A stand-in `mass_ops.stages.api` for every Python process of the scheduler test (tests/dags/
test_backfill_scheduler.py puts this folder on PYTHONPATH): the scheduler, its executor's workers and their task
processes. Active only when `MASS_TEST_STAGE_LEDGER` names the ledger, a SQLite file shared by those processes.

The nightly evaluation is the unit of work: one row per (logical date, generation), written once (primary key);
a second call for a recorded unit reuses it, as the real stage does. Each call is also logged (`calls`) with its
outcome. A unit named in the file `$MASS_TEST_STAGE_LEDGER.fail` (lines `date|generation`) fails without a retry.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import types
from pathlib import Path
from typing import Any

LEDGER_ENV = "MASS_TEST_STAGE_LEDGER"
GENERATIONS = ["L1", "L2"]


def _ledger() -> sqlite3.Connection:
    connection = sqlite3.connect(os.environ[LEDGER_ENV], timeout=60, isolation_level=None)
    connection.execute(
        "CREATE TABLE IF NOT EXISTS evaluations (night TEXT, generation TEXT, PRIMARY KEY (night, generation))"
    )
    connection.execute("CREATE TABLE IF NOT EXISTS calls (night TEXT, generation TEXT, outcome TEXT)")
    return connection


def nightly_evaluate(config: Any, generation: str, date: str) -> dict[str, Any]:
    night = date[:10]
    failing = Path(os.environ[LEDGER_ENV] + ".fail")
    with _ledger() as ledger:
        if ledger.execute("SELECT 1 FROM evaluations WHERE night=? AND generation=?", (night, generation)).fetchone():
            ledger.execute("INSERT INTO calls VALUES (?, ?, 'reused')", (night, generation))
            return {"generation": generation, "night": night, "reused": True}
        if failing.exists() and f"{night}|{generation}" in failing.read_text().split():
            ledger.execute("INSERT INTO calls VALUES (?, ?, 'failed')", (night, generation))
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(f"scripted failure of the evaluation of {generation} for {night}")
        ledger.execute("INSERT INTO evaluations VALUES (?, ?)", (night, generation))
        ledger.execute("INSERT INTO calls VALUES (?, ?, 'evaluated')", (night, generation))
    return {"generation": generation, "night": night, "reused": False}


def _install() -> None:
    stages = types.ModuleType("mass_ops.stages.api")
    stages.nightly_targets = lambda config: list(GENERATIONS)  # type: ignore[attr-defined]
    stages.nightly_up = lambda config: {"servers": []}  # type: ignore[attr-defined]
    stages.nightly_down = lambda config: {"stopped": True}  # type: ignore[attr-defined]
    stages.nightly_evaluate = nightly_evaluate  # type: ignore[attr-defined]
    stages.check_regression = lambda config, results: {"regressions": []}  # type: ignore[attr-defined]
    stages.nightly_report = lambda config: {"cycle": "nightly", "html": "stand-in"}  # type: ignore[attr-defined]
    sys.modules["mass_ops.stages.api"] = stages


if os.environ.get(LEDGER_ENV):
    _install()
