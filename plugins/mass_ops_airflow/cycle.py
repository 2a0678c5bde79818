"""How a task gets its config and calls a stage: params → validated config → `mass_ops.stages.api.<name>(config, …)`.

`mass_ops.stages.api` is imported on first use, inside the task, so DAG files stay fast to parse. A stage's return
value goes to XCom, which carries ids and URIs only: anything that is not small JSON is refused loudly rather than
silently stuffed into Airflow's database.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mass_ops_airflow.hooks import MassArtifactHook, storage_from_connections

if TYPE_CHECKING:
    from mass_ops.config import CycleConfig

STAGES_MODULE = "mass_ops.stages.api"
XCOM_LIMIT_BYTES = 16 * 1024


class StageResultError(TypeError):
    """A stage returned something that cannot go to XCom (not JSON, or not small)."""


def cycle_config(params: Mapping[str, Any]) -> CycleConfig:
    """The run's config from its params, with storage from the Airflow connections when they are defined."""
    from mass_ops_airflow.params import build_config

    return build_config(params, storage=storage_from_connections())


def stage_function(name: str) -> Any:
    """`mass_ops.stages.api.<name>` (imported now, not at DAG parse time)."""
    module = importlib.import_module(STAGES_MODULE)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{STAGES_MODULE} has no stage function {name!r}")
    return function


def xcom_safe(name: str, value: Any) -> Any:
    """Return `value` if it is JSON-able and under the XCom budget; else raise `StageResultError` naming the stage."""
    try:
        encoded = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise StageResultError(f"stage {name} returned a value that is not JSON ({exc}); return ids and URIs") from None
    if len(encoded) > XCOM_LIMIT_BYTES:
        raise StageResultError(
            f"stage {name} returned {len(encoded)} bytes; XCom carries ids and URIs only (limit {XCOM_LIMIT_BYTES})"
        )
    return json.loads(encoded)


def call_stage(name: str, config: CycleConfig, *args: Any, **kwargs: Any) -> Any:
    """Run one stage in this process, with the artifact connection's credentials exported for its duration."""
    function = stage_function(name)
    with MassArtifactHook().credentials_env():
        result = function(config, *args, **kwargs)
    return xcom_safe(name, result)


def run_stage(name: str, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`call_stage` with the config rebuilt from the run's params (what every in-process task does)."""
    return call_stage(name, cycle_config(params), *args, **kwargs)
