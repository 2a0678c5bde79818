"""The compute backend protocol: `backend_for` picks the implementation; the local backend serves and runs here, the
Kubernetes backend returns the manifests its operators launch and refuses what only a pod does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mass_ops.compute import kubernetes as specs
from mass_ops.compute.backend import (
    ComputeBackend,
    KubernetesBackend,
    LaunchedByOperator,
    LocalBackend,
    ModelRequest,
    backend_for,
    to_launch,
)
from mass_ops.config import load_config
from tests.compute.test_kubernetes_specs import EPISODES
from tests.compute.test_local import free_port, stub_argv

EPISODE = EPISODES[0]  # bound to its request, as the operators bind it


@pytest.fixture(scope="module")
def cluster():
    return load_config("paper", ["compute.backend=kubernetes"])


@pytest.fixture(scope="module")
def laptop():
    return load_config("demo", [])


@pytest.fixture(autouse=True)
def default_settings(monkeypatch):
    monkeypatch.delenv(specs.SETTINGS_DIR_ENV, raising=False)
    monkeypatch.setattr(specs.common, "DEFAULT_SETTINGS_DIR", "/nonexistent/mass-ops-settings")


def test_backend_for_names_the_configured_backend(cluster, laptop):
    local, kube = backend_for(laptop), backend_for(cluster)
    assert isinstance(local, LocalBackend) and local.name == "local" and local.runs_in_process
    assert isinstance(kube, KubernetesBackend) and kube.name == "kubernetes" and not kube.runs_in_process
    checked: list[ComputeBackend] = [local, kube]  # both satisfy the protocol (mypy checks this line)
    assert len(checked) == 2


def test_the_local_backend_launches_nothing(laptop):
    backend = LocalBackend()
    targets = [specs.ServingTarget("L1", "models/L1-fp8")]
    assert backend.model_workloads(laptop, targets, "c") is None
    assert backend.model_selector(laptop, "c") is None
    assert backend.episode_pod(laptop, EPISODE) is None
    assert backend.job_workload(laptop, "train") is None
    assert backend.launch_delay_s(laptop) == 0.0 and backend.cpu_possible


def test_the_kubernetes_backend_returns_the_specs_its_operators_launch(cluster):
    backend = KubernetesBackend()
    settings = specs.load_workload_settings()
    target = specs.current_serving_target(cluster)
    [workload] = backend.model_workloads(cluster, [target], "c") or []
    assert workload.deployment == specs.inference_deployment(cluster, settings, target, scope="c")
    assert workload.service == specs.inference_service(cluster, settings, target, scope="c")
    assert workload.endpoint == specs.inference_url(cluster, "c", target.served_name)
    assert backend.model_selector(cluster, "c") == specs.scope_selector(cluster, "c", settings.labels_for("inference"))
    assert backend.episode_pod(cluster, EPISODE) == specs.episode_pod(cluster, settings, EPISODE)
    export = backend.job_workload(cluster, "export")
    assert export is not None and export.kind == "Job"
    assert export.manifest == specs.training_job(cluster, settings, role="export")
    assert export.service == specs.rendezvous_service(cluster, settings, role="export")
    assert export.name == specs.job_name(cluster, "export")
    assert backend.launch_delay_s(cluster) == cluster.compute.kubernetes.startup_timeout_s
    assert not backend.cpu_possible


def test_trainjob_launcher_gives_a_trainjob_without_a_service(cluster):
    config = cluster.model_copy(
        update={
            "compute": cluster.compute.model_copy(
                update={"kubernetes": cluster.compute.kubernetes.model_copy(update={"training_launcher": "trainjob"})}
            )
        }
    )
    workload = KubernetesBackend().job_workload(config, "train")
    assert workload is not None and workload.kind == "TrainJob" and workload.service is None
    assert workload.manifest == specs.training_trainjob(config, specs.load_workload_settings())


def test_what_only_a_pod_does_is_refused_on_kubernetes(cluster, tmp_path):
    backend = KubernetesBackend()
    request = ModelRequest("m", "m", cluster.inference.endpoint, tmp_path / "s.json", port=8000)
    with pytest.raises(LaunchedByOperator, match="inference-server operator"):
        backend.start_model(cluster, request)
    with pytest.raises(LaunchedByOperator, match="pod"):
        backend.run_job(["true"])
    assert backend.stop_model(tmp_path / "s.json") is False
    with pytest.raises(LaunchedByOperator, match="nothing to launch"):
        to_launch(LocalBackend().episode_pod(cluster, EPISODE), "episode")


def test_serving_update_says_what_the_backends_server_supports(cluster, laptop):
    local = LocalBackend().serving_update(
        laptop.model_copy(update={"inference": laptop.inference.model_copy(update={"backend": "vllm"})})
    )
    assert local["backend"] == "openai-compatible" and local["server"].scheduling_policy == "fcfs"
    assert KubernetesBackend().serving_update(cluster) == {}


def test_locate_model(cluster, laptop, tmp_path):
    state_file = tmp_path / "L1.json"
    assert LocalBackend().locate_model(laptop, scope="s", served_name="L1", state_file=state_file) is None
    found = KubernetesBackend().locate_model(cluster, scope="s", served_name="L1", state_file=state_file)
    assert found is not None and found.endpoint == specs.inference_url(cluster, "s", "L1") and found.pid is None


def test_local_backend_serves_reuses_and_stops_a_model(laptop, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(
        "mass_ops.compute.local.transformers_serve_argv",
        lambda model, *, port, host="127.0.0.1", extra=(): stub_argv(port, model),
    )
    backend = LocalBackend()
    state_file = tmp_path / "servers" / "m.json"
    request = ModelRequest("tiny", "tiny", f"http://127.0.0.1:{port}/v1", state_file, port=port)
    try:
        server = backend.start_model(laptop, request)
        backend.wait_ready(laptop, server)
        assert server.endpoint == request.endpoint and server.pid is not None
        assert backend.start_model(laptop, request).pid == server.pid  # same argv: reused
        located = backend.locate_model(laptop, scope="s", served_name="x", state_file=state_file)
        assert located == server
        # `served_name` reuse: the recorded server is found whatever port the request would pick.
        other = ModelRequest("tiny", "tiny", "http://127.0.0.1:1/v1", state_file, reuse="served_name")
        assert backend.start_model(laptop, other).pid == server.pid
    finally:
        assert backend.stop_model(state_file) is True
    assert not state_file.exists()


def test_local_backend_runs_a_job_as_a_supervised_process(tmp_path):
    result = LocalBackend().run_job([sys.executable, "-c", "print('done')"], cwd=Path(tmp_path))
    assert result.returncode == 0 and result.tail == "done"


def test_only_kubernetes_decides_the_in_loop_endpoint():
    from mass_ops.compute.kubernetes import inference_url
    from mass_ops.config import load_config

    local = load_config("demo", environ={})
    cluster = load_config("paper", ["compute.backend=kubernetes"], environ={})
    assert backend_for(local).in_loop_endpoint(local) is None
    expected = inference_url(cluster, cluster.cycle_name, cluster.models.served_name)
    assert backend_for(cluster).in_loop_endpoint(cluster) == expected
