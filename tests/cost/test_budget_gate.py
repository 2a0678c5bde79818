"""The cycle DAG's validate_config refuses a run whose estimate exceeds the cycle budget unless the trigger form's
`allow_over_budget` is checked; the stage function makes the same decision before it touches any store."""

from __future__ import annotations

# isort: off
from tests.plugins.airflow_env import HOST_VARIABLES  # noqa: F401 - first: Airflow's environment before its import
# isort: on

from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.execution_time.context import set_current_context

from mass_ops.errors import InputError
from mass_ops.ops import api as real_api  # the real module: the `stages` fixture replaces it in sys.modules
from tests.dags.dag_files import dag_module
from tests.support.airflow import StageRecorder

pytestmark = pytest.mark.usefixtures("host_settings_cleared")  # no MASS_* setting of this machine reaches the DAG

# The demo preset's own scale estimates ~0.6 M tokens (and no USD: a CPU run has no GPU-hours); 1,000 are exceeded.
OVER = {"preset": "demo", "overrides": ["budgets.cycle_tokens=1000"]}


def call_validate(params: dict[str, Any]) -> Any:
    function = dag_module("mass_cycle").dag.get_task("validate_config").python_callable
    with set_current_context({}):
        return function(params=params)


def test_the_dag_refuses_an_over_budget_run_unless_allowed(stages: StageRecorder) -> None:
    # validate_config runs the real budget gate, then records the call instead of opening stores.
    def validate(config: Any, *args: Any) -> dict[str, Any]:
        summary = real_api.cycle_estimate(config, *args)
        stages.calls.append(("validate_config", (config, *args)))
        return {"stage": "validate_config", **summary}

    stages.passthrough["validate_config"] = validate
    with pytest.raises(InputError, match=r"estimated tokens .* exceed budgets.cycle_tokens 1,000.*allow_over_budget"):
        call_validate(OVER)
    assert stages.calls == []
    result = call_validate({**OVER, "allow_over_budget": True})
    assert result["over_budget"] is True and result["estimate"]["tokens"] > 1000
    assert [args[1:] for _, args in stages.calls] == [(True,)]
    within = call_validate({"preset": "demo", "overrides": ["budgets.cycle_tokens=100000000"]})
    assert within["over_budget"] is False


def test_validate_config_refuses_before_touching_a_store(tmp_path: Path) -> None:
    from mass_ops.config import load_config
    from mass_ops.ops.api import validate_config

    url = f"sqlite:///{tmp_path}/meta.db"
    config = load_config("demo", ["budgets.cycle_tokens=1000", f"storage.metadata_url={url}",
                                  f"storage.artifact_url={tmp_path}/artifacts"])  # fmt: skip
    with pytest.raises(InputError, match=r"exceed budgets\.cycle_tokens"):
        validate_config(config)
    assert list(tmp_path.iterdir()) == []
