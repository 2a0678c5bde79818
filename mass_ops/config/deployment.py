"""Where a cycle runs and keeps its records: storage URLs, compute (local or Kubernetes), one episode's limits.

`storage` is overridden by MASS_METADATA_URL / MASS_ARTIFACT_URL and is not part of the config hash.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StrictInt, model_validator

from mass_ops.config.section import K8S_NAME, MAX_MAP_ENTRIES, PositiveInt, Section


class StorageConfig(Section):
    """Where records and artifacts live. Overridden by MASS_METADATA_URL / MASS_ARTIFACT_URL."""

    metadata_url: str = Field(
        default="sqlite:///runs/mass-ops.db",
        description=(
            "Database of the cycle's records: sqlite:///PATH (embedded default) or postgresql://HOST/DB; "
            "MASS_METADATA_URL overrides it."
        ),
    )
    artifact_url: str = Field(
        default="runs/artifacts",
        description=(
            "Where artifacts (workspaces, logs, models) go: a folder, file://PATH or s3://BUCKET/PREFIX; "
            "MASS_ARTIFACT_URL overrides it."
        ),
    )

    @model_validator(mode="after")
    def _urls(self) -> StorageConfig:
        problems = []
        meta = self.metadata_url
        if not (meta.startswith("sqlite:///") or re.match(r"^postgresql(\+[a-z0-9]+)?://[^/]+/[^/?#]+", meta)):
            problems.append("metadata_url: must be sqlite:///PATH or postgresql://HOST/DB")
        art = self.artifact_url
        if art.startswith("s3://"):
            if not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?$", art):
                problems.append("artifact_url: s3://BUCKET/PREFIX has an invalid bucket name")
        elif "://" in art and not art.startswith("file://"):
            problems.append("artifact_url: must be s3://BUCKET/PREFIX, file://PATH or a folder path")
        elif not art.strip():
            problems.append("artifact_url: must not be empty")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class KubernetesConfig(Section):
    """Settings of the Kubernetes compute backend (production profile)."""

    namespace: str = Field(
        default="mass-ops",
        description="Namespace every pod and Job of the cycle runs in.",
    )
    image_episode: str = Field(
        default="ghcr.io/mass-ops/episode:0.1.0",
        description="Container image of episode pods (the agent and its sandbox).",
    )
    image_trainer: str = Field(
        default="ghcr.io/mass-ops/trainer:0.1.0",
        description="Container image of training and export Jobs.",
    )
    image_inference: str = Field(
        default="ghcr.io/mass-ops/inference:0.1.0",
        description="Container image of the inference server.",
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        description="Extended resource name GPUs are requested under.",
    )
    node_selector: Annotated[dict[str, str], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default={},
        description="Node labels episode pods must match (at most 64); GPU pods use gpu_node_selector instead.",
    )
    gpu_node_selector: Annotated[dict[str, str], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default={},
        description="Node labels of the pods that need GPUs (inference, training, export).",
    )
    gpu_tolerations: Annotated[list[dict[str, str]], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default=[],
        description="Tolerations added to GPU pods, each a Kubernetes toleration as a mapping (at most 64).",
    )
    model_cache_pvc: str = Field(
        default="mass-ops-model-cache",
        description="PersistentVolumeClaim holding the model snapshots that inference and training read.",
    )
    episode_cpu: str = Field(
        default="4",
        description="CPU request and limit of the agent container of an episode pod (Kubernetes quantity).",
    )
    episode_memory: str = Field(
        default="16Gi",
        description="Memory request and limit of the agent container of an episode pod (Kubernetes quantity).",
    )
    publisher_cpu: str = Field(
        default="1", description="CPU of the publisher container of an episode pod (uploads artifacts, writes rows)."
    )
    publisher_memory: str = Field(default="1Gi", description="Memory of the publisher container of an episode pod.")
    startup_timeout_s: PositiveInt = Field(
        default=1800,
        description="Seconds a pod or Job may stay unscheduled or pulling its image before the task fails.",
    )
    training_priority_class: str = Field(
        default="mass-ops-training",
        description="PriorityClass of training Jobs (lets them preempt less important work).",
    )
    training_launcher: Literal["indexed-job", "trainjob"] = Field(
        default="indexed-job",
        description=(
            "How multi-node training starts: 'indexed-job' (a batch/v1 indexed Job plus a headless Service, nothing "
            "to install) or 'trainjob' (a Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime "
            "`trainjob_runtime`; needs Trainer and JobSet in the cluster). Export always runs as a Job."
        ),
    )
    trainjob_runtime: str = Field(
        default="torch-distributed",
        description="The ClusterTrainingRuntime a TrainJob refers to (Kubeflow Trainer's torch runtime by default).",
    )

    @model_validator(mode="after")
    def _names(self) -> KubernetesConfig:
        if not K8S_NAME.fullmatch(self.namespace):
            raise ValueError(f"namespace: {self.namespace!r} is not a valid Kubernetes name")
        if not K8S_NAME.fullmatch(self.trainjob_runtime):
            raise ValueError(f"trainjob_runtime: {self.trainjob_runtime!r} is not a valid Kubernetes name")
        return self


class ComputeConfig(Section):
    """Where commands run: local processes (embedded default) or Kubernetes."""

    backend: Literal["local", "kubernetes"] = Field(
        default="local",
        description="Where commands run: 'local' processes (embedded default) or 'kubernetes' pods and Jobs.",
    )
    local_inference: Literal["transformers", "external"] = Field(
        default="transformers",
        description=(
            "Local backend: 'transformers' starts `transformers serve` on the cycle's model; 'external' uses a server "
            "already answering at inference.endpoint (your own vLLM, a hosted endpoint) and only checks it is ready. "
            "Evaluation always serves the registered generations it compares with `transformers serve`."
        ),
    )
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig,
        description="Settings of the Kubernetes backend.",
    )


class RuntimeConfig(Section):
    """Limits of one episode (MASS_SPEC §4; the wall-clock limit is beyond the reference)."""

    http_response_timeout_ms: PositiveInt = Field(
        default=1800000,
        description=(
            "Milliseconds the agent waits for one model response, streaming included. Reference: 1800000 (30 min)."
        ),
    )
    shell_timeout_ms: PositiveInt = Field(
        default=600000,
        description="Milliseconds one foreground shell command of the agent may run. Reference: 600000 (10 min).",
    )
    stream_idle_timeout_ms: PositiveInt = Field(
        default=600000,
        description=(
            "Milliseconds a streamed model response may stay silent before the agent gives up on it. Reference: 600000."
        ),
    )
    episode_wall_clock_s: PositiveInt | None = Field(
        default=6 * 3600,
        description=(
            "Seconds an episode's agent may run before its whole process group is stopped (a model failure, subtype "
            "wall_clock_limit); null = no limit, as in the reference (MASS_SPEC §4), which the paper and cycle2 "
            "presets follow. Other presets keep a limit: 6 h by default, 600 s in the demo. On Kubernetes it also "
            "sets the episode pod's activeDeadlineSeconds (none when null)."
        ),
    )
    max_infra_attempts: PositiveInt = Field(default=3, description="Attempts per episode when infrastructure fails.")
    thread_limit: PositiveInt = Field(
        default=2,
        description=(
            "Threads the agent's research code may use per math library (OMP, MKL, OpenBLAS; loky gets twice as "
            "many workers). Reference: 2."
        ),
    )
    episode_cuda_visible_devices: str = Field(
        default="",
        description=(
            "CUDA_VISIBLE_DEVICES of the agent's research code; empty = no GPU (what the reference documents "
            "recommend)."
        ),
    )
    proxy_max_request_bytes: PositiveInt = Field(
        default=32 * 1024**2,
        description=(
            "Largest request body (bytes) the episode proxy reads from the agent; a larger one gets HTTP 413, is "
            "recorded and never forwarded. A full 256K-token context is about 1 MB of JSON."
        ),
    )
    sandbox: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description=(
            "How the local backend contains the agent: `bwrap` = a bubblewrap sandbox (own PID, IPC, mount and "
            "network namespaces; it sees its workspace, home and a read-only system, and reaches only its episode "
            "proxy; see mass_ops.compute.sandbox), `none` = a plain process of the runner's user. Where bwrap is "
            "chosen but unavailable, or none is chosen, an episode with a real API key is refused unless "
            "`allow_unsandboxed_agent` is true. Kubernetes episodes run in their sandbox pod either way."
        ),
    )
    allow_unsandboxed_agent: bool = Field(
        default=False,
        description=(
            "Run local episodes that hold a real API key (anything but the placeholder EMPTY) without a sandbox: "
            "the agent can then read the runner's environment and reach every local service. Off by default."
        ),
    )
    sandbox_egress: Literal["none", "public"] = Field(
        default="none",
        description=(
            "Internet for the bwrap-sandboxed agent's downloads (pip, uv, npm, git, curl): `public` = an egress proxy "
            "per attempt, named in the agent's HTTPS_PROXY/HTTP_PROXY/ALL_PROXY, that forwards CONNECT tunnels and "
            "plain http:// requests to globally routable addresses only (never loopback, private, link-local or "
            "cloud metadata, CGNAT or this host's own addresses; see mass_ops.compute.egress), counted in each "
            "attempt's status document; `none` = no network but the episode proxy. The paper and cycle2 presets "
            "choose public (the reference's agents download packages)."
        ),
    )
    sandbox_egress_ports: list[Annotated[StrictInt, Field(ge=1, le=65535)]] = Field(
        default_factory=lambda: [443, 80],
        min_length=1,
        description="Destination ports the egress proxy forwards to (`sandbox_egress: public`); others get HTTP 403.",
    )
