"""Episode pods: one pod per bound episode, with its sandbox, publisher and proxy containers.

`EpisodeSpec` names an episode (kind, task, version / candidate / replicate, generation) and, once `bound` to the
request its stage runs, carries that request's seed, condition and prompt; only a bound spec becomes a pod.
`episode_pod` builds it: `base` runs `mass-ops episode run --config CONFIG_FILE ... --handoff HANDOFF_MOUNT` with no
Secret at all; `publisher`, holding the store and database credentials, runs `mass-ops episode publish` on the same
hand-off folder; the native sidecar `proxy`, alone holding the inference key, runs `mass_ops.runtime.session_proxy`
with its control socket and session logs under `PROXY_LOG_MOUNT` (mounted read-only by the publisher, not at all
by the sandbox). Why this shape: docs/kubernetes.md, "Episode pods".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

from mass_ops.compute.kubernetes.common import (
    CONFIG_ANNOTATION,
    CONFIG_FILE,
    SpecError,
    WorkloadSettings,
    _config_mount,
    _config_volume,
    _container_security,
    _empty_dir,
    _pod_base,
    _resources,
    _store_client_container,
    config_document,
    label_value,
    resource_name,
    workload_labels,
)
from mass_ops.config import CycleConfig
from mass_ops.critical_path import episode_server_priority
from mass_ops.layout import BENCHMARK_TASK_NAME, HANDOFF_PROMPT_FILE, EpisodeKind, EpisodeUnit

HANDOFF_MOUNT = "/handoff"  # the emptyDir an episode's sandbox and publisher containers share
PUBLISHER_CONTAINER = "publisher"
PROXY_CONTAINER = "proxy"
# The episode proxy's volume: its control socket and session logs, mounted by the proxy and the publisher only.
PROXY_LOG_MOUNT = "/proxy-logs"
PROXY_READY_FILE = f"{PROXY_LOG_MOUNT}/proxy.port"  # written by the proxy once it listens: its startup probe
PROXY_CONTROL_SOCKET = f"{PROXY_LOG_MOUNT}/control.sock"
PROXY_SESSIONS_DIR = f"{PROXY_LOG_MOUNT}/sessions"
# mass-ops' own interpreter in the episode image (docker/episode/Dockerfile: a venv apart from the agent's python).
EPISODE_IMAGE_PYTHON = "/opt/mass-ops/bin/python"


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
        parts: list[str] = [self.kind]
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


def _sandbox_container(
    config: CycleConfig,
    settings: WorkloadSettings,
    episode: EpisodeSpec,
    handoff_mount: dict[str, Any],
    run_options: list[str],
) -> dict[str, Any]:
    """`base`: the agent's container, running the bound unit (`episode run --handoff`, plus `run_options`) with no
    Secret at all, not even the store's URL: the agent's commands run as this container's user and could read any
    process's environment there."""
    k8s, limits = config.compute.kubernetes, settings.episode_limits
    env = [
        {"name": "MASS_EPISODE_SLUG", "value": episode.slug},
        {"name": "EPISODE_CUDA_VISIBLE_DEVICES", "value": config.runtime.episode_cuda_visible_devices},
        {"name": "HOME", "value": "/home/mass"},
        {"name": "TMPDIR", "value": "/tmp"},
    ]
    run = ["mass-ops", "episode", "run", "--config", CONFIG_FILE, *episode.arguments(), *run_options]
    return {
        "name": "base",
        "image": k8s.image_episode,
        "imagePullPolicy": "IfNotPresent",
        "command": [*run, "--handoff", HANDOFF_MOUNT],
        "env": env,
        "resources": _resources(k8s.episode_cpu, k8s.episode_memory, limits.sandbox_storage),
        "volumeMounts": [
            _config_mount(),
            handoff_mount,
            {"name": "workspace", "mountPath": "/workspace"},
            {"name": "home", "mountPath": "/home/mass"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # The runtime keeps a lock file under /opt/mass-runtime that it opens for writing, so the root filesystem
        # stays writable; the image makes everything else there root-owned.
        "securityContext": _container_security(read_only_root=False),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _publisher_container(
    config: CycleConfig,
    settings: WorkloadSettings,
    episode: EpisodeSpec,
    handoff_mount: dict[str, Any],
    server_arguments: list[str],
) -> dict[str, Any]:
    """`publisher`: holds the store and database credentials, fetches the prompt (and workspace seed) into the
    hand-off folder, opens and closes the proxy's sessions, and publishes what `base` hands over, the row last."""
    return _store_client_container(
        PUBLISHER_CONTAINER,
        [
            *("mass-ops", "episode", "publish", "--config", CONFIG_FILE, "--handoff", HANDOFF_MOUNT),
            *episode.publisher_arguments(),
            *("--proxy-control", PROXY_CONTROL_SOCKET, "--proxy-sessions", PROXY_SESSIONS_DIR),
            # the publisher opens each session towards the server the pod names, never one the sandbox names
            *server_arguments,
        ],
        config,
        settings,
        handoff_mount,
        # Connecting to a Unix socket needs no write access to its volume.
        {"name": "proxy-logs", "mountPath": PROXY_LOG_MOUNT, "readOnly": True},
    )


def _proxy_container(config: CycleConfig, settings: WorkloadSettings, episode: EpisodeSpec) -> dict[str, Any]:
    """`proxy`: the only holder of the inference key, as a native sidecar (an init container with `restartPolicy:
    Always`): up before `base` starts (its startup probe waits for the file it writes once it listens), stopped by
    the kubelet once `base` and `publisher` have ended, its exit status not counting towards the pod's phase."""
    k8s, limits = config.compute.kubernetes, settings.episode_limits
    # The key may go to the configured endpoint and, for a rollout on another generation's server, to the
    # namespace's Services (the pod's NetworkPolicy reaches no other Service than the inference servers).
    return {
        "name": PROXY_CONTAINER,
        "image": k8s.image_episode,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",  # a native sidecar: see the docstring
        "command": [
            *(EPISODE_IMAGE_PYTHON, "-m", "mass_ops.runtime.session_proxy", "--listen", str(limits.proxy_port)),
            *("--sessions-dir", PROXY_SESSIONS_DIR, "--control-socket", PROXY_CONTROL_SOCKET),
            *("--key-env", config.inference.api_key_env),
            *("--upstream", proxy_upstream(config), "--allow-host-suffix", f".{k8s.namespace}.svc"),
            *("--port-file", PROXY_READY_FILE),
            *("--client-path", urlsplit(config.inference.endpoint).path.rstrip("/")),
            *("--max-request-bytes", str(config.runtime.proxy_max_request_bytes)),
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


def episode_pod(
    config: CycleConfig,
    settings: WorkloadSettings,
    episode: EpisodeSpec,
    *,
    scope: str | None = None,
    wall_clock_s: int | None = None,
    server: EpisodeServer | None = None,
) -> dict[str, Any]:
    """The sandbox pod of one bound episode (`EpisodeSpec.bound`): non-root, no service-account token, capped CPU,
    memory and disk (`settings.episode_limits`), the NetworkPolicy's episode labels, and the containers `base`,
    `publisher` and `proxy`, which share emptyDirs and nothing else.

    `wall_clock_s` and `server` are a benchmark episode's only: its time limit (`episode run --wall-clock-s`, which
    the pod's `activeDeadlineSeconds` bounds) and the server of the generation it evaluates (`--endpoint
    --served-name`, to `base` and `publisher`). The design, container by container: docs/kubernetes.md.
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
    run_options = [] if wall_clock_s is None else ["--wall-clock-s", str(wall_clock_s)]
    server_arguments = [] if server is None else ["--endpoint", server.endpoint, "--served-name", server.served_name]
    sandbox = _sandbox_container(config, settings, episode, handoff_mount, [*run_options, *server_arguments])
    publisher = _publisher_container(config, settings, episode, handoff_mount, server_arguments)
    proxy = _proxy_container(config, settings, episode)
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
