"""Fixtures of the DAG tests: Airflow's environment (shared with the plugin tests) and the stand-in stages."""

from __future__ import annotations

from tests.plugins.airflow_env import HOST_VARIABLES  # first: sets up Airflow's environment before its import
from tests.plugins.conftest import StageRecorder, _no_host_settings, stages, task_context

__all__ = ["HOST_VARIABLES", "StageRecorder", "_no_host_settings", "stages", "task_context"]
