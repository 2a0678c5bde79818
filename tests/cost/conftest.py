"""Fixtures of the cost tests, shared with the Airflow-side and runtime tests (defined in `tests.support`): the
stand-in stage API and cleared host settings for the DAG's budget gate, the policy stand-in and stand-in agent for
the reconciled spend."""

from __future__ import annotations

from tests.support.airflow_fixtures import host_settings_cleared, stages
from tests.support.runtime_fixtures import policy_host, stand_in_install

__all__ = ["host_settings_cleared", "policy_host", "stages", "stand_in_install"]
