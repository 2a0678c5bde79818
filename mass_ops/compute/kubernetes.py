"""Manifests of the workloads a cycle starts on Kubernetes, as plain dicts.

Pure functions of the cycle config and the cluster's `WorkloadSettings` (what the Helm chart's settings ConfigMap
says: the workload service account, the labels its NetworkPolicy selects, the env ConfigMap and which Secret feeds
which variable of which workload). Nothing here talks to a cluster; the Airflow operators create these objects.

Contracts with the images:
- every pod gets the cycle config (without `storage`, which may hold credentials) as a pod annotation exposed as the
  file `CONFIG_FILE` through a downward-API volume, so commands take `--config CONFIG_FILE` and no ConfigMap has to
  be created per run;
- the model cache claim is mounted at `MODEL_MOUNT`; a model key such as `models/L1-fp8` lives at `/models/L1-fp8`;
- episode pods run two containers sharing the emptyDir `HANDOFF_MOUNT`: `base` runs `mass-ops episode run --config
  CONFIG_FILE --kind K --task T --seed S [...] --condition C --prompt-file HANDOFF_MOUNT/prompt.txt --handoff
  HANDOFF_MOUNT` with no secret at all, and `publisher` runs `mass-ops episode publish --config CONFIG_FILE
  --handoff HANDOFF_MOUNT --prompt-uri URI --prompt-sha256 H` with the store and database credentials: it fetches
  the prompt the operator stored (and a benchmark task's workspace seed, `--workspace-seed-uri U
  --workspace-seed-sha256 H` on both containers), checks its hash and writes it into the folder before the sandbox
  reads it
  (`mass_ops.runtime.handoff`; why two containers and not a native sidecar: `episode_pod`). The inference key
  lives in a third container, the native sidecar `proxy`, which runs the episode's logging proxy
  (`python -m mass_ops.runtime.proxy --sessions-dir PROXY_LOG_MOUNT ...`) on 127.0.0.1:`proxy_port` and writes one
  log per attempt into an emptyDir the sandbox mounts read-only;
- training and export Jobs run `mass-ops stage train|export --config CONFIG_FILE` with the launch topology in the
  environment (`NNODES`, `NPROC_PER_NODE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`); node rank = the indexed
  Job's completion index; rendezvous goes through a headless Service named like the Job, whose node-0 name the Job
  sets as `MASTER_ADDR`. With `compute.kubernetes.training_launcher: trainjob` training is a Kubeflow Trainer v2
  TrainJob instead (`training_trainjob`), whose torch runtime sets the `PET_*` topology itself;
- the inference image's entry point (`docker/inference/serve.sh`) reads the serving flags from `MASS_SERVE_*`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import yaml

from mass_ops.config import CycleConfig
from mass_ops.critical_path import episode_server_priority
from mass_ops.errors import InputError
from mass_ops.layout import BENCHMARK_TASK_NAME, HANDOFF_PROMPT_FILE, EpisodeKind, EpisodeUnit

CONFIG_ANNOTATION = "mass-ops/cycle-config"
CONFIG_MOUNT = "/etc/mass-ops/cycle"
CONFIG_FILE = f"{CONFIG_MOUNT}/config.json"
MODEL_MOUNT = "/models"
RUNTIME_UID = 10001  # the unprivileged user of the episode, trainer and inference images
HANDOFF_MOUNT = "/handoff"  # the emptyDir an episode's sandbox and publisher containers share
PUBLISHER_CONTAINER = "publisher"
PROXY_CONTAINER = "proxy"
PROXY_LOG_MOUNT = "/proxy-logs"  # the episode proxy's session logs: written by the proxy, read by the sandbox
PROXY_READY_FILE = f"{PROXY_LOG_MOUNT}/proxy.port"  # written by the proxy once it listens: its startup probe
# What the sandbox container is told about the proxy beside it (`mass_ops.runtime.runner` reads these).
PROXY_URL_ENV = "MASS_EPISODE_PROXY_URL"
PROXY_LOG_DIR_ENV = "MASS_EPISODE_PROXY_LOG_DIR"
# mass-ops' own interpreter in the episode image (docker/episode/Dockerfile: a venv apart from the agent's python).
EPISODE_IMAGE_PYTHON = "/opt/mass-ops/bin/python"
MASTER_PORT = 29500
SETTINGS_DIR_ENV = "MASS_SETTINGS_DIR"
DEFAULT_SETTINGS_DIR = "/etc/mass-ops/settings"
PART_OF = {"app.kubernetes.io/part-of": "mass-ops", "app.kubernetes.io/managed-by": "mass-ops-airflow"}
INSTANCE_LABEL = "app.kubernetes.io/instance"
CYCLE_LABEL = "mass-ops/cycle"
SCOPE_LABEL = "mass-ops/scope"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
TRAINING_GRACE_S = 120
# Kubeflow Trainer v2 (facts from its v2.2/v2.3 API): TrainJobs live in trainer.kubeflow.org/v1alpha1; the torch
# runtimes name their trainer job and container `node`; JobSet labels every pod with the TrainJob's name; a runtime
# patch names its manager as a domain-prefixed path.
TRAINJOB_GROUP = "trainer.kubeflow.org"
TRAINJOB_VERSION = "v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
TRAINJOB_NODE = "node"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
TRAINJOB_PATCH_MANAGER = "mass-ops.io/launcher"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# Defaults of the chart installed as release `mass-ops` (helm/mass-ops/templates/configmap-settings.yaml).
DEFAULT_LABELS: dict[str, dict[str, str]] = {
    "episode": {"app.kubernetes.io/component": "episode", "mass-ops/role": "episode"},
    "inference": {"app.kubernetes.io/component": "inference"},
    "training": {"app.kubernetes.io/component": "training"},
}
# `proxy` receives the inference key (in the episode pod's proxy container); `episode` is that consumer's name in
# charts before the key left the sandbox, and is read the same way.
Consumer = Literal["episode", "proxy", "publisher", "inference", "training", "airflow"]

_NAME_CHARS = re.compile(r"[^a-z0-9-]+")
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_QUANTITY_FACTORS = {
    None: 1,
    "m": 1e-3,
    **{suffix: 1000**power for power, suffix in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
    **{suffix: 1024**power for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
}


class SpecError(InputError):
    """A workload that cannot be described: the message names the setting and why."""


# --------------------------------------------------------------------------------------------------------------------
# Cluster settings (from the chart)


@dataclass(frozen=True)
class SecretRef:
    """One environment variable fed from a Secret, and the workloads allowed to receive it."""

    env: str
    secret_name: str
    key: str
    optional: bool = False
    consumers: tuple[str, ...] = ()

    def env_var(self) -> dict[str, Any]:
        """The container `env` entry (a secretKeyRef: the value never appears in the manifest)."""
        ref = {"name": self.secret_name, "key": self.key, "optional": self.optional}
        return {"name": self.env, "valueFrom": {"secretKeyRef": ref}}


def quantity_value(text: str, what: str) -> float:
    """A Kubernetes resource quantity (`2Gi`, `500M`, `250m`) as a number; SpecError naming `what` otherwise."""
    match = _QUANTITY.fullmatch(str(text))
    if match is None:
        raise SpecError(f"workload settings: {what} {text!r} is not a Kubernetes quantity (e.g. 8Gi)")
    return float(match.group(1)) * _QUANTITY_FACTORS[match.group(2)]


@dataclass(frozen=True)
class DiskBudget:
    """A container's `ephemeral-storage` request and limit (its writable layer and logs; the kubelet also evicts
    the pod when all its emptyDirs together exceed the sum of its containers' limits)."""

    request: str
    limit: str

    def check(self, what: str) -> None:
        if quantity_value(self.request, f"{what}.request") > quantity_value(self.limit, f"{what}.limit"):
            raise SpecError(f"workload settings: {what}: request {self.request} exceeds limit {self.limit}")


# Safe defaults when the chart says nothing: room for an agent's uv environments, never a whole node's disk.
DEFAULT_EPISODE_VOLUME_LIMITS: dict[str, str] = {
    "workspace": "8Gi",
    "home": "8Gi",
    "tmp": "4Gi",
    "handoff": "12Gi",  # every attempt's workspace tarball and logs until the publisher has them
    "publisher-tmp": "1Gi",
    "proxy-logs": "2Gi",
}


@dataclass(frozen=True)
class EpisodeLimits:
    """Disk and proxy limits of an episode pod (chart values `episode.ephemeralStorage`, `episode.volumeSizeLimits`,
    `episode.publisher.ephemeralStorage`, `episode.proxy`): every container has an ephemeral-storage request and
    limit, and every emptyDir a `sizeLimit`, so an agent cannot fill its node's disk."""

    sandbox_storage: DiskBudget = DiskBudget("2Gi", "24Gi")
    publisher_storage: DiskBudget = DiskBudget("256Mi", "2Gi")
    proxy_storage: DiskBudget = DiskBudget("64Mi", "1Gi")
    volume_size_limits: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_EPISODE_VOLUME_LIMITS))
    proxy_cpu: str = "500m"
    proxy_memory: str = "512Mi"
    proxy_port: int = 8470

    def __post_init__(self) -> None:
        for name, budget in (
            ("episode.ephemeralStorage", self.sandbox_storage),
            ("episode.publisher.ephemeralStorage", self.publisher_storage),
            ("episode.proxy.ephemeralStorage", self.proxy_storage),
        ):
            budget.check(name)
        unknown = sorted(set(self.volume_size_limits) - set(DEFAULT_EPISODE_VOLUME_LIMITS))
        if unknown:
            raise SpecError(f"workload settings: episode.volumeSizeLimits has unknown volumes {unknown}")
        for volume, size in self.volume_size_limits.items():
            quantity_value(size, f"episode.volumeSizeLimits.{volume}")
        quantity_value(self.proxy_cpu, "episode.proxy.cpu")
        quantity_value(self.proxy_memory, "episode.proxy.memory")
        if not 1024 <= self.proxy_port <= 65535:
            raise SpecError(f"workload settings: episode.proxy.port {self.proxy_port} is not in 1024-65535")

    def size_limit(self, volume: str) -> str:
        """The volume's sizeLimit: the configured one, else the default."""
        return self.volume_size_limits.get(volume, DEFAULT_EPISODE_VOLUME_LIMITS[volume])


@dataclass(frozen=True)
class WorkloadSettings:
    """What the Helm chart tells the operators about the namespace (its settings ConfigMap)."""

    service_account: str = "mass-ops-workload"
    labels: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: DEFAULT_LABELS)
    env_config_map: str | None = "mass-ops-env"
    secret_refs: tuple[SecretRef, ...] = ()
    episode_limits: EpisodeLimits = field(default_factory=EpisodeLimits)

    def labels_for(self, role: Literal["episode", "inference", "training"]) -> dict[str, str]:
        """The labels the chart's NetworkPolicy and settings expect on pods of `role`."""
        if role not in self.labels:
            raise SpecError(f"workload settings: labels has no entry for {role!r}")
        return dict(self.labels[role])

    def secret_env(self, consumer: Consumer) -> list[dict[str, Any]]:
        """Env entries of every Secret-fed variable `consumer` may receive (least privilege: nothing else)."""
        return [ref.env_var() for ref in sorted(self.secret_refs, key=lambda r: r.env) if consumer in ref.consumers]

    def env_from(self) -> list[dict[str, Any]]:
        """`envFrom` of the non-secret environment ConfigMap (MASS_ARTIFACT_URL, region)."""
        return [{"configMapRef": {"name": self.env_config_map}}] if self.env_config_map else []


def settings_dir() -> Path | None:
    """The mounted settings folder: `$MASS_SETTINGS_DIR`, else /etc/mass-ops/settings when it exists."""
    configured = os.environ.get(SETTINGS_DIR_ENV)
    if configured:
        return Path(configured)
    default = Path(DEFAULT_SETTINGS_DIR)
    return default if default.is_dir() else None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"workload settings: cannot read {path}: {exc}") from None


def load_workload_settings(directory: str | Path | None = None) -> WorkloadSettings:
    """Read `workloads.yaml` and `secret-refs.yaml` from the chart's settings folder; defaults when absent."""
    folder = Path(directory) if directory is not None else settings_dir()
    if folder is None:
        return WorkloadSettings()
    workloads_path, refs_path = folder / "workloads.yaml", folder / "secret-refs.yaml"
    workloads = _read_yaml(workloads_path) if workloads_path.is_file() else {}
    refs = _read_yaml(refs_path) if refs_path.is_file() else {}
    if not isinstance(workloads, dict) or not isinstance(refs, dict):
        raise SpecError(f"workload settings: {folder}: workloads.yaml and secret-refs.yaml must hold mappings")
    secret_refs = []
    for env, ref in sorted(refs.items()):
        if not _ENV_NAME.match(str(env)) or not isinstance(ref, dict):
            raise SpecError(f"workload settings: {refs_path}: entry {env!r} is not NAME: {{secretName, key, ...}}")
        try:
            secret_refs.append(
                SecretRef(
                    env=str(env),
                    secret_name=str(ref["secretName"]),
                    key=str(ref["key"]),
                    optional=bool(ref.get("optional", False)),
                    consumers=tuple(ref.get("consumers") or ()),
                )
            )
        except KeyError as exc:
            raise SpecError(f"workload settings: {refs_path}: {env} lacks {exc.args[0]}") from None
    defaults = WorkloadSettings()
    return WorkloadSettings(
        service_account=str(workloads.get("serviceAccountName") or defaults.service_account),
        labels={role: dict(labels) for role, labels in (workloads.get("labels") or DEFAULT_LABELS).items()},
        env_config_map=workloads.get("envFromConfigMap", defaults.env_config_map),
        secret_refs=tuple(secret_refs),
        episode_limits=_episode_limits(workloads.get("episodeLimits"), workloads_path),
    )


def _episode_limits(data: Any, path: Path) -> EpisodeLimits:
    """`workloads.yaml`'s `episodeLimits` (the chart's `episode` values); the defaults for what it leaves out."""
    if data is None:
        return EpisodeLimits()
    if not isinstance(data, dict):
        raise SpecError(f"workload settings: {path}: episodeLimits must be a mapping")
    defaults = EpisodeLimits()

    def budget(key: str, default: DiskBudget) -> DiskBudget:
        value = data.get(key) or {}
        if not isinstance(value, dict):
            raise SpecError(f"workload settings: {path}: episodeLimits.{key} must be {{request, limit}}")
        return DiskBudget(str(value.get("request", default.request)), str(value.get("limit", default.limit)))

    sizes = data.get("volumeSizeLimits") or {}
    if not isinstance(sizes, dict):
        raise SpecError(f"workload settings: {path}: episodeLimits.volumeSizeLimits must be a mapping")
    try:
        port = int(data.get("proxyPort", defaults.proxy_port))
    except (TypeError, ValueError):
        raise SpecError(f"workload settings: {path}: episodeLimits.proxyPort must be a port number") from None
    return EpisodeLimits(
        sandbox_storage=budget("sandboxStorage", defaults.sandbox_storage),
        publisher_storage=budget("publisherStorage", defaults.publisher_storage),
        proxy_storage=budget("proxyStorage", defaults.proxy_storage),
        volume_size_limits={**DEFAULT_EPISODE_VOLUME_LIMITS, **{str(k): str(v) for k, v in sizes.items()}},
        proxy_cpu=str(data.get("proxyCpu", defaults.proxy_cpu)),
        proxy_memory=str(data.get("proxyMemory", defaults.proxy_memory)),
        proxy_port=port,
    )


# --------------------------------------------------------------------------------------------------------------------
# Names, labels, config document


def resource_name(*parts: object, max_length: int = 63) -> str:
    """A DNS-1035 label built from `parts` (lowercase, '-' joined); too long → truncated plus a stable hash."""
    raw = "-".join(str(p) for p in parts if str(p))
    name = _NAME_CHARS.sub("-", raw.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name or not name[0].isalpha():
        name = f"m-{name}".rstrip("-")
    if len(name) > max_length:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = f"{name[: max_length - 9].rstrip('-')}-{digest}"
    return name


def label_value(value: object) -> str:
    """A valid label value (≤ 63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    text = _LABEL_CHARS.sub("-", str(value))[:63].strip("-._")
    return text


def workload_labels(config: CycleConfig, scope: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Labels every object of a cycle carries: part-of/managed-by, the cycle and the scope (cycle or nightly)."""
    labels = {**PART_OF, CYCLE_LABEL: label_value(config.cycle_name), SCOPE_LABEL: label_value(scope)}
    labels.update(extra or {})
    return labels


def config_document(config: CycleConfig) -> str:
    """The config as pods receive it: canonical JSON without `storage` (URLs there may carry credentials; pods get
    their storage from MASS_ARTIFACT_URL / MASS_METADATA_URL in their environment)."""
    return json.dumps(config.model_dump(mode="json", exclude={"storage"}), sort_keys=True, separators=(",", ":"))


def _config_volume() -> dict[str, Any]:
    item = {"path": "config.json", "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}}
    return {"name": "cycle-config", "downwardAPI": {"items": [item]}}


def _config_mount() -> dict[str, Any]:
    return {"name": "cycle-config", "mountPath": CONFIG_MOUNT, "readOnly": True}


def _pod_security(config: CycleConfig) -> dict[str, Any]:
    del config
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _store_client_container(
    name: str, command: list[str], config: CycleConfig, settings: WorkloadSettings, work_mount: dict[str, Any]
) -> dict[str, Any]:
    """A container of an episode or grader pod that holds the store credentials (the publisher role) and nothing
    else: the episode image running `command`, read-only root, /tmp on its own volume, `work_mount` shared with
    the sandbox or grader."""
    k8s, limits = config.compute.kubernetes, settings.episode_limits
    return {
        "name": name,
        "image": k8s.image_episode,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "TMPDIR", "value": "/tmp"},
            *settings.secret_env("publisher"),
        ],
        "envFrom": settings.env_from(),
        "resources": _resources(k8s.publisher_cpu, k8s.publisher_memory, limits.publisher_storage),
        "volumeMounts": [_config_mount(), work_mount, {"name": "publisher-tmp", "mountPath": "/tmp"}],
        "securityContext": _container_security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _container_security(*, read_only_root: bool) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_base(config: CycleConfig, settings: WorkloadSettings) -> dict[str, Any]:
    """Fields every workload pod shares: the token-less workload account, no service links, non-root."""
    return {
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,
        # Service links would inject e.g. VLLM_PORT for a Service named vllm, which vLLM misreads as its own setting.
        "enableServiceLinks": False,
        "securityContext": _pod_security(config),
    }


def _gpu_scheduling(config: CycleConfig) -> dict[str, Any]:
    k8s = config.compute.kubernetes
    spec: dict[str, Any] = {}
    if k8s.gpu_node_selector:
        spec["nodeSelector"] = dict(k8s.gpu_node_selector)
    if k8s.gpu_tolerations:
        spec["tolerations"] = [dict(t) for t in k8s.gpu_tolerations]
    return spec


def _gpu_resources(config: CycleConfig, count: int) -> dict[str, Any]:
    gpu = config.compute.kubernetes.gpu_resource
    return {"requests": {gpu: str(count)}, "limits": {gpu: str(count)}}


def _shm_volume(size_limit: str | None = None) -> dict[str, Any]:
    # NCCL and vLLM's workers exchange tensors through /dev/shm; the container runtime's default is 64 MiB.
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if size_limit:
        empty_dir["sizeLimit"] = size_limit
    return {"name": "dshm", "emptyDir": empty_dir}


def _model_cache_volume(config: CycleConfig, *, read_only: bool) -> dict[str, Any]:
    claim = {"claimName": config.compute.kubernetes.model_cache_pvc, "readOnly": read_only}
    return {"name": "model-cache", "persistentVolumeClaim": claim}


def model_path(key: str) -> str:
    """Where model `key` (e.g. `models/L1-fp8`) lives inside a pod: `/models/L1-fp8`."""
    if "://" in key or key.startswith("/"):
        raise SpecError(
            f"models: {key!r} is not a key in the model cache; Kubernetes workloads read models from the claim "
            f"mounted at {MODEL_MOUNT} (use a relative key such as models/L1-fp8)"
        )
    parts = [p for p in key.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise SpecError(f"models: {key!r} is not a valid model key")
    if parts[0] == "models" and len(parts) > 1:
        parts = parts[1:]
    return "/".join([MODEL_MOUNT, *parts])


# --------------------------------------------------------------------------------------------------------------------
# Inference server (vLLM)


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


# --------------------------------------------------------------------------------------------------------------------
# Episode pods


class UnitRequest(Protocol):
    """What an episode spec binds to: the unit, condition and prompt hash of the request its stage runs (an
    `EpisodeRequest` of the runtime; compute sits below the runtime, so it names only the fields it reads)."""

    @property
    def unit(self) -> EpisodeUnit: ...

    @property
    def condition(self) -> str: ...

    @property
    def prompt_sha256(self) -> str: ...


@dataclass(frozen=True)
class EpisodeSpec:
    """Which episode a pod runs: its identity (kind, task, version / candidate / replicate, generation) and, once
    bound to the request its stage runs (`bound`), that request's seed, condition and prompt — the prompt as the
    URI of the artifact the publisher fetches and its SHA-256, which the publisher checks.

    An identity alone names the unit (slug, labels, the post-check); only a bound spec can become a pod.
    """

    kind: EpisodeKind
    task_id: int | str  # a catalogue task id, or a benchmark task's name (`tb2_hello-world`, `swe_<instance>`)
    version: int | None = None
    candidate: int | None = None
    replicate: int | None = None
    generation: str | None = None
    seed: int | None = None
    condition: str | None = None
    prompt_uri: str | None = None
    prompt_sha256: str | None = None
    # A benchmark task's starting files (its request's `workspace_seed`): the publisher fetches the artifact into the
    # hand-off folder, checked against the SHA-256, before the sandbox starts; the sandbox's runner extracts it.
    workspace_seed_uri: str | None = None
    workspace_seed_sha256: str | None = None

    def __post_init__(self) -> None:
        needs = {"search": "version", "collection": "candidate", "rollout": "replicate", "benchmark": "candidate"}
        wanted = needs.get(self.kind)
        if wanted and getattr(self, wanted) is None:
            raise SpecError(f"episode: a {self.kind} episode needs {wanted}")
        if self.kind == "benchmark":
            # A benchmark task is named, not numbered; its unit keeps the trial in `candidate` (scoring's requests).
            if not isinstance(self.task_id, str) or not BENCHMARK_TASK_NAME.fullmatch(self.task_id):
                raise SpecError(f"episode: benchmark task {self.task_id!r} is not a benchmark task name")
            if not self.generation:
                raise SpecError(f"episode: benchmark task {self.task_id} needs the generation it runs")
        elif isinstance(self.task_id, bool) or not isinstance(self.task_id, int) or self.task_id <= 0:
            raise SpecError(f"episode: task_id must be a positive whole number (got {self.task_id!r})")
        run = (self.seed, self.condition, self.prompt_uri, self.prompt_sha256)
        if any(value is not None for value in run) and any(value is None for value in run):
            raise SpecError(f"episode {self.slug}: seed, condition, prompt_uri and prompt_sha256 come together")
        if self.seed is not None and self.seed < 0:
            raise SpecError(f"episode {self.slug}: seed must be non-negative (got {self.seed})")
        if self.prompt_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.prompt_sha256):
            raise SpecError(f"episode {self.slug}: prompt_sha256 {self.prompt_sha256!r} is not a hex SHA-256")
        seed = (self.workspace_seed_uri, self.workspace_seed_sha256)
        if (seed[0] is None) != (seed[1] is None) or (seed[0] is not None and self.seed is None):
            raise SpecError(f"episode {self.slug}: a workspace seed's URI and SHA-256 come together, on a bound spec")
        if seed[0] is not None and self.kind != "benchmark":
            raise SpecError(f"episode {self.slug}: only a benchmark episode starts from a workspace seed")
        if seed[1] is not None and not re.fullmatch(r"[0-9a-f]{64}", seed[1]):
            raise SpecError(f"episode {self.slug}: workspace_seed_sha256 {seed[1]!r} is not a hex SHA-256")

    @property
    def unit_candidate(self) -> int | None:
        """The unit's `candidate` slot: a collection candidate, or a rollout's replicate (rollouts keep it there)."""
        return self.replicate if self.kind == "rollout" else self.candidate

    def bound(self, request: UnitRequest, prompt_uri: str) -> EpisodeSpec:
        """This identity with the seed, condition and prompt of `request` (what its stage runs), the prompt stored
        at `prompt_uri`; SpecError when `request` is another unit's."""
        unit = request.unit
        mine = (self.kind, self.task_id, self.version, self.unit_candidate, self.generation)
        theirs = (unit.kind, unit.task_id, unit.version, unit.candidate, unit.generation)
        if mine != theirs:
            raise SpecError(f"episode {self.slug}: the request is for another unit ({unit.slug})")
        workspace_seed = getattr(request, "workspace_seed", None)  # a benchmark task's inputs, when it has any
        return replace(
            self,
            seed=unit.seed,
            condition=request.condition,
            prompt_uri=prompt_uri,
            prompt_sha256=request.prompt_sha256,
            workspace_seed_uri=None if workspace_seed is None else workspace_seed.uri,
            workspace_seed_sha256=None if workspace_seed is None else workspace_seed.sha256,
        )

    @property
    def is_bound(self) -> bool:
        return self.seed is not None

    @property
    def slug(self) -> str:
        """Short readable identity: `search-t51-v3`, `collection-t51-c4`, `rollout-l1-t60-r2`."""
        parts = [self.kind]
        if self.generation:
            parts.append(self.generation)
        parts.append(f"t{self.task_id}")
        for prefix, value in (("v", self.version), ("c", self.candidate), ("r", self.replicate)):
            if value is not None:
                parts.append(f"{prefix}{value}")
        return "-".join(parts)

    def _require_bound(self) -> None:
        if not self.is_bound:
            raise SpecError(
                f"episode {self.slug}: no seed, condition or prompt yet; bind the spec to the request its stage runs "
                "(EpisodeSpec.bound)"
            )

    def arguments(self) -> list[str]:
        """The unit's arguments of `mass-ops episode run` in the sandbox container: identity, seed, condition, and
        the prompt as the file the publisher writes into the hand-off folder."""
        self._require_bound()
        args = ["--kind", self.kind, "--task", str(self.task_id), "--seed", str(self.seed)]
        for flag, value in (
            ("--version", self.version),
            ("--candidate", self.unit_candidate),
            ("--generation", self.generation),
        ):
            if value is not None:
                args += [flag, str(value)]
        args += ["--condition", str(self.condition), "--prompt-file", f"{HANDOFF_MOUNT}/{HANDOFF_PROMPT_FILE}"]
        return [*args, *self._seed_arguments()]

    def publisher_arguments(self) -> list[str]:
        """The prompt arguments of `mass-ops episode publish`: which artifact to hand over, and its SHA-256 (and the
        same for the workspace seed, when the episode has one)."""
        self._require_bound()
        prompt = ["--prompt-uri", str(self.prompt_uri), "--prompt-sha256", str(self.prompt_sha256)]
        return [*prompt, *self._seed_arguments()]

    def _seed_arguments(self) -> list[str]:
        """The workspace seed as both containers name it: the publisher fetches that artifact into the hand-off
        folder; the sandbox's request carries it, and its runner reads it from there (it reaches no store)."""
        if self.workspace_seed_uri is None:
            return []
        uri, sha256 = str(self.workspace_seed_uri), str(self.workspace_seed_sha256)
        return ["--workspace-seed-uri", uri, "--workspace-seed-sha256", sha256]


def episode_deadline_s(config: CycleConfig, wall_clock_s: int | None = None) -> int | None:
    """Hard limit of an episode pod: every allowed infrastructure attempt at full wall clock, plus slack; None when
    the episode has no wall-clock limit (`runtime.episode_wall_clock_s: null`, the paper presets). `wall_clock_s`,
    when given, is the episode's own limit instead of the config's (a benchmark task's official time limit)."""
    runtime = config.runtime
    limit = runtime.episode_wall_clock_s if wall_clock_s is None else wall_clock_s
    if limit is None:
        return None
    return limit * runtime.max_infra_attempts + 900


@dataclass(frozen=True)
class EpisodeServer:
    """The inference server an episode runs on when it is not the config's endpoint: the server of the generation a
    benchmark episode evaluates (the stage that binds the episode looks it up; the sandbox reaches no store)."""

    endpoint: str
    served_name: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.query:
            raise SpecError(f"episode server: {self.endpoint!r} is not a plain http(s) URL")
        if not self.served_name.strip():
            raise SpecError("episode server: the served model name is empty")


def proxy_upstream(config: CycleConfig) -> str:
    """The endpoint as the episode proxy's upstream: scheme://host[:port], the client path (`/v1`) left to clients."""
    parts = urlsplit(config.inference.endpoint.rstrip("/"))
    return f"{parts.scheme}://{parts.netloc}"


def _resources(cpu: str, memory: str, disk: DiskBudget) -> dict[str, dict[str, str]]:
    """Guaranteed CPU and memory, and a disk request below its limit (disk is used as it grows)."""
    return {
        "requests": {"cpu": cpu, "memory": memory, "ephemeral-storage": disk.request},
        "limits": {"cpu": cpu, "memory": memory, "ephemeral-storage": disk.limit},
    }


def _empty_dir(name: str, limits: EpisodeLimits) -> dict[str, Any]:
    return {"name": name, "emptyDir": {"sizeLimit": limits.size_limit(name)}}


def _unique_env(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for entry in entries:
        by_name.setdefault(entry["name"], entry)
    return list(by_name.values())


def _priority_arguments(config: CycleConfig, episode: EpisodeSpec) -> list[str]:
    """The proxy's `--request-priority` for this episode, when the server schedules by priority: set in the pod spec,
    out of the sandbox's reach (`mass_ops.critical_path`)."""
    priority = episode_server_priority(config, episode.kind, episode.version)
    return [] if priority is None else ["--request-priority", str(priority)]


def episode_pod(
    config: CycleConfig,
    settings: WorkloadSettings,
    episode: EpisodeSpec,
    *,
    scope: str | None = None,
    wall_clock_s: int | None = None,
    server: EpisodeServer | None = None,
) -> dict[str, Any]:
    """The sandbox pod of one episode: non-root, no service-account token, capped resources, the NetworkPolicy's
    label, and two containers that share one emptyDir (`HANDOFF_MOUNT`) and nothing else.

    `base` runs the agent (`episode run --handoff`) with no Secret at all, not even the store's URL: the agent's
    commands run as that container's user and could read any process's environment there. The inference key goes
    to the `proxy` container only (ISSUE #13.4), a native sidecar (an init container with `restartPolicy: Always`)
    that serves the episode's logging proxy on 127.0.0.1 — containers of a pod share the network, and nothing
    outside the pod can reach that address — and writes each attempt's log into the `proxy-logs` emptyDir, which
    `base` mounts read-only. As a native sidecar it is up before `base` starts (its startup probe waits for the
    file it writes once listening), and the kubelet stops it once `base` and `publisher` have ended; its exit status
    does not count towards the pod's phase, which suits a server with nothing to report. Every container has an
    ephemeral-storage request and limit and every emptyDir a sizeLimit (`settings.episode_limits`), so an agent
    cannot fill its node's disk (ISSUE #13.6).
    `publisher` holds the artifact-store and metadata-DB credentials and publishes what `base` hands over
    (`episode publish --handoff`), artifacts first and the row last. `episode` must be bound (`EpisodeSpec.bound`):
    `base` runs exactly the unit its stage would run, reading the prompt the publisher first fetches from the store,
    checks against its SHA-256 and writes into the shared folder.

    Two regular containers, not a native sidecar (an init container with `restartPolicy: Always`, Kubernetes ≥
    1.29): the kubelet stops a native sidecar as soon as the main container exits — just when the last attempt still
    has to be published — and a sidecar's exit status does not count towards the pod's phase, so a failed publish
    would leave a Succeeded pod. As a regular container the publisher runs until everything is published, the pod
    succeeds only when both containers exit 0, and the pod operator waits for the whole pod before it reads the phase
    and deletes it. The publisher learns that `base` ended from the hand-off's marker, or that it died from its
    stopped heartbeat. `shareProcessNamespace` stays off: with it the agent could read the publisher's environment.

    A benchmark episode (ISSUE #18) is an episode pod like any other, with two differences its stage decides:
    `wall_clock_s`, the task's time limit (the stricter of the benchmark's official agent limit and the config's),
    which the runner enforces (`episode run --wall-clock-s`) and the pod's `activeDeadlineSeconds` bounds; and
    `server`, the server of the generation it evaluates (`episode run --endpoint --served-name`; the proxy reaches
    it as one of the namespace's Services). Both are run options, not config: the mounted config stays the cycle's,
    whose hash the publisher checks. A benchmark task that gives its agent files (the SWE-bench repository at its
    base commit, a Terminal-Bench task's environment files) has a workspace seed on its bound spec: the publisher
    fetches it from the store into the hand-off folder, checked against its SHA-256, before it writes the prompt
    (`episode publish --workspace-seed-uri --workspace-seed-sha256`); the sandbox, named the same seed, extracts it
    from there into the fresh workspace before the agent starts, as in-process.
    """
    if wall_clock_s is not None and (isinstance(wall_clock_s, bool) or wall_clock_s < 1):
        raise SpecError(f"episode {episode.slug}: wall_clock_s must be a whole number of seconds ≥ 1")
    if (wall_clock_s is not None or server is not None) and episode.kind != "benchmark":
        raise SpecError(f"episode {episode.slug}: only a benchmark episode takes its own time limit or server")
    k8s = config.compute.kubernetes
    scope = scope or config.cycle_name
    labels = {
        **workload_labels(config, scope),
        **settings.labels_for("episode"),
        "mass-ops/task": label_value(episode.task_id),
        "mass-ops/episode-kind": episode.kind,
    }
    limits = settings.episode_limits
    handoff_mount = {"name": "handoff", "mountPath": HANDOFF_MOUNT}
    env = [
        {"name": "MASS_EPISODE_SLUG", "value": episode.slug},
        {"name": "EPISODE_CUDA_VISIBLE_DEVICES", "value": config.runtime.episode_cuda_visible_devices},
        {"name": "HOME", "value": "/home/mass"},
        {"name": "TMPDIR", "value": "/tmp"},
        # The runner opens one proxy session per attempt there; no key, no Secret reaches this container.
        {"name": PROXY_URL_ENV, "value": f"http://127.0.0.1:{limits.proxy_port}"},
        {"name": PROXY_LOG_DIR_ENV, "value": PROXY_LOG_MOUNT},
    ]
    run = ["mass-ops", "episode", "run", "--config", CONFIG_FILE, *episode.arguments()]
    if wall_clock_s is not None:
        run += ["--wall-clock-s", str(wall_clock_s)]
    if server is not None:
        run += ["--endpoint", server.endpoint, "--served-name", server.served_name]
    sandbox = {
        "name": "base",
        "image": k8s.image_episode,
        "imagePullPolicy": "IfNotPresent",
        "command": [*run, "--handoff", HANDOFF_MOUNT],
        "env": env,
        "resources": _resources(k8s.episode_cpu, k8s.episode_memory, limits.sandbox_storage),
        "volumeMounts": [
            _config_mount(),
            handoff_mount,
            {"name": "proxy-logs", "mountPath": PROXY_LOG_MOUNT, "readOnly": True},
            {"name": "workspace", "mountPath": "/workspace"},
            {"name": "home", "mountPath": "/home/mass"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # The runtime keeps a lock file under /opt/mass-runtime that it opens for writing, so the root filesystem
        # stays writable; the image makes everything else there root-owned.
        "securityContext": _container_security(read_only_root=False),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    publisher = _store_client_container(
        PUBLISHER_CONTAINER,
        [
            *("mass-ops", "episode", "publish", "--config", CONFIG_FILE, "--handoff", HANDOFF_MOUNT),
            *episode.publisher_arguments(),
        ],
        config,
        settings,
        handoff_mount,
    )
    # The key may go to the configured endpoint and, for a rollout on another generation's server, to the
    # namespace's Services (the pod's NetworkPolicy reaches no other Service than the inference servers).
    proxy = {
        "name": PROXY_CONTAINER,
        "image": k8s.image_episode,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",  # a native sidecar: see the docstring
        "command": [
            *(EPISODE_IMAGE_PYTHON, "-m", "mass_ops.runtime.proxy", "--listen", str(limits.proxy_port)),
            *("--sessions-dir", PROXY_LOG_MOUNT, "--key-env", config.inference.api_key_env),
            *("--upstream", proxy_upstream(config), "--allow-host-suffix", f".{k8s.namespace}.svc"),
            *("--port-file", PROXY_READY_FILE),
            *_priority_arguments(config, episode),
        ],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            *_unique_env(settings.secret_env("proxy") + settings.secret_env("episode")),
        ],
        "resources": _resources(limits.proxy_cpu, limits.proxy_memory, limits.proxy_storage),
        "volumeMounts": [{"name": "proxy-logs", "mountPath": PROXY_LOG_MOUNT}],
        # The proxy listens on 127.0.0.1, which the kubelet's probes cannot reach: probe the file it writes then.
        "startupProbe": {
            "exec": {"command": ["/usr/bin/test", "-s", PROXY_READY_FILE]},
            "periodSeconds": 1,
            "failureThreshold": 120,
        },
        "securityContext": _container_security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    spec = {
        **_pod_base(config, settings),
        "restartPolicy": "Never",
        "initContainers": [proxy],
        "containers": [sandbox, publisher],
        "volumes": [
            _config_volume(),
            *(
                _empty_dir(name, limits)
                for name in ("handoff", "workspace", "home", "tmp", "publisher-tmp", "proxy-logs")
            ),
        ],
        "terminationGracePeriodSeconds": 30,
    }
    deadline = episode_deadline_s(config, wall_clock_s)
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": resource_name("ep", scope, episode.slug, max_length=50),
            "namespace": k8s.namespace,
            "labels": labels,
            "annotations": {CONFIG_ANNOTATION: config_document(config)},
        },
        "spec": spec,
    }


# --------------------------------------------------------------------------------------------------------------------
# Training and export Jobs


JobRole = Literal["train", "export"]


def job_name(config: CycleConfig, role: JobRole) -> str:
    """Name of the cycle's training/export Job or TrainJob (short enough for `<job>-<index>` pod hostnames, and for
    a TrainJob's `<job>-node-0-<index>`)."""
    return resource_name("mass", config.cycle_name, role, max_length=50)


def _training_labels(config: CycleConfig, settings: WorkloadSettings, role: JobRole) -> dict[str, str]:
    return {**workload_labels(config, config.cycle_name), **settings.labels_for("training"), "mass-ops/job": role}


def _training_topology(config: CycleConfig, role: JobRole) -> tuple[int, int]:
    """(nodes, GPUs per node): one data-parallel rank per GPU (ZeRO-3), `replicas / nnodes` ranks per node."""
    if role == "train":
        return config.training.nnodes, config.training.ranks_per_node
    return 1, 1


def _training_env(config: CycleConfig, settings: WorkloadSettings, role: JobRole) -> list[dict[str, Any]]:
    """The launch topology and paths every node of the stage reads (`mass_ops.train.plan`); node rank = the
    Job completion index, which both an indexed Job and a TrainJob's JobSet give each node's pod."""
    nnodes, gpus = _training_topology(config, role)
    return [
        {"name": "NNODES", "value": str(nnodes)},
        {"name": "NPROC_PER_NODE", "value": str(gpus)},
        {
            "name": "NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
        },
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "MASS_MODEL_DIR", "value": MODEL_MOUNT},
        {"name": "HOME", "value": "/scratch"},
        *settings.secret_env("training"),
    ]


def _training_mounts(role: JobRole) -> list[dict[str, Any]]:
    return [
        _config_mount(),
        # Export writes the next generation's weights into the cache, where the inference server loads them.
        {"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": role == "train"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def _training_volumes(config: CycleConfig, role: JobRole) -> list[dict[str, Any]]:
    return [
        _config_volume(),
        _model_cache_volume(config, read_only=role == "train"),
        _shm_volume(),
        {"name": "scratch", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]


def _training_command(role: JobRole) -> list[str]:
    return ["mass-ops", "stage", role, "--config", CONFIG_FILE]


def training_job(config: CycleConfig, settings: WorkloadSettings, *, role: JobRole = "train") -> dict[str, Any]:
    """An indexed Job: one pod per node, each with one GPU per data-parallel rank, running the stage's launch.

    `training.nnodes` pods start together (`training.replicas / nnodes` GPUs each); node rank = completion index
    (Kubernetes also sets JOB_COMPLETION_INDEX); node 0 is reachable for rendezvous as `<job>-0.<job>` through the
    headless Service of `rendezvous_service`, and the pods get that name as `MASTER_ADDR`. A failed pod fails the
    Job at once (backoffLimit 0): Airflow owns retries, and the stage resumes from its last checkpoint.
    """
    k8s = config.compute.kubernetes
    name = job_name(config, role)
    nnodes, gpus = _training_topology(config, role)
    labels = _training_labels(config, settings, role)
    container = {
        "name": "base",
        "image": k8s.image_trainer,
        "imagePullPolicy": "IfNotPresent",
        "command": _training_command(role),
        "env": [{"name": "MASTER_ADDR", "value": f"{name}-0.{name}"}, *_training_env(config, settings, role)],
        "envFrom": settings.env_from(),
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": _gpu_resources(config, gpus),
        "volumeMounts": _training_mounts(role),
        "securityContext": _container_security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = {
        **_pod_base(config, settings),
        **_gpu_scheduling(config),
        "restartPolicy": "Never",
        "subdomain": name,
        "priorityClassName": k8s.training_priority_class,
        "containers": [container],
        "volumes": _training_volumes(config, role),
        "terminationGracePeriodSeconds": TRAINING_GRACE_S,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nnodes,
            "parallelism": nnodes,
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                "spec": pod_spec,
            },
        },
    }


def training_trainjob(config: CycleConfig, settings: WorkloadSettings) -> dict[str, Any]:
    """The cycle's training as a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`, Trainer ≥ 2.2).

    The TrainJob names the ClusterTrainingRuntime `compute.kubernetes.trainjob_runtime` (Trainer's
    `torch-distributed` by default) and sets, through its `trainer` field, what the indexed Job sets: `numNodes`
    nodes with `resourcesPerNode` GPUs and `numProcPerNode` ranks each, the trainer image, command and environment.
    The runtime's torch plugin adds the `PET_*` topology (its `PET_MASTER_ADDR` names node 0 of the JobSet it
    creates, which also brings the headless Service), so no `MASTER_ADDR` and no Service of our own.

    Pod fields the `trainer` field cannot carry go in one `runtimePatches` entry for the runtime's `node` job:
    labels (the NetworkPolicy's, the scope's), the config annotation, service account, security context, GPU
    scheduling, volumes, and the `node` container's mounts and security context (its env may only come through
    `trainer.env`, which must not hold the runtime's reserved `PET_*` names). A TrainJob cannot set the priority
    class, `enableServiceLinks` or `automountServiceAccountToken`: the runtime decides the first two, and the chart's
    workload service account already mounts no token.
    """
    k8s = config.compute.kubernetes
    name = job_name(config, "train")
    nnodes, gpus = _training_topology(config, "train")
    labels = _training_labels(config, settings, "train")
    pod_patch: dict[str, Any] = {
        "serviceAccountName": settings.service_account,
        "securityContext": _pod_security(config),
        "volumes": _training_volumes(config, "train"),
        "containers": [
            {
                "name": TRAINJOB_NODE,
                "volumeMounts": _training_mounts("train"),
                "securityContext": _container_security(read_only_root=True),
            }
        ],
        "terminationGracePeriodSeconds": TRAINING_GRACE_S,
        **_gpu_scheduling(config),
    }
    node_patch = {
        "name": TRAINJOB_NODE,
        "template": {
            "spec": {
                "template": {
                    "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                    "spec": pod_patch,
                }
            }
        },
    }
    return {
        "apiVersion": f"{TRAINJOB_GROUP}/{TRAINJOB_VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"name": k8s.trainjob_runtime, "apiGroup": TRAINJOB_GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": k8s.image_trainer,
                "command": _training_command("train"),
                "env": _training_env(config, settings, "train"),
                "numNodes": nnodes,
                "numProcPerNode": gpus,
                "resourcesPerNode": _gpu_resources(config, gpus),
            },
            "runtimePatches": [
                {
                    "manager": TRAINJOB_PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_patch]}}},
                }
            ],
        },
    }


def rendezvous_service(config: CycleConfig, settings: WorkloadSettings, *, role: JobRole = "train") -> dict[str, Any]:
    """Headless Service giving the Job's pods stable DNS names (`<job>-<index>.<job>`) before they are ready."""
    name = job_name(config, role)
    labels = _training_labels(config, settings, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": config.compute.kubernetes.namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_NAME_LABEL: name},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}],
        },
    }


def scope_selector(config: CycleConfig, scope: str, extra: Mapping[str, str] | None = None) -> str:
    """Label selector of every object mass-ops created in `scope` (used to find and clean up leftovers)."""
    labels = {CYCLE_LABEL: label_value(config.cycle_name), SCOPE_LABEL: label_value(scope), **(extra or {})}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def manifests_of_cycle(config: CycleConfig, settings: WorkloadSettings, episodes: Sequence[EpisodeSpec]) -> list[dict]:
    """Every manifest a cycle with these episodes creates (for validation and dry runs)."""
    scope = config.cycle_name
    targets = [current_serving_target(config), next_serving_target(config)]
    out: list[dict] = []
    for target in targets:
        out += [
            inference_deployment(config, settings, target, scope=scope),
            inference_service(config, settings, target, scope=scope),
        ]
    out += [episode_pod(config, settings, e) for e in episodes]
    if config.compute.kubernetes.training_launcher == "trainjob":
        out.append(training_trainjob(config, settings))
    else:
        out += [training_job(config, settings, role="train"), rendezvous_service(config, settings, role="train")]
    out += [training_job(config, settings, role="export"), rendezvous_service(config, settings, role="export")]
    return out


# --------------------------------------------------------------------------------------------------------------------
# Benchmark grader Jobs

GRADER_CONTAINER = "grader"
GRADER_FETCH_CONTAINER = "fetch"
GRADER_INPUT_MOUNT = "/grader-in"
GRADER_BUNDLE = f"{GRADER_INPUT_MOUNT}/bundle.tar"
GRADER_DEADLINE_SLACK_S = 300  # image start and the bundle's fetch, on top of the grader's own limit


class GraderRun(Protocol):
    """What a grader Job runs (an evaluation `GraderJob`; compute sits below evaluation, so it names only the fields
    it reads): the benchmark's image and bash script, and the script's time limit."""

    @property
    def benchmark(self) -> str: ...

    @property
    def instance(self) -> str: ...

    @property
    def image(self) -> str: ...

    @property
    def script(self) -> str: ...

    @property
    def timeout_s(self) -> float: ...


def grader_job_name(config: CycleConfig, job: GraderRun, unit: str = "") -> str:
    """The grader Job's name: cycle, benchmark, `unit` (generation and trial: the same instance is graded once per
    trial, and trials run side by side) and instance, hashed when too long."""
    return resource_name("grade", config.cycle_name, job.benchmark, unit, job.instance, max_length=52)


def benchmark_grader_job(
    config: CycleConfig,
    settings: WorkloadSettings,
    job: GraderRun,
    *,
    bundle_uri: str,
    bundle_sha256: str,
    scope: str | None = None,
    unit: str = "",
) -> dict[str, Any]:
    """One benchmark instance's grading as a Job from the benchmark's own image (SWE-bench, Terminal-Bench 2.0).

    The pod is an episode pod in everything that bounds it: the episode labels (so the chart's sandbox
    NetworkPolicy applies: no ingress, egress only to the inference servers, DNS, the listed mirrors and the stores),
    the episode CPU, memory and ephemeral-storage limits, sized emptyDirs, the workload account without its token,
    no service links, and a deadline. Its files (the agent's patch or workspace, the tests, the eval script) arrive
    as one tar bundle stored as an artifact: the `fetch` init container (the episode image, non-root, the only one
    with the store credentials — the publisher's Secrets) writes it to `GRADER_BUNDLE` after checking its SHA-256,
    and `grader` (the benchmark image, no Secret at all) unpacks it over `/` and runs the script. The result is read
    from the `grader` container's log between the grader's result markers (`BenchmarkTrialOperator`), which then
    stores it as an artifact with the score: the grader itself holds no credential to publish anything. `unit`
    (e.g. ``l1-t0``) keeps the Jobs of one instance in different trials apart.

    Why `grader` runs as root when episode pods enforce runAsNonRoot: the benchmarks' images are built to grade as
    root (SWE-bench's `/testbed` and its conda environment belong to root, Terminal-Bench's verifiers write
    `/logs/verifier` and install test tools), and running them as another user changes what their tests see. What
    root may do is bounded instead: no privilege escalation, not privileged, every capability dropped (root without
    CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_SETUID, CAP_NET_RAW ... can only touch what root owns inside its own
    container), the runtime's default seccomp profile, no service-account token, no Secret, and the sandbox
    NetworkPolicy. The relaxation is the grader container's alone: the pod keeps the episode pods' seccomp profile and
    the fetch container still runs as the unprivileged runtime user. The Job never retries (backoffLimit 0): a failed
    grading is reported, and the trial's rerun grades the instance again.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", bundle_sha256):
        raise SpecError(f"grader {job.benchmark}/{job.instance}: bundle_sha256 {bundle_sha256!r} is not a hex SHA-256")
    if not job.image.strip():
        raise SpecError(f"grader {job.benchmark}/{job.instance}: the benchmark image is empty")
    if not math.isfinite(job.timeout_s) or job.timeout_s <= 0:
        raise SpecError(f"grader {job.benchmark}/{job.instance}: timeout_s {job.timeout_s!r} is not positive")
    k8s = config.compute.kubernetes
    scope = scope or config.cycle_name
    limits = settings.episode_limits
    name = grader_job_name(config, job, unit)
    labels = {
        **workload_labels(config, scope),
        **settings.labels_for("episode"),
        "mass-ops/benchmark": label_value(job.benchmark),
        "mass-ops/instance": label_value(job.instance) or "instance",
        **({"mass-ops/unit": label_value(unit)} if unit else {}),
    }
    input_mount = {"name": "grader-in", "mountPath": GRADER_INPUT_MOUNT}
    fetch = _store_client_container(
        GRADER_FETCH_CONTAINER,
        [
            *("mass-ops", "benchmark", "grader-files", "--config", CONFIG_FILE),
            *("--uri", bundle_uri, "--sha256", bundle_sha256, "--out", GRADER_BUNDLE),
        ],
        config,
        settings,
        input_mount,
    )
    fetch["securityContext"] = {**fetch["securityContext"], "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID}
    grader = {
        "name": GRADER_CONTAINER,
        "image": job.image,
        # Images come from the registry the user provides and are never rebuilt or pulled from elsewhere at run time.
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", f'tar -xf {GRADER_BUNDLE} -C / && exec bash -c "$MASS_GRADER_SCRIPT"'],
        "env": [{"name": "MASS_GRADER_SCRIPT", "value": job.script}],
        "resources": _resources(k8s.episode_cpu, k8s.episode_memory, limits.sandbox_storage),
        "volumeMounts": [{**input_mount, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": False,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Pod-level: only what holds for both containers; who runs as whom is set per container.
        "securityContext": {"fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "restartPolicy": "Never",
        "initContainers": [fetch],
        "containers": [grader],
        "volumes": [
            _config_volume(),
            {"name": "grader-in", "emptyDir": {"sizeLimit": limits.size_limit("workspace")}},
            _empty_dir("tmp", limits),
            _empty_dir("publisher-tmp", limits),
        ],
        "terminationGracePeriodSeconds": 30,
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": math.ceil(job.timeout_s) + GRADER_DEADLINE_SLACK_S,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                "spec": pod_spec,
            },
        },
    }
