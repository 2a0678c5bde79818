"""Fixtures of the DAG tests: Airflow's environment (shared with the plugin tests) and the stand-in stages."""

from __future__ import annotations

import pytest

from tests.support.airflow import StageRecorder, clear_host_settings, install_stage_recorder


@pytest.fixture(autouse=True)
def _no_host_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_host_settings(monkeypatch)


@pytest.fixture
def stages(monkeypatch: pytest.MonkeyPatch) -> StageRecorder:
    return install_stage_recorder(monkeypatch)


@pytest.fixture(autouse=True)
def _no_nightly_deadline(monkeypatch):
    """No deadline on the nightly DAG these tests load: Airflow 3.3.2's `dag.test()` cannot finish a successful run
    of a DAG with one (its run looks the alerts up by id in a DAG it built from the in-memory objects). The deadline's
    own tests set the variable themselves."""
    monkeypatch.setenv("MASS_NIGHTLY_DEADLINE_HOURS", "0")


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata database (migrated once per session) with the mass-ops pools."""
    from airflow.models.pool import Pool
    from airflow.utils.db import initdb

    initdb()
    for pool in ("mass_inference", "mass_gpu"):
        Pool.create_or_update_pool(pool, 4, "test", include_deferred=True)
