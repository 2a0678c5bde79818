"""Helpers of the Airflow-side tests (DAGs, operators): a stand-in stage API that records calls, the parts of an
Airflow context operators read, clearing the host's settings and choosing the chart's training launcher. The
fixtures built from them live in `tests.support.airflow_fixtures`.

Importing this module sets up Airflow's throw-away environment first (`tests.plugins.airflow_env`).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.plugins.airflow_env import HOST_VARIABLES  # first: sets up Airflow's environment before its import


class StageRecorder(types.ModuleType):
    """A stand-in `mass_ops.stages.api`: every stage records (name, args) and returns what the test scripted."""

    def __init__(self) -> None:
        super().__init__("mass_ops.stages.api")
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results: dict[str, Any] = {}
        self.passthrough: dict[str, Any] = {}  # real stage functions, called and not recorded

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.passthrough:
            return self.passthrough[name]

        def stage(config: Any, *args: Any) -> Any:
            self.calls.append((name, (config, *args)))
            result = self.results.get(name, {"stage": name})
            return result(config, *args) if callable(result) else result

        return stage

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def install_stage_recorder(monkeypatch: pytest.MonkeyPatch) -> StageRecorder:
    """Put a `StageRecorder` in place of `mass_ops.stages.api` and `mass_ops.ops.api` for one test; what is not a
    stage under test (binding a pod to its unit, config arithmetic, budget and lease bookkeeping) passes through to
    the real functions."""
    import mass_ops.ops.api as real_ops
    import mass_ops.stages.api as real

    recorder = StageRecorder()
    recorder.passthrough["bind_episode"] = real.bind_episode
    recorder.passthrough["budget_stop_message"] = real.budget_stop_message
    recorder.passthrough["next_cycle_overrides"] = real_ops.next_cycle_overrides
    recorder.passthrough["admit_episode"] = real_ops.admit_episode
    recorder.passthrough["lease_episode_pod"] = real_ops.lease_episode_pod
    recorder.passthrough["end_episode_pod_lease"] = real_ops.end_episode_pod_lease
    import mass_ops.ops
    import mass_ops.stages

    for name, package in (("mass_ops.stages.api", mass_ops.stages), ("mass_ops.ops.api", mass_ops.ops)):
        monkeypatch.setitem(sys.modules, name, recorder)
        monkeypatch.setattr(package, "api", recorder, raising=False)
    return recorder


def clear_host_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset this machine's variables that could point the operators at its cluster settings or storage."""
    for name in HOST_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def task_context(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The parts of an Airflow context the operators read."""
    ti = mock.MagicMock(dag_id="mass_cycle", task_id="t", map_index=-1, try_number=1, run_id="manual__1")
    ti.xcom_push = mock.MagicMock()
    context = {"params": params, "ti": ti, "task_instance": ti, "run_id": "manual__1", "dag": mock.MagicMock()}
    context["dag"].parent_dag = None
    context.update(extra)
    return context


def use_training_launcher(settings: Path, launcher: str) -> None:
    """Set `compute.kubernetes.training_launcher` in the chart settings folder `settings` (a deployment setting,
    never a trigger's)."""
    import yaml

    path = settings / "kubernetes.yaml"
    data = yaml.safe_load(path.read_text())
    data["compute"]["kubernetes"]["training_launcher"] = launcher
    path.write_text(yaml.safe_dump(data))
