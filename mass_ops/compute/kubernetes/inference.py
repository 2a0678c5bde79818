"""The inference server: one vLLM Deployment and its ClusterIP Service per served model and scope (a cycle, or
nightly).

The inference image's entry point (`docker/inference/serve.sh`) reads the serving flags from `MASS_SERVE_*`; the
model comes read-only from the cache claim at `MODEL_MOUNT`. `inference_url` is the Service's in-cluster
OpenAI-compatible base URL; `current_serving_target` and `next_serving_target` name the models a cycle serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mass_ops.compute.kubernetes.common import (
    INSTANCE_LABEL,
    MODEL_MOUNT,
    SpecError,
    WorkloadSettings,
    _container_security,
    _gpu_resources,
    _gpu_scheduling,
    _model_cache_volume,
    _pod_base,
    _shm_volume,
    model_path,
    resource_name,
    workload_labels,
)
from mass_ops.config import CycleConfig


@dataclass(frozen=True)
class ServingTarget:
    """One model to serve: the name clients request and the model key in the cache."""

    served_name: str
    model_key: str

    def as_dict(self) -> dict[str, str]:
        return {"served_name": self.served_name, "model_key": self.model_key}


def generation_name(generation: int) -> str:
    """Name (and served name) of generation g of a lineage: `L<g>` (MASS_SPEC §2: cycle 2 serves L1 as "L1")."""
    return f"L{generation}"


def current_serving_target(config: CycleConfig) -> ServingTarget:
    """The model the cycle runs on: its served name, from the FP8 sibling of the BF16 parent (L1-bf16 → L1-fp8)."""
    parent = config.models.parent_bf16
    if not parent.endswith("-bf16"):
        raise SpecError(
            f"models.parent_bf16: {parent!r} must end in -bf16 so the served FP8 sibling (…-fp8) can be found"
        )
    return ServingTarget(config.models.served_name, parent.removesuffix("-bf16") + "-fp8")


def next_serving_target(config: CycleConfig) -> ServingTarget:
    """The model the cycle produces, served under its generation name (`L<g+1>`)."""
    return ServingTarget(generation_name(config.generation + 1), config.models.next_fp8)


def inference_name(scope: str, served_name: str) -> str:
    """Deployment and Service name of the server of `served_name` within `scope` (a cycle, or nightly)."""
    return resource_name("vllm", scope, served_name, max_length=55)


def inference_url(config: CycleConfig, scope: str, served_name: str) -> str:
    """In-cluster OpenAI-compatible base URL of that server."""
    name = inference_name(scope, served_name)
    k8s = config.compute.kubernetes
    return f"http://{name}.{k8s.namespace}.svc:{config.inference.server.port}/v1"


def _inference_selector(scope: str, served_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "mass-ops-inference", INSTANCE_LABEL: inference_name(scope, served_name)}


def inference_deployment(
    config: CycleConfig, settings: WorkloadSettings, target: ServingTarget, *, scope: str
) -> dict[str, Any]:
    """A one-replica vLLM Deployment serving `target` with the cycle's serving flags (MASS_SPEC §2)."""
    server = config.inference.server
    k8s = config.compute.kubernetes
    name = inference_name(scope, target.served_name)
    selector = _inference_selector(scope, target.served_name)
    labels = {**workload_labels(config, scope), **settings.labels_for("inference"), **selector}
    env = [
        {"name": "MASS_SERVE_MODEL", "value": model_path(target.model_key)},
        {"name": "MASS_SERVE_NAME", "value": target.served_name},
        {"name": "MASS_SERVE_HOST", "value": "0.0.0.0"},
        {"name": "MASS_SERVE_PORT", "value": str(server.port)},
        {"name": "MASS_SERVE_MAX_MODEL_LEN", "value": str(config.inference.context_window_tokens)},
        {"name": "MASS_SERVE_TOOL_CALL_PARSER", "value": server.tool_call_parser},
        {"name": "MASS_SERVE_REASONING_PARSER", "value": server.reasoning_parser},
        {"name": "MASS_SERVE_MAX_NUM_SEQS", "value": str(server.max_num_seqs)},
        {"name": "MASS_SERVE_GPU_MEMORY_UTILIZATION", "value": f"{server.gpu_memory_utilization:g}"},
        {"name": "MASS_SERVE_SCHEDULING_POLICY", "value": server.scheduling_policy},
        # vLLM, Triton and torch.compile write caches under HOME/XDG dirs: point them at a writable scratch volume.
        {"name": "HOME", "value": "/scratch"},
        {"name": "XDG_CACHE_HOME", "value": "/scratch/cache"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    # The FP8 export checked its weights against this split (export.tensor_parallel): serve with the same one.
    tensor_parallel = config.inference.effective_tensor_parallel_size
    if tensor_parallel > 1:
        env.append({"name": "MASS_SERVE_TENSOR_PARALLEL_SIZE", "value": str(tensor_parallel)})
    env += settings.secret_env("inference")
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container = {
        "name": "vllm",
        "image": k8s.image_inference,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": server.port, "protocol": "TCP"}],
        "env": env,
        "envFrom": settings.env_from(),
        "resources": _gpu_resources(config, server.gpus),
        "volumeMounts": [
            {"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # Loading 27B FP8 weights and compiling takes minutes: the startup probe allows the configured readiness
        # timeout before liveness may restart the container.
        "startupProbe": {
            **probe,
            "periodSeconds": 10,
            "failureThreshold": max(1, math.ceil(server.readiness_timeout_s / 10)),
        },
        "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 30, "failureThreshold": 5},
        "securityContext": _container_security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = {
        **_pod_base(config, settings),
        **_gpu_scheduling(config),
        "containers": [container],
        "volumes": [
            _model_cache_volume(config, read_only=True),
            _shm_volume(),
            {"name": "scratch", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
        "terminationGracePeriodSeconds": 60,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            # One GPU server at a time: a rolling update would need a second set of GPUs.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def inference_service(
    config: CycleConfig, settings: WorkloadSettings, target: ServingTarget, *, scope: str
) -> dict[str, Any]:
    """The ClusterIP Service in front of that Deployment (its DNS name is what `inference_url` returns)."""
    port = config.inference.server.port
    labels = {**workload_labels(config, scope), **settings.labels_for("inference")}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": inference_name(scope, target.served_name),
            "namespace": config.compute.kubernetes.namespace,
            "labels": labels,
        },
        "spec": {
            "type": "ClusterIP",
            "selector": _inference_selector(scope, target.served_name),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
