"""Fixtures of the Airflow-side tests that other folders use too (tests/plugins, tests/cost), built from
`tests.support.airflow`. A folder's conftest imports the ones it wants; test modules never import fixtures.

- `host_settings_cleared`: this machine's MASS_* settings unset for the test (the plugin tests use it for all).
- `stages`: a `StageRecorder` standing in for `mass_ops.stages.api` for the test.
"""

from __future__ import annotations

import pytest

from tests.support.airflow import StageRecorder, clear_host_settings, install_stage_recorder


@pytest.fixture
def host_settings_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_host_settings(monkeypatch)


@pytest.fixture
def stages(monkeypatch: pytest.MonkeyPatch) -> StageRecorder:
    return install_stage_recorder(monkeypatch)
