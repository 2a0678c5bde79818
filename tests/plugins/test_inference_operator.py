"""The inference-server operators: vLLM Deployment + Service, deferred readiness, cleanup on failure and kill."""

from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import TaskDeferred
from mass_ops_airflow.operators import InferenceServerOperator, InferenceServerTeardownOperator
from mass_ops_airflow.triggers import InferenceReadinessTrigger

from tests.support.airflow import task_context

K8S = {"preset": "paper", "compute_backend": "kubernetes"}


def deferred(operator, context) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(context)
    return caught.value


def test_kubernetes_up_creates_and_defers_to_readiness(cluster, chart_settings):
    operator = InferenceServerOperator(task_id="inference_up", serve="evaluation")
    deferral = deferred(operator, task_context(K8S))
    trigger = deferral.trigger
    assert isinstance(trigger, InferenceReadinessTrigger) and deferral.method_name == "execute_complete"
    deployments = sorted(cluster.objects["deployments"])
    assert deployments == sorted(cluster.objects["services"]) and len(deployments) == 2
    served = {s["served_name"] for s in trigger.servers}
    assert served == {"Qwen/Qwen3.6-27B-FP8", "L1"}
    assert all(s["endpoint"].startswith("http://vllm-paper-l0-") and ".mass-ops.svc:8001/v1" in s["endpoint"]
               for s in trigger.servers)  # fmt: skip
    assert trigger.api_key_env == "VLLM_API_KEY"
    assert trigger.kubernetes["selector"].startswith("app.kubernetes.io/component=inference,mass-ops/cycle=paper-L0")
    assert 1790 < trigger.deadline_ts - time.time() <= 1800
    env = cluster.objects["deployments"][deployments[0]]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert any(e["name"] == "VLLM_API_KEY" and "valueFrom" in e for e in env)


def test_ready_event_returns_the_servers(cluster, chart_settings):
    operator = InferenceServerOperator(task_id="inference_up")
    trigger = deferred(operator, task_context(K8S)).trigger
    event = {"status": "ready", "servers": trigger.servers, "cleanup": trigger.cleanup_spec}
    result = operator.execute_complete(task_context(K8S), event)
    assert result == {"backend": "kubernetes", "servers": trigger.servers}
    assert cluster.objects["deployments"], "a ready server stays up for the stages"


def test_readiness_timeout_fails_clearly_and_deletes_the_server(cluster, chart_settings):
    operator = InferenceServerOperator(task_id="inference_up")
    trigger = deferred(operator, task_context(K8S)).trigger
    event = {
        "status": "timeout",
        "message": "http://vllm…/v1: /health answered HTTP 503",
        "servers": trigger.servers,
        "cleanup": trigger.cleanup_spec,
    }
    with pytest.raises(RuntimeError) as caught:
        operator.execute_complete(task_context(K8S), event)
    assert str(caught.value) == (
        "inference server not ready within the readiness timeout (1800 s): http://vllm…/v1: /health answered HTTP 503"
    )
    assert set(cluster.terminating["deployments"]) == set(cluster.objects["deployments"])
    assert set(cluster.terminating["services"]) == set(cluster.objects["services"])


def test_retry_patches_the_existing_deployment(cluster, chart_settings):
    deferred(InferenceServerOperator(task_id="inference_up"), task_context(K8S))
    deferred(InferenceServerOperator(task_id="inference_up"), task_context({**K8S, "max_concurrent_requests": 2}))
    assert ("apps", "deployments", "patch") in cluster.calls
    assert [c for c in cluster.calls if c == ("", "services", "create")] == [("", "services", "create")]


def test_kill_while_starting_deletes(cluster, chart_settings):
    operator = InferenceServerOperator(task_id="inference_up")
    deferred(operator, task_context(K8S))
    operator.on_kill()
    assert set(cluster.terminating["deployments"]) == set(cluster.objects["deployments"]) != set()


def test_teardown_deletes_the_scope_and_waits(cluster, chart_settings):
    deferred(InferenceServerOperator(task_id="inference_up", serve="evaluation"), task_context(K8S))
    cluster.create("deployments", {"metadata": {"name": "someone-else", "labels": {"app": "x"}}, "spec": {}})
    result = InferenceServerTeardownOperator(task_id="inference_down").execute(task_context(K8S))
    assert len(result["deleted"]) == 4
    assert list(cluster.objects["deployments"]) == ["someone-else"] and not cluster.objects["services"]
    assert ("apps", "deployments", "watch") in cluster.calls, "teardown returns once the servers are gone"


def test_local_backend_calls_the_stages(stages, tmp_path):
    params = {"preset": "demo"}
    stages.results["inference_up"] = {"pid": 1}
    deferral = deferred(InferenceServerOperator(task_id="inference_up"), task_context(params))
    assert stages.names() == ["inference_up"]
    assert stages.calls[0][1][0].cycle_name == "demo-L0"
    assert deferral.trigger.servers == [{"endpoint": "http://127.0.0.1:8011/v1", "served_name": "mass-tiny-L0"}]
    assert deferral.trigger.cleanup_spec is None and deferral.trigger.kubernetes is None
    down = InferenceServerTeardownOperator(task_id="inference_down").execute(task_context(params))
    assert stages.names() == ["inference_up", "inference_down"] and down["backend"] == "local"


def test_a_local_server_the_stage_already_made_ready_needs_no_deferral(stages):
    from tests.compute.model_server_stub import serve_in_thread

    server = serve_in_thread("mass-tiny-L0")
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1"
        stages.results["inference_up"] = {"servers": [{"endpoint": endpoint, "served_name": "mass-tiny-L0"}]}
        result = InferenceServerOperator(task_id="inference_up").execute(task_context({"preset": "demo"}))
    finally:
        server.shutdown()
    assert result == {"backend": "local", "servers": [{"endpoint": endpoint, "served_name": "mass-tiny-L0"}]}


def test_local_server_that_never_gets_ready_is_stopped(stages):
    operator = InferenceServerOperator(task_id="inference_up")
    trigger = deferred(operator, task_context({"preset": "demo"})).trigger
    event = {"status": "timeout", "message": "/health did not answer", "servers": trigger.servers, "cleanup": None}
    with pytest.raises(RuntimeError, match=r"not ready within the readiness timeout \(300 s\): /health did not answer"):
        operator.execute_complete(task_context({"preset": "demo"}), event)
    assert stages.names() == ["inference_up", "inference_down"]
