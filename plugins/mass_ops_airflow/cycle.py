"""How a task gets its config and calls a stage: params → validated config → the stage function (config, …).

DAG tasks import their stage function (`mass_ops.stages.api`, `mass_ops.ops.api`) inside the task, so DAG files stay
fast to parse; operators name theirs. A stage's return
value goes to XCom, which carries ids and URIs only: anything that is not small JSON is refused loudly rather than
silently stuffed into Airflow's database.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mass_ops_airflow.hooks import MassArtifactHook, storage_from_connections

if TYPE_CHECKING:
    from mass_ops.config import CycleConfig

# Where stage functions and cycle operations are found by name (the operators name theirs: a serialized DAG keeps
# strings, not functions); tests/stages/test_registry.py checks every name an operator or DAG uses resolves here.
STAGES_MODULE = "mass_ops.stages.api"
OPS_MODULE = "mass_ops.ops.api"
XCOM_LIMIT_BYTES = 16 * 1024


class StageResultError(TypeError):
    """A stage returned something that cannot go to XCom (not JSON, or not small)."""


def cycle_config(params: Mapping[str, Any]) -> CycleConfig:
    """The run's config from its params, with storage from the Airflow connections when they are defined."""
    from mass_ops_airflow.params import build_config

    return build_config(params, storage=storage_from_connections())


def stage_function(name: str) -> Any:
    """`mass_ops.stages.api.<name>`, else `mass_ops.ops.api.<name>` (imported now, not at DAG parse time)."""
    for module_name in (STAGES_MODULE, OPS_MODULE):
        function = getattr(importlib.import_module(module_name), name, None)
        if callable(function):
            return function
    raise AttributeError(f"neither {STAGES_MODULE} nor {OPS_MODULE} has a stage function {name!r}")


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


def call_stage(stage: str | Callable[..., Any], config: CycleConfig, *args: Any, **kwargs: Any) -> Any:
    """Run one stage in this process, with the artifact connection's credentials exported for its duration. `stage`
    is the function itself (what DAG tasks pass) or its name (what operators keep: a serialized DAG holds strings)."""
    function = stage_function(stage) if isinstance(stage, str) else stage
    with MassArtifactHook().credentials_env():
        result = function(config, *args, **kwargs)
    return xcom_safe(function.__name__, result)


def run_stage(stage: str | Callable[..., Any], params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`call_stage` with the config rebuilt from the run's params (what every in-process task does)."""
    return call_stage(stage, cycle_config(params), *args, **kwargs)
