"""Fixtures of the plugin tests: Airflow's environment, a fake Kubernetes API, the chart's settings, metadata stores;
the stand-in stage module comes from `tests.support.airflow_fixtures` (helpers: `tests.support.airflow`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.airflow_env import HOST_VARIABLES  # noqa: F401 - first: Airflow's environment before its import
from tests.plugins.kube_fakes import FakeCluster
from tests.support.airflow import clear_host_settings
from tests.support.airflow_fixtures import stages

__all__ = ["chart_settings", "cluster", "cycle_store", "migrated_db", "stages"]


@pytest.fixture(autouse=True)
def _no_host_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_host_settings(monkeypatch)


@pytest.fixture
def cluster(monkeypatch) -> Iterator[FakeCluster]:
    """A fake namespace wired into every path the operators and triggers take to the Kubernetes API; after the test,
    every call made through `MassKubeHook` must have set a request timeout."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from mass_ops_airflow.kube import MassKubeHook

    fake = FakeCluster()
    for attribute, client in fake.hook_clients().items():
        monkeypatch.setattr(MassKubeHook, attribute, property(lambda self, client=client: client))
    monkeypatch.setattr(MassKubeHook, "_watcher", lambda self: fake.watcher())
    # The provider's pod operator reaches the API through KubernetesHook (patched the way its own tests do).
    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: fake.core))
    monkeypatch.setattr(KubernetesHook, "is_in_cluster", property(lambda self: False))
    monkeypatch.setattr(KubernetesHook, "get_namespace", lambda self: None)
    yield fake
    assert fake.untimed_calls() == [], "a MassKubeHook call without a request timeout"


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
