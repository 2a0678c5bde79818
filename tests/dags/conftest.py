"""Fixtures of the DAG tests: Airflow's environment (shared with the plugin tests) and the stand-in stages."""

from __future__ import annotations

import pytest

from tests.plugins.airflow_env import HOST_VARIABLES  # first: sets up Airflow's environment before its import
from tests.plugins.conftest import StageRecorder, _no_host_settings, stages, task_context

__all__ = ["HOST_VARIABLES", "StageRecorder", "_no_host_settings", "stages", "task_context"]


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata database (migrated once per session) with the mass-ops pools."""
    from airflow.models.pool import Pool
    from airflow.utils.db import initdb

    initdb()
    for pool in ("mass_inference", "mass_gpu"):
        Pool.create_or_update_pool(pool, 4, "test", include_deferred=True)
