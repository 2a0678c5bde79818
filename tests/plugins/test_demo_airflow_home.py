"""The demo's Airflow helpers that need no Airflow run: the note `dag.test()` logs while nothing can run."""

from __future__ import annotations

import logging

import pytest
from mass_ops_airflow.demo import airflow_home as demo_airflow


def test_the_nothing_to_run_warning_becomes_one_short_info_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(demo_airflow.DAG_TEST_LOGGER)
    demo_airflow.quiet_waiting_notes()
    demo_airflow.quiet_waiting_notes()  # idempotent: one filter
    try:
        assert sum(isinstance(f, demo_airflow.WaitingNote) for f in logger.filters) == 1
        waiting = {f"<TaskInstance: mass_cycle.rhi.step_v{i} map_index=0 [None] ti_id=...>" for i in range(40)}
        with caplog.at_level(logging.INFO, logger=demo_airflow.DAG_TEST_LOGGER):
            # The two calls dag.test() makes (Airflow 3.3, airflow/sdk/definitions/dag.py), as it makes them.
            logger.warning("No tasks to run. unrunnable tasks: %s", waiting)
            logger.info("[DAG TEST] starting task_id=%s map_index=%s", "report", -1)
        first, second = caplog.records
        assert first.levelno == logging.INFO
        assert first.getMessage() == demo_airflow.WAITING_NOTE % 40 and len(first.getMessage()) < 100
        assert second.getMessage() == "[DAG TEST] starting task_id=report map_index=-1"  # others pass unchanged
    finally:
        for f in [f for f in logger.filters if isinstance(f, demo_airflow.WaitingNote)]:
            logger.removeFilter(f)
