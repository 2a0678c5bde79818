"""Fixtures of the plugin tests: Airflow's environment, a fake Kubernetes API, a stand-in stage module."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.plugins.airflow_env import HOST_VARIABLES  # first: sets up Airflow's environment before its import
from tests.plugins.kube_fakes import FakeCluster


@pytest.fixture(autouse=True)
def _no_host_settings(monkeypatch):
    for name in HOST_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cluster(monkeypatch) -> FakeCluster:
    """A fake namespace wired into every path the operators and triggers take to the Kubernetes API."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from mass_ops_airflow import kube

    fake = FakeCluster()
    monkeypatch.setattr(kube, "kubernetes_clients", lambda conn_id=None: fake.clients())
    monkeypatch.setattr(kube, "_watch_factory", fake.watcher)
    # The provider's pod operator reaches the API through KubernetesHook (patched the way its own tests do).
    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: fake.core))
    monkeypatch.setattr(KubernetesHook, "is_in_cluster", property(lambda self: False))
    monkeypatch.setattr(KubernetesHook, "get_namespace", lambda self: None)
    return fake


@pytest.fixture
def chart_settings(tmp_path, monkeypatch) -> Path:
    """The Helm chart's settings ConfigMap, mounted where the operators look for it (MASS_SETTINGS_DIR)."""
    from tests.deploy.chart_render import render_chart

    folder = tmp_path / "settings"
    folder.mkdir()
    for name, text in render_chart().one("ConfigMap", "mass-ops-settings")["data"].items():
        (folder / name).write_text(text)
    monkeypatch.setenv("MASS_SETTINGS_DIR", str(folder))
    return folder


def use_training_launcher(settings: Path, launcher: str) -> None:
    """Set the chart's `compute.kubernetes.training_launcher` (a deployment setting, never a trigger's)."""
    import yaml

    path = settings / "kubernetes.yaml"
    data = yaml.safe_load(path.read_text())
    data["compute"]["kubernetes"]["training_launcher"] = launcher
    path.write_text(yaml.safe_dump(data))


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


@pytest.fixture
def stages(monkeypatch) -> StageRecorder:
    import mass_ops.stages.api as real

    recorder = StageRecorder()
    # Binding an episode pod to its unit's request is real work the episode operator needs, not a stage under test.
    recorder.passthrough["bind_episode"] = real.bind_episode
    recorder.passthrough["next_cycle_overrides"] = real.next_cycle_overrides  # arithmetic on a config
    # The budget admission before a pod and the budget-stop check of an error read the real ledger (no stage runs).
    recorder.passthrough["admit_episode"] = real.admit_episode
    recorder.passthrough["budget_stop_message"] = real.budget_stop_message
    recorder.passthrough["lease_episode_pod"] = real.lease_episode_pod  # the in-flight lease as a pod is created
    recorder.passthrough["end_episode_pod_lease"] = real.end_episode_pod_lease  # ... and as it is gone unrecorded
    monkeypatch.setitem(sys.modules, "mass_ops.stages.api", recorder)
    import mass_ops.stages

    monkeypatch.setattr(mass_ops.stages, "api", recorder, raising=False)
    return recorder


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory) -> Path:
    """A SQLite metadata store migrated once per session; tests get copies."""
    from mass_ops.store import migrations

    path = tmp_path_factory.mktemp("meta") / "template.db"
    migrations.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def cycle_store(migrated_db, tmp_path, monkeypatch):
    """Factory: a fresh metadata store (MASS_METADATA_URL) holding the cycle that `params` describe."""

    def open_store(params: dict[str, Any]) -> Any:
        from mass_ops_airflow.params import build_config

        from mass_ops.store.repository import MetadataRepository

        path = tmp_path / "mass.db"
        shutil.copyfile(migrated_db, path)
        url = f"sqlite:///{path}"
        monkeypatch.setenv("MASS_METADATA_URL", url)
        monkeypatch.setenv("MASS_ARTIFACT_URL", str(tmp_path / "artifacts"))
        repository = MetadataRepository.from_url(url)
        config = build_config(params)
        cycle = repository.ensure_cycle(
            config.cycle_name, config.model_dump(mode="json", exclude={"storage"}), config.config_hash()
        )
        repository.cycle_id = cycle.id
        repository.config = config
        return repository

    return open_store


def task_context(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The parts of an Airflow context the operators read."""
    ti = mock.MagicMock(dag_id="mass_cycle", task_id="t", map_index=-1, try_number=1, run_id="manual__1")
    ti.xcom_push = mock.MagicMock()
    context = {"params": params, "ti": ti, "task_instance": ti, "run_id": "manual__1", "dag": mock.MagicMock()}
    context["dag"].parent_dag = None
    context.update(extra)
    return context
