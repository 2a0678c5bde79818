"""Where work runs: the `ComputeBackend` of a cycle, chosen once from `compute.backend` by `backend_for(config)`.

Contract: `LocalBackend` runs the work in this process tree — model servers are detached local processes
(`compute.local`), episodes run in the calling stage's episode pool, jobs are supervised process groups
(`compute.processes`). `KubernetesBackend` runs it on the cluster, where the Airflow operators create the workloads:
its launch operations return the manifests to create (`compute.kubernetes`), and what only a pod does (start a
server here, run a job here) raises `LaunchedByOperator`. A launch operation answering None means "nothing to
launch: the stage function does it in-process". Callers ask the backend; none compares backend names. Design notes:
docs/compute.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError

if TYPE_CHECKING:
    from mass_ops.compute.kubernetes import EpisodeServer, EpisodeSpec, GraderRun, ServingTarget
    from mass_ops.compute.local import CommandResult, ServerState

BackendName = Literal["local", "kubernetes"]
_W = TypeVar("_W")
JobRole = Literal["train", "export"]

# The local model server is `transformers serve` on the CPU (the embedded profile).
CPU_SERVE_ARGS = ("--device", "cpu", "--dtype", "float32")


class LaunchedByOperator(InputError):
    """The operation runs in a pod the Airflow operator launches, not in this process (Kubernetes backend)."""


@dataclass(frozen=True)
class ModelRequest:
    """A model to serve in this process tree: `model` (a folder or a name) listed as `served_name`, recorded in
    `state_file`. With `port`, it listens there on 127.0.0.1 and answers at `endpoint` as given; without, on a port
    free now on `endpoint`'s host, the endpoint rewritten to it. `reuse`: a live recorded server is reused when its
    argv is identical (`argv`), or when it lists the same served name whatever its port (`served_name`)."""

    model: str
    served_name: str
    endpoint: str
    state_file: Path
    port: int | None = None
    reuse: Literal["argv", "served_name"] = "argv"
    extra_args: tuple[str, ...] = CPU_SERVE_ARGS


@dataclass(frozen=True)
class ModelServer:
    """A served model: the base URL, the name `/v1/models` lists, and the local process (None on the cluster)."""

    endpoint: str
    served_name: str
    state: ServerState | None = field(default=None, compare=False)

    @property
    def pid(self) -> int | None:
        return None if self.state is None else self.state.pid


@dataclass(frozen=True)
class ModelWorkload:
    """One served model on the cluster: the Deployment and Service to apply and where it answers."""

    deployment: dict[str, Any]
    service: dict[str, Any]
    endpoint: str
    served_name: str


@dataclass(frozen=True)
class JobWorkload:
    """A GPU job on the cluster: a `Job` with its rendezvous `service`, or a Kubeflow `TrainJob` (no service)."""

    kind: Literal["Job", "TrainJob"]
    manifest: dict[str, Any]
    service: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.manifest["metadata"]["namespace"])


class ComputeBackend(Protocol):
    """The operations stages and operators need from where work runs (see the module docstring)."""

    @property
    def name(self) -> BackendName:
        """The `compute.backend` value this implements (reported in results, never compared)."""
        ...

    @property
    def runs_in_process(self) -> bool:
        """True when stage functions do the work in this process tree; False when operators launch workloads."""
        ...

    @property
    def cpu_possible(self) -> bool:
        """Whether work may have run on CPUs only (the laptop demo); cluster nodes always have GPUs."""
        ...

    def launch_delay_s(self, config: CycleConfig) -> float:
        """How long a leased unit may wait before it starts (a pod being scheduled): added to lease horizons."""
        ...

    def serving_update(self, config: CycleConfig) -> dict[str, Any]:
        """`inference` fields to override for a server this backend runs (what that server supports)."""
        ...

    def start_model(self, config: CycleConfig, request: ModelRequest) -> ModelServer:
        """Serve a model here (or find it running); `LaunchedByOperator` on the cluster."""
        ...

    def wait_ready(self, config: CycleConfig, server: ModelServer) -> None:
        """Block until a started server is ready (`compute.readiness`); raise when it dies or times out."""
        ...

    def stop_model(self, state_file: Path) -> bool:
        """Stop a server started here (idempotent); whether a live one was stopped."""
        ...

    def locate_model(
        self, config: CycleConfig, *, scope: str, served_name: str, state_file: Path
    ) -> ModelServer | None:
        """Where a model served in `scope` answers; None when it was never started (local)."""
        ...

    def in_loop_endpoint(self, config: CycleConfig) -> str | None:
        """The endpoint the cycle's in-loop server answers at when the backend decides it; None: the config's own."""
        ...

    def model_workloads(
        self, config: CycleConfig, targets: Sequence[ServingTarget], scope: str
    ) -> list[ModelWorkload] | None:
        """The servers to launch for `targets`; None: the stage function serves them in-process."""
        ...

    def model_selector(self, config: CycleConfig, scope: str) -> str | None:
        """The label selector of `scope`'s server workloads (None: nothing launched)."""
        ...

    def episode_pod(
        self,
        config: CycleConfig,
        episode: EpisodeSpec,
        *,
        wall_clock_s: int | None = None,
        server: EpisodeServer | None = None,
    ) -> dict[str, Any] | None:
        """The sandbox pod that runs `episode`; None: the stage's episode pool runs it in-process."""
        ...

    def job_workload(self, config: CycleConfig, role: JobRole) -> JobWorkload | None:
        """The training or export workload to launch; None: the stage function runs it in-process."""
        ...

    def grader_job(
        self, config: CycleConfig, run: GraderRun, *, bundle_uri: str, bundle_sha256: str, unit: str = ""
    ) -> dict[str, Any] | None:
        """The benchmark grader Job to launch; None: the grader runs in-process."""
        ...

    def run_job(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> CommandResult:
        """Run a command here as a supervised process group; `LaunchedByOperator` on the cluster."""
        ...


class LocalBackend:
    """Local processes: detached model servers, the stage's episode pool, supervised commands."""

    name: BackendName = "local"
    runs_in_process = True
    cpu_possible = True

    def launch_delay_s(self, config: CycleConfig) -> float:
        return 0.0

    def serving_update(self, config: CycleConfig) -> dict[str, Any]:
        # `transformers serve` is plain OpenAI-compatible: no vLLM sampling extensions (HTTP 422), no priority field.
        return {
            "backend": "openai-compatible",
            "server": config.inference.server.model_copy(update={"scheduling_policy": "fcfs"}),
        }

    def start_model(self, config: CycleConfig, request: ModelRequest) -> ModelServer:
        from urllib.parse import urlsplit, urlunsplit

        from mass_ops.compute import local

        state = local.read_state(request.state_file) if request.reuse == "served_name" else None
        if state is not None and local.is_alive(state) and state.served_name == request.served_name:
            return ModelServer(state.endpoint, state.served_name, state)
        if request.port is not None:
            endpoint, host, port = request.endpoint, "127.0.0.1", request.port
        else:
            base = urlsplit(request.endpoint)
            host = base.hostname or "127.0.0.1"
            port = local.free_port(host)
            endpoint = urlunsplit((base.scheme, f"{host}:{port}", base.path, "", ""))
        argv = local.transformers_serve_argv(request.model, port=port, host=host, extra=request.extra_args)
        state = local.start_server(
            argv,
            state_file=request.state_file,
            endpoint=endpoint,
            served_name=request.served_name,
            log_path=request.state_file.with_suffix(".log"),
        )
        return ModelServer(state.endpoint, state.served_name, state)

    def wait_ready(self, config: CycleConfig, server: ModelServer) -> None:
        from mass_ops.compute.local import wait_ready

        if server.state is None:
            raise ValueError("wait_ready: the server was not started by the local backend")
        timeout = config.inference.server.readiness_timeout_s
        wait_ready(server.state, timeout_s=timeout, api_key_env=config.inference.api_key_env)

    def stop_model(self, state_file: Path) -> bool:
        from mass_ops.compute.local import stop_server

        return stop_server(state_file)

    def locate_model(
        self, config: CycleConfig, *, scope: str, served_name: str, state_file: Path
    ) -> ModelServer | None:
        from mass_ops.compute.local import read_state

        state = read_state(state_file)
        return None if state is None else ModelServer(state.endpoint, state.served_name, state)

    def in_loop_endpoint(self, config: CycleConfig) -> str | None:
        return None  # the local server listens where the config says

    def model_workloads(
        self, config: CycleConfig, targets: Sequence[ServingTarget], scope: str
    ) -> list[ModelWorkload] | None:
        return None

    def model_selector(self, config: CycleConfig, scope: str) -> str | None:
        return None

    def episode_pod(
        self,
        config: CycleConfig,
        episode: EpisodeSpec,
        *,
        wall_clock_s: int | None = None,
        server: EpisodeServer | None = None,
    ) -> dict[str, Any] | None:
        return None

    def job_workload(self, config: CycleConfig, role: JobRole) -> JobWorkload | None:
        return None

    def grader_job(
        self, config: CycleConfig, run: GraderRun, *, bundle_uri: str, bundle_sha256: str, unit: str = ""
    ) -> dict[str, Any] | None:
        return None

    def run_job(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> CommandResult:
        from mass_ops.compute.local import run_command

        return run_command(argv, cwd=cwd, env=env, timeout_s=timeout_s)


class KubernetesBackend:
    """The cluster: operators create the manifests built here; this process starts nothing itself."""

    name: BackendName = "kubernetes"
    runs_in_process = False
    cpu_possible = False

    def launch_delay_s(self, config: CycleConfig) -> float:
        return float(config.compute.kubernetes.startup_timeout_s)  # leased at pod creation, before scheduling

    def serving_update(self, config: CycleConfig) -> dict[str, Any]:
        return {}  # the cluster serves with vLLM, as configured

    def start_model(self, config: CycleConfig, request: ModelRequest) -> ModelServer:
        raise LaunchedByOperator(
            f"serving {request.served_name} here runs the local backend only; on Kubernetes the inference-server "
            "operator starts the server"
        )

    def wait_ready(self, config: CycleConfig, server: ModelServer) -> None:
        raise LaunchedByOperator("on Kubernetes the inference-server operator waits for readiness (a trigger)")

    def stop_model(self, state_file: Path) -> bool:
        return False  # nothing of this process: the teardown operator deletes the servers

    def locate_model(
        self, config: CycleConfig, *, scope: str, served_name: str, state_file: Path
    ) -> ModelServer | None:
        from mass_ops.compute.kubernetes import inference_url

        return ModelServer(inference_url(config, scope, served_name), served_name)

    def in_loop_endpoint(self, config: CycleConfig) -> str | None:
        from mass_ops.compute.kubernetes import inference_url

        return inference_url(config, config.cycle_name, config.models.served_name)  # the cycle's Service

    def model_workloads(
        self, config: CycleConfig, targets: Sequence[ServingTarget], scope: str
    ) -> list[ModelWorkload] | None:
        from mass_ops.compute import kubernetes as specs

        settings = specs.load_workload_settings()
        return [
            ModelWorkload(
                deployment=specs.inference_deployment(config, settings, target, scope=scope),
                service=specs.inference_service(config, settings, target, scope=scope),
                endpoint=specs.inference_url(config, scope, target.served_name),
                served_name=target.served_name,
            )
            for target in targets
        ]

    def model_selector(self, config: CycleConfig, scope: str) -> str | None:
        from mass_ops.compute import kubernetes as specs

        return specs.scope_selector(config, scope, specs.load_workload_settings().labels_for("inference"))

    def episode_pod(
        self,
        config: CycleConfig,
        episode: EpisodeSpec,
        *,
        wall_clock_s: int | None = None,
        server: EpisodeServer | None = None,
    ) -> dict[str, Any] | None:
        from mass_ops.compute import kubernetes as specs

        settings = specs.load_workload_settings()
        return specs.episode_pod(config, settings, episode, wall_clock_s=wall_clock_s, server=server)

    def job_workload(self, config: CycleConfig, role: JobRole) -> JobWorkload | None:
        from mass_ops.compute import kubernetes as specs

        settings = specs.load_workload_settings()
        if role == "train" and config.compute.kubernetes.training_launcher == "trainjob":
            return JobWorkload("TrainJob", specs.training_trainjob(config, settings))
        job = specs.training_job(config, settings, role=role)
        return JobWorkload("Job", job, specs.rendezvous_service(config, settings, role=role))

    def grader_job(
        self, config: CycleConfig, run: GraderRun, *, bundle_uri: str, bundle_sha256: str, unit: str = ""
    ) -> dict[str, Any] | None:
        from mass_ops.compute import kubernetes as specs

        return specs.benchmark_grader_job(
            config, specs.load_workload_settings(), run, bundle_uri=bundle_uri, bundle_sha256=bundle_sha256, unit=unit
        )

    def run_job(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> CommandResult:
        raise LaunchedByOperator(f"{argv[0]}: on Kubernetes a job runs in a pod its operator launches")


def to_launch(workload: _W | None, what: str) -> _W:
    """`workload` from a launch operation of a backend that does not run in process (never None there)."""
    if workload is None:
        raise LaunchedByOperator(f"{what}: this backend runs it in-process; there is nothing to launch")
    return workload


_BACKENDS: dict[str, ComputeBackend] = {"local": LocalBackend(), "kubernetes": KubernetesBackend()}


def backend_for(config: CycleConfig) -> ComputeBackend:
    """The backend `config.compute.backend` names (the one place that reads it)."""
    return _BACKENDS[config.compute.backend]
