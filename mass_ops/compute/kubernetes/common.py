"""The shared floor of the Kubernetes specs: names, labels, mounts, the chart's settings, pod building blocks.

Imports no sibling module. `WorkloadSettings` is what the Helm chart's settings ConfigMap says (the workload service
account, the labels its NetworkPolicy selects, the env ConfigMap, which Secret feeds which variable of which
workload), read from the mounted folder by `load_workload_settings`. `config_document` is the cycle config as every
pod receives it (annotation `CONFIG_ANNOTATION`, file `CONFIG_FILE`); `model_path` maps a model key onto the cache
claim at `MODEL_MOUNT`. The `_`-prefixed helpers (pod base, security contexts, volumes, resources, the store-client
container) serve the workload modules of this package only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError

CONFIG_ANNOTATION = "mass-ops/cycle-config"
CONFIG_MOUNT = "/etc/mass-ops/cycle"
CONFIG_FILE = f"{CONFIG_MOUNT}/config.json"
MODEL_MOUNT = "/models"
RUNTIME_UID = 10001  # the unprivileged user of the episode, trainer and inference images
SETTINGS_DIR_ENV = "MASS_SETTINGS_DIR"
DEFAULT_SETTINGS_DIR = "/etc/mass-ops/settings"
PART_OF = {"app.kubernetes.io/part-of": "mass-ops", "app.kubernetes.io/managed-by": "mass-ops-airflow"}
INSTANCE_LABEL = "app.kubernetes.io/instance"
CYCLE_LABEL = "mass-ops/cycle"
SCOPE_LABEL = "mass-ops/scope"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
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
_QUANTITY_FACTORS: dict[str | None, float] = {
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


def scope_selector(config: CycleConfig, scope: str, extra: Mapping[str, str] | None = None) -> str:
    """Label selector of every object mass-ops created in `scope` (used to find and clean up leftovers)."""
    labels = {CYCLE_LABEL: label_value(config.cycle_name), SCOPE_LABEL: label_value(scope), **(extra or {})}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


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
    name: str,
    command: list[str],
    config: CycleConfig,
    settings: WorkloadSettings,
    work_mount: dict[str, Any],
    *extra_mounts: dict[str, Any],
) -> dict[str, Any]:
    """A container of an episode or grader pod that holds the store credentials (the publisher role) and nothing
    else: the episode image running `command`, read-only root, /tmp on its own volume, `work_mount` shared with
    the sandbox or grader (and `extra_mounts`)."""
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
        "volumeMounts": [_config_mount(), work_mount, {"name": "publisher-tmp", "mountPath": "/tmp"}, *extra_mounts],
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


def _resources(cpu: str, memory: str, disk: DiskBudget) -> dict[str, dict[str, str]]:
    """Guaranteed CPU and memory, and a disk request below its limit (disk is used as it grows)."""
    return {
        "requests": {"cpu": cpu, "memory": memory, "ephemeral-storage": disk.request},
        "limits": {"cpu": cpu, "memory": memory, "ephemeral-storage": disk.limit},
    }


def _empty_dir(name: str, limits: EpisodeLimits) -> dict[str, Any]:
    return {"name": name, "emptyDir": {"sizeLimit": limits.size_limit(name)}}
