"""One attempt of one episode: preflight, QWEN_HOME, logging proxy, qwen-code under limits, artifacts, then the row.

`EpisodeRunner.run_attempt(request, attempt)` is the unit of work below the pool (MASS_SPEC §4, ARCHITECTURE "units
of work"):

1. Preflight, before anything is created: the key variable named by `inference.api_key_env` is usable, and
   `GET <endpoint>/models` lists the served model (OpenRouter: without `:nitro`). Failures raise an
   `EpisodePreflightError` with one clear line; `EndpointUnreachableError` marks the transient kind. In a
   Kubernetes episode pod this process holds no key and checks nothing itself: the publisher checks the endpoint
   through the pod's episode proxy when it opens each attempt's session (step 3).
2. A private attempt folder `<scratch>/<cycle>/<unit slug>-a<attempt>/` (deterministic, so the workspace path the
   agent sees is the same on every rerun) with an empty `workspace/`, `home/.qwen/settings.json` (HOME and
   QWEN_HOME) and `logs/`. A request with a workspace seed (a benchmark task's inputs) gets it extracted into
   `workspace/` first: fetched by URI through the context's store (in a pod, the hand-off folder the publisher
   delivered it to), its SHA-256 checked, its members checked before anything is written (no absolute paths, no
   `..`, no links or hard links leading outside, no devices, at most `SEED_MAX_ENTRIES` members and
   `SEED_MAX_BYTES` bytes), all or nothing (`extract_workspace_seed`); a seed that fails any check is one line
   (`WorkspaceSeedError`) and no agent starts. The status document names the seed (`workspace_seed`).
3. The episode's logging proxy in front of the endpoint; qwen-code talks only to it, with a random per-attempt
   token (`AGENT_TOKEN_ENV`), and the proxy puts the real key on the upstream request. Locally it is a `LoggingProxy`
   in this process: on a Unix socket that only the attempt's bubblewrap sandbox mounts (`runtime.sandbox: bwrap`,
   `mass_ops.compute.sandbox`: the agent cannot see this process, its environment or any host service), or on an
   ephemeral 127.0.0.1 port for an unsandboxed agent (refused with a real key unless `runtime.allow_unsandboxed_agent`:
   `_refuse_unsandboxed`); in a pod it is a session of the `SessionProxy` in the pod's proxy container, which the
   publisher opens for the attempt, after its own preflight of the endpoint, and closes when the agent has ended
   (`ProxySessions`: this container reaches no proxy control). The row's request and token counts are the proxy's
   own counters (`LoggingProxy.usage`, or the pod proxy's close answer), not a re-read of a log the agent could have
   touched.
4. `qwen --model M --approval-mode yolo --output-format stream-json` in the workspace, prompt on stdin, in its own
   session (process group), with an allow-listed environment (`agent_environment`: no key variable, no key bytes).
   Limits: per-response timeout and shell timeout in settings.json, stream-idle timeout in the environment, and the
   episode wall-clock limit (`runtime.episode_wall_clock_s`; none when null, as in the reference) enforced here by
   stopping the whole process group (TERM, grace, KILL). Leftovers — background jobs, and anything that left the
   group but kept the environment's scope marker — are killed when the agent ends; in the sandbox every process of
   the attempt lives in its PID namespace and ends with it (a `setsid` daemon included).
5. Classification (`outcome.classify`), the API key redacted from every file the attempt produced (a second line
   of defence: the agent never had it, but an upstream could echo it), the proxy log gzipped: together with the
   status document and the row's fields this is the attempt's `EpisodePublication`. Its sink publishes it:
   `StoreSink` (default) puts every artifact in the store and then records the row (`publish_episode`); on
   Kubernetes `mass_ops.runtime.handoff.HandoffSink` hands it to the pod's publisher container, which runs the same
   `publish_episode`. A cancelled attempt (task cancellation: Ctrl-C, SIGTERM) stops the agent and the proxy,
   publishes and records nothing, and removes its folder.

From the agent's start until its row is recorded (or the attempt died) the attempt holds its unit's lease in the
metadata store (`EpisodeLease`: attempt, start, host and pid), which `mass-ops status` counts as in flight: the row
only comes when the attempt ends. In a Kubernetes pod the repository is the hand-off's stand-in, whose lease calls do
nothing: the operator leased the pod's attempt when it created the pod, and the publisher ends the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gzip
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import aiohttp
from pydantic import AwareDatetime, BaseModel, ConfigDict, NonNegativeInt
from sqlalchemy.exc import SQLAlchemyError

from mass_ops.compute.egress import EGRESS_SOCKET_NAME, EgressProxy
from mass_ops.compute.sandbox import (
    BWRAP_DESCRIPTION,
    bwrap_support,
    create_socket_dir,
    egress_url_in_sandbox,
    proxy_socket_dir,
    proxy_url_in_sandbox,
    remove_socket_dir,
    runtime_paths,
    sandboxed_argv,
)
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.critical_path import episode_server_priority
from mass_ops.errors import InfrastructureError, InputError
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime.episode import (
    SEED_MAX_BYTES,
    SEED_MAX_ENTRIES,
    EpisodeOutcome,
    EpisodeRequest,
    EpisodeStatus,
    WorkspaceSeed,
)
from mass_ops.runtime.outcome import (
    EXECUTION_MODE,
    StatusContext,
    Transcript,
    UsageCounter,
    UsageTotals,
    classify,
    status_record,
)
from mass_ops.runtime.proxy import (
    DEFAULT_KEY_VALUE,
    MIN_REDACTED_SECRET,
    REDACTION,
    EpisodeBudget,
    LoggingProxy,
    new_agent_token,
)
from mass_ops.runtime.qwen_install import QwenInstall, ensure_qwen_code
from mass_ops.runtime.settings import AGENT_TOKEN_ENV, SETTINGS_FILE, qwen_settings, write_settings
from mass_ops.store.artifacts import (
    ArtifactError,
    ArtifactFormatError,
    ArtifactInfo,
    ArtifactKeyError,
    ArtifactNotFoundError,
    ArtifactStore,
    extract_tarball,
    file_sha256,
)
from mass_ops.store.budgets import CYCLE_SCOPE, BudgetLedger, BudgetLimits, charge_episode, task_scope
from mass_ops.store.schema import LEASE_RENEW_S
from mass_ops.store.untrusted import ARCHIVE_LIMITS, UntrustedInputError, loads_untrusted

logger = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_S = 30.0
SCOPE_ENV = "MASS_EPISODE_SCOPE"
# Tells the agent how it is contained ("bwrap", "pod" or "none"), as Codex CLI's CODEX_SANDBOX does.
SANDBOX_ENV = "MASS_EPISODE_SANDBOX"
THREAD_LIMIT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
OPENMM_THREADS_VAR = "OPENMM_CPU_THREADS"
LOCAL_HOSTS = "127.0.0.1,localhost"
SCRATCH_ENV = "MASS_EPISODE_SCRATCH_DIR"
# Publishing order of an attempt's artifacts: the status document last, so a reader that finds it finds the rest.
PUBLISH_ORDER = ("workspace", "prompt", "stream", "stderr", "api_log", "settings", "status")


MODEL_LIST_MAX_BYTES = 8 << 20  # a served-model list is kilobytes; a larger answer is not one


class EpisodePreflightError(InputError):
    """An episode cannot start: the key, the endpoint or the served model is not usable. Nothing was created."""


class EndpointUnreachableError(EpisodePreflightError):
    """The endpoint did not answer `/models` (connection failure, timeout, 5xx): transient, worth waiting for."""


class ModelNotListedError(EpisodePreflightError):
    """The endpoint answers but does not serve the configured model."""


class EpisodeBusyError(InfrastructureError):
    """The same attempt of the same unit is running in another process (its attempt folder is locked)."""


class WorkspaceSeedError(InputError):
    """An episode's workspace seed cannot be used: not in the store, other bytes than its SHA-256, not a tar.gz,
    unsafe or too large. Nothing of it is extracted and no agent starts; the message is one line."""


class PublishAborted(Exception):
    """The attempt was cancelled while its artifacts were being published: the row must not be written."""


@dataclass(frozen=True)
class AttemptPaths:
    """Files and folders of one attempt (see module docstring)."""

    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def qwen_home(self) -> Path:
        return self.home / ".qwen"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def settings(self) -> Path:
        return self.qwen_home / SETTINGS_FILE

    @property
    def settings_record(self) -> Path:
        """The runner's own copy of the settings it gave the agent, out of the agent's reach: what is published
        (the agent's `settings` file is its own to rewrite while it runs)."""
        return self.logs / SETTINGS_FILE

    @property
    def prompt(self) -> Path:
        return self.logs / EPISODE_FILES["prompt"]

    @property
    def stream(self) -> Path:
        return self.logs / EPISODE_FILES["stream"]

    @property
    def stderr(self) -> Path:
        return self.logs / EPISODE_FILES["stderr"]

    @property
    def api_log(self) -> Path:
        return self.logs / "api_requests.jsonl"

    @property
    def api_log_gz(self) -> Path:
        return self.logs / EPISODE_FILES["api_log"]

    def create(self) -> None:
        for folder in (self.workspace, self.qwen_home, self.tmp, self.logs):
            folder.mkdir(parents=True, exist_ok=False)


@dataclass(frozen=True)
class AgentRun:
    """How the agent process ended."""

    exit_code: int | None
    terminated_by: str | None
    duration_s: float


class EpisodeRecord(BaseModel):
    """The result fields of an attempt's row; its identity (cycle, unit, attempt, condition, prompt hash) comes from
    the unit and the request. Strict: the hand-off reads it back from a file the sandbox wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: EpisodeStatus
    model: str
    exit_code: int | None
    failure: dict[str, Any] | None
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    requests: NonNegativeInt
    max_prompt_tokens: NonNegativeInt
    started_at: AwareDatetime
    finished_at: AwareDatetime
    qwen_code_version: str
    cached_prompt_tokens: NonNegativeInt = 0


@dataclass(frozen=True)
class AttemptFiles:
    """The files an attempt publishes besides its status document (names as in `layout.EPISODE_FILES`).

    `workspace` is the workspace folder, or — in a hand-off — its deterministic tar.gz (`workspace_archived`), which
    holds the same bytes `put_dir` would have stored.
    """

    workspace: Path
    prompt: Path
    stream: Path
    stderr: Path
    api_log: Path
    settings: Path
    workspace_archived: bool = False

    @classmethod
    def of_attempt(cls, paths: AttemptPaths) -> AttemptFiles:
        return cls(paths.workspace, paths.prompt, paths.stream, paths.stderr, paths.api_log_gz, paths.settings_record)


@dataclass(frozen=True)
class EpisodePublication:
    """Everything one finished attempt publishes: its files, its status document and its row."""

    request: EpisodeRequest
    unit: EpisodeUnit  # with the attempt number
    files: AttemptFiles
    status: dict[str, Any]
    record: EpisodeRecord
    retry_of_id: int | None = None


@dataclass(frozen=True)
class AttemptSession:
    """An attempt's session with a pod's episode proxy, as the runner holds it: where the agent connects and with
    which token (`name` is how the publisher knows it)."""

    name: str
    proxy_url: str
    token: str


class ProxySessions(Protocol):
    """Where a pod's runner gets each attempt's proxy session: from the publisher, the one container that reaches
    the proxy's control socket (`mass_ops.runtime.handoff.HandoffProxySessions`)."""

    async def open(self, unit: EpisodeUnit) -> AttemptSession:
        """The session of attempt `unit.attempt`, the endpoint checked; `EndpointUnreachableError` (wait and ask
        again) or `EpisodePreflightError`."""
        ...

    async def close(self, session: AttemptSession, api_log: Path) -> UsageTotals:
        """Close `session` once its agent has ended: its log lands at `api_log`; returns the proxy's counts."""
        ...


# --- preflight --------------------------------------------------------------------------------------------------


def resolve_api_key(config: CycleConfig, environ: Mapping[str, str]) -> str:
    """The key value from the variable named by `inference.api_key_env` (MASS_SPEC §4 preflight rules).

    Local backends default an unset/empty variable to "EMPTY"; OpenRouter needs a real key. A key with whitespace
    is refused (it would break the Authorization header). Messages name the variable, never the value.
    """
    name = config.inference.api_key_env
    value = environ.get(name, "")
    if not value:
        if config.inference.backend == "openrouter":
            raise EpisodePreflightError(f"episode preflight: environment variable {name} (the API key) is not set")
        value = DEFAULT_KEY_VALUE
    if any(char.isspace() for char in value):
        raise EpisodePreflightError(f"episode preflight: environment variable {name} (the API key) contains whitespace")
    return value


def discovery_model_id(config: CycleConfig) -> str:
    """The id `/models` must list: the served name, without OpenRouter's `:nitro` routing suffix."""
    name = config.models.served_name
    if config.inference.backend == "openrouter":
        return name.removesuffix(":nitro")
    return name


async def check_endpoint(
    config: CycleConfig, api_key: str, *, via: str | None = None, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> None:
    """`GET <endpoint>/models` must list the served model; raises `ModelNotListedError` or
    `EndpointUnreachableError` (one line, no key). `via`: the base URL of an episode proxy to ask through (then
    `api_key` is the proxy's token)."""
    endpoint = config.inference.endpoint.rstrip("/")
    url = f"{endpoint}/models"
    if via is not None:
        url = f"{via.rstrip('/')}{_split_endpoint(endpoint)[1]}/models"
    wanted = discovery_model_id(config)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url, headers={"Authorization": f"Bearer {api_key}"}) as response,
        ):
            status = response.status
            body = await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EndpointUnreachableError(f"episode preflight: GET {url} failed: {type(exc).__name__}") from None
    if status >= 500:
        raise EndpointUnreachableError(f"episode preflight: GET {url} answered HTTP {status}")
    if status >= 400:
        raise EpisodePreflightError(f"episode preflight: GET {url} answered HTTP {status} (check the key variable)")
    try:
        document = loads_untrusted(body, what=f"GET {url}", max_bytes=MODEL_LIST_MAX_BYTES)
        listed = [str(item.get("id")) for item in document.get("data") or [] if isinstance(item, dict)]
    except (UntrustedInputError, AttributeError):
        raise EpisodePreflightError(f"episode preflight: GET {url} did not return a model list") from None
    if wanted not in listed:
        shown = ", ".join(listed[:10]) or "none"
        raise ModelNotListedError(
            f"episode preflight: endpoint {endpoint} does not serve model {wanted!r} (it lists: {shown})"
        )


# --- environment ------------------------------------------------------------------------------------------------


def agent_environment(
    config: CycleConfig,
    paths: AttemptPaths,
    *,
    agent_token: str,
    scope: str,
    path_value: str,
    sandbox: str = "none",
) -> dict[str, str]:
    """The complete environment of the agent process: an allow-list, nothing inherited but PATH.

    Thread limits and CUDA visibility follow the reference. The agent's only credential is its episode proxy token
    in `AGENT_TOKEN_ENV` (the variable settings.json's `envKey` names); the variable `inference.api_key_env` names
    is never set, so neither the key nor its name's value reaches the agent (never argv, never a file). `sandbox`
    (`EpisodeRunner.agent_sandbox`) goes to `SANDBOX_ENV`; in the bwrap sandbox the attempt's tmp folder is `/tmp`,
    and with `runtime.sandbox_egress: public` every proxy variable names the attempt's egress proxy (downloads), while
    `NO_PROXY` keeps the episode proxy on 127.0.0.1 direct.
    """
    runtime = config.runtime
    threads = str(runtime.thread_limit)
    env = {
        "PATH": path_value,
        "HOME": str(paths.home),
        "QWEN_HOME": str(paths.qwen_home),
        "TMPDIR": "/tmp" if sandbox == "bwrap" else str(paths.tmp),
        "LANG": "C.UTF-8",
        **dict.fromkeys(THREAD_LIMIT_VARS, threads),
        OPENMM_THREADS_VAR: threads,
        "LOKY_MAX_CPU_COUNT": str(2 * runtime.thread_limit),  # the reference pairs 2 threads with 4 loky workers
        "CUDA_VISIBLE_DEVICES": runtime.episode_cuda_visible_devices,
        "QWEN_STREAM_IDLE_TIMEOUT_MS": str(runtime.stream_idle_timeout_ms),
        # qwen-code 0.21 also caps a stream's whole lifetime (15 min by default); the per-response timeout is the
        # limit the reference sets for a response, so the lifetime cap must not cut a long generation earlier.
        "QWEN_STREAM_MAX_LIFETIME_MS": str(runtime.http_response_timeout_ms),
        "QWEN_TELEMETRY_ENABLED": "false",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
        "NO_PROXY": LOCAL_HOSTS,
        "no_proxy": LOCAL_HOSTS,
        SCOPE_ENV: scope,
        SANDBOX_ENV: sandbox,
        AGENT_TOKEN_ENV: agent_token,
    }
    if sandbox == "bwrap" and runtime.sandbox_egress == "public":
        egress = egress_url_in_sandbox()
        env |= dict.fromkeys(("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"), egress)
    key_name = config.inference.api_key_env
    if key_name in env:
        raise EpisodePreflightError(
            f"episode preflight: inference.api_key_env {key_name!r} collides with a variable the runtime sets"
        )
    return env


def environment_policy(env: Mapping[str, str], key_name: str) -> str:
    """Human-readable record of the agent environment: variable names, limits, never a credential."""
    shown = {name: value for name, value in env.items() if name not in (AGENT_TOKEN_ENV, "PATH", SCOPE_ENV)}
    settings = ", ".join(f"{name}={value}" for name, value in sorted(shown.items()))
    containment = {
        "bwrap": BWRAP_DESCRIPTION,
        "pod": "the episode pod's sandbox container",
    }.get(env.get(SANDBOX_ENV, "none"), "no sandbox: a process of the runner's user on the host network")
    return (
        f"{containment}; allow-listed environment; PATH inherited; no API key ({key_name} is held by the logging "
        f"proxy); per-episode proxy token in {AGENT_TOKEN_ENV} (value not recorded); {settings}"
    )


# --- secrets ----------------------------------------------------------------------------------------------------


class SecretRedactor:
    """Replaces every occurrence of the API key in files and folders the attempt produced (a second line of
    defence: the agent never holds the key; an empty secret makes the redactor inactive)."""

    def __init__(self, secret: str) -> None:
        encoded = secret.encode("utf-8")
        self._secret = encoded if len(encoded) >= MIN_REDACTED_SECRET and secret != DEFAULT_KEY_VALUE else b""

    @property
    def active(self) -> bool:
        return bool(self._secret)

    def file(self, path: Path) -> bool:
        """Redact `path` in place (temp file, then rename) if it holds the secret; returns whether it did."""
        if not self._secret or not path.is_file() or path.is_symlink() or not self._contains(path):
            return False
        mode = stat.S_IMODE(path.stat().st_mode)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".redact")
        try:
            with path.open("rb") as source, os.fdopen(fd, "wb") as target:
                for chunk in self._chunks(source):
                    target.write(chunk.replace(self._secret, REDACTION))
            os.chmod(temp, mode)
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        return True

    def tree(self, root: Path) -> list[str]:
        """Redact every regular file under `root` (links are not followed); returns the relative paths changed."""
        changed = []
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = Path(folder) / name
                with contextlib.suppress(OSError):
                    if self.file(path):
                        changed.append(str(path.relative_to(root)))
        return changed

    def _contains(self, path: Path) -> bool:
        with path.open("rb") as source:
            return any(self._secret in chunk for chunk in self._chunks(source))

    def _chunks(self, source: Any, size: int = 1 << 20) -> Iterator[bytes]:
        """The source's bytes in chunks such that every occurrence of the secret lies whole inside one chunk."""
        width = len(self._secret)
        carry = b""
        while block := source.read(size):
            data = carry + block
            # The last width-1 bytes may begin an occurrence that the next block completes: hold them back, unless
            # an occurrence straddles that cut, in which case the cut moves past it.
            cut = max(0, len(data) - (width - 1))
            start = data.find(self._secret, max(0, cut - width + 1), cut + width - 1)
            if start != -1 and start < cut:
                cut = start + width
            yield data[:cut]
            carry = data[cut:]
        if carry:
            yield carry


# --- process groups ---------------------------------------------------------------------------------------------


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_scope(scope: str) -> int:
    """SIGKILL every process whose environment carries `MASS_EPISODE_SCOPE=<scope>` (Linux /proc); returns count.

    Catches what left the agent's process group (`setsid`, daemonizing tools) but kept the inherited environment.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    marker = f"{SCOPE_ENV}={scope}".encode()
    killed = 0
    for _round in range(5):  # a dying parent can fork once more; a few rounds settle it
        found = 0
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
        killed += found
        if not found:
            break
        time.sleep(0.05)
    return killed


# --- workspace seeds --------------------------------------------------------------------------------------------


def fetch_workspace_seed(store: Any, seed: WorkspaceSeed, dest: Path) -> None:
    """Download the seed archive to `dest`, checked against its SHA-256; `WorkspaceSeedError` (one line) when the
    store does not hold it or holds other bytes. `store` is the context's: in an episode pod, the hand-off's."""
    try:
        store.get_file(store.key_of(seed.uri), dest, sha256=seed.sha256)
    except ArtifactKeyError as exc:
        raise WorkspaceSeedError(f"workspace seed: {exc}") from None
    except ArtifactNotFoundError:
        raise WorkspaceSeedError(f"workspace seed {seed.uri} does not exist") from None
    except ArtifactError as exc:
        raise WorkspaceSeedError(f"workspace seed {seed.uri}: {_first_line(exc)}") from None


def extract_workspace_seed(
    archive: Path,
    workspace: Path,
    seed: WorkspaceSeed,
    *,
    max_entries: int = SEED_MAX_ENTRIES,
    max_bytes: int = SEED_MAX_BYTES,
) -> int:
    """Extract the seed archive (a tar.gz) into the empty folder `workspace`, all or nothing; returns its number of
    members. Refused with one line (`WorkspaceSeedError`), nothing extracted: bytes other than `seed.sha256`, more
    than `max_entries` members or `max_bytes` bytes or the platform's bytes-per-archive-byte limit, or a member that
    could write or point outside (`store.untrusted.extract_tar_gz`, the one extractor of every archive)."""
    where = f"workspace seed {seed.uri}"
    sha256, _size = file_sha256(archive)
    if sha256 != seed.sha256:
        raise WorkspaceSeedError(f"{where}: its bytes have SHA-256 {sha256[:12]}…, not {seed.sha256[:12]}…")
    if any(workspace.iterdir()):
        raise WorkspaceSeedError(f"{where}: the workspace {workspace} is not empty")
    # The platform's one archive extractor and its limits (count, bytes, ratio), checked as each header is read.
    limits = dataclasses.replace(ARCHIVE_LIMITS, max_entries=max_entries, max_bytes=max_bytes)
    scratch = workspace.with_name(f".{workspace.name}.seed")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        try:
            entries = extract_tarball(archive, scratch, uri=where, limits=limits)
        except ArtifactFormatError as exc:  # UnsafeArchiveError too: a member that could leave the folder
            raise WorkspaceSeedError(_first_line(exc)) from None
        for entry in sorted(scratch.iterdir()):
            os.rename(entry, workspace / entry.name)
    except BaseException:
        # All or nothing: what was moved already goes too, so the workspace is empty again.
        for entry in list(workspace.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                _remove_tree(entry)
            else:
                entry.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return entries


def lease_host() -> str:
    """Where a local attempt runs, as its lease names it (`status`: "started 3m ago on <host> pid <pid>")."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# --- the runner -------------------------------------------------------------------------------------------------


class EpisodeRunner:
    """Runs single attempts of episode units of one cycle (see module docstring). Safe to share between tasks."""

    def __init__(
        self,
        ctx: CycleContext,
        *,
        install: QwenInstall | None = None,
        scratch_dir: Path | str | None = None,
        environ: Mapping[str, str] | None = None,
        keep_scratch: bool = False,
        kill_grace_s: float = 5.0,
        execution_mode: str = EXECUTION_MODE,
        sink: PublicationSink | None = None,
        lease_renew_s: float = LEASE_RENEW_S,
        proxy_sessions: ProxySessions | None = None,
    ) -> None:
        self.ctx = ctx
        self.lease_renew_s = lease_renew_s  # how often a running attempt renews its lease (`status`: alive)
        self.sink: PublicationSink = sink or StoreSink(ctx)
        self.config = ctx.config
        self._install = install  # resolved on first use: a pool that only reuses finished units needs no agent
        configured = scratch_dir or os.environ.get(SCRATCH_ENV)
        self.scratch_dir = Path(configured) if configured else Path(tempfile.gettempdir()) / "mass-episodes"
        self.environ = dict(os.environ if environ is None else environ)
        self.keep_scratch = keep_scratch
        self.kill_grace_s = kill_grace_s
        self.execution_mode = execution_mode
        self._install_lock = threading.Lock()
        self._warned_unsandboxed = False
        # In a Kubernetes episode pod the proxy (and the key) live in another container, and only the publisher
        # reaches its control: it opens each attempt's session (`mass_ops.runtime.handoff`).
        self.proxy_sessions = proxy_sessions
        # One ledger for every attempt of this runner: requests in flight in this process count against the budgets.
        self.budgets = BudgetLedger(ctx.repo, ctx.cycle_id, BudgetLimits.from_mapping(self.config.budgets.model_dump()))

    def budget_scopes(self, unit: EpisodeUnit) -> tuple[str, ...]:
        """The shared budget scopes an episode of `unit` spends from: its task's and the cycle's."""
        return (task_scope(unit.task_id), CYCLE_SCOPE)

    def _episode_budget(self, unit: EpisodeUnit) -> EpisodeBudget | None:
        """What the attempt's proxy enforces (None when no budget applies: the proxy then checks nothing)."""
        episode_tokens = self.config.budgets.episode_tokens
        if episode_tokens is None and not self.budgets.limits.limited(self.budget_scopes(unit)):
            return None
        return EpisodeBudget(
            episode_tokens=episode_tokens,
            default_max_tokens=self.config.inference.episode_max_output_tokens,
            ledger=self.budgets,
            scopes=self.budget_scopes(unit),
        )

    @property
    def install(self) -> QwenInstall:
        """The agent runtime: the given one, else the pinned qwen-code (installed on first use)."""
        with self._install_lock:
            if self._install is None:
                self._install = ensure_qwen_code()
            return self._install

    @property
    def agent_sandbox(self) -> str:
        """How the agent is contained: "pod" (a Kubernetes episode pod: the pod is the sandbox), "bwrap" (the local
        bubblewrap sandbox, `mass_ops.compute.sandbox`) or "none" (`runtime.sandbox` none, or bwrap unavailable)."""
        if self.proxy_sessions is not None:
            return "pod"
        if self.config.runtime.sandbox == "bwrap" and bwrap_support().available:
            return "bwrap"
        return "none"

    def _refuse_unsandboxed(self, api_key: str) -> None:
        """A local agent without a sandbox can read this process's environment and reach every local service: with
        a real key that needs `runtime.allow_unsandboxed_agent` (the placeholder key of a keyless local server, as in
        the demo, does not). Raises `EpisodePreflightError` (one line)."""
        runtime = self.config.runtime
        if self.agent_sandbox != "none":
            return
        why = "runtime.sandbox is none" if runtime.sandbox == "none" else bwrap_support().reason
        if api_key != DEFAULT_KEY_VALUE and not runtime.allow_unsandboxed_agent:
            raise EpisodePreflightError(
                f"episode preflight: the agent would run without a sandbox ({why}) while "
                f"{self.config.inference.api_key_env} holds a real API key; install bubblewrap, or set "
                "runtime.allow_unsandboxed_agent=true to run it unsandboxed"
            )
        if not self._warned_unsandboxed:
            self._warned_unsandboxed = True
            logger.warning("episode agents run without a sandbox (%s)", why)

    # -- preflight --

    async def preflight(self) -> str | None:
        """Check key and endpoint; returns the key value, or None in a pod, where the proxy holds the key and the
        publisher checks the endpoint when it opens each attempt's session (raises `EpisodePreflightError`)."""
        if self.proxy_sessions is None:
            api_key = resolve_api_key(self.config, self.environ)
            await asyncio.to_thread(bwrap_support)  # probes once per process: off the loop
            self._refuse_unsandboxed(api_key)
            await check_endpoint(self.config, api_key)
            return api_key
        return None

    @contextlib.asynccontextmanager
    async def _episode_proxy(
        self,
        paths: AttemptPaths,
        upstream: str,
        api_key: str | None,
        unit: EpisodeUnit,
        counted: list[UsageCounter],
        egress: dict[str, int],
    ) -> AsyncIterator[Any]:
        """The attempt's proxy: yields (base URL, agent token); when it ends, `paths.api_log` holds its whole log and
        `counted` the proxy's own counter of the attempt's usage. A sandboxed attempt with `runtime.sandbox_egress:
        public` also gets its egress proxy, whose counts land in `egress` when it has stopped."""
        if self.proxy_sessions is None:
            token = new_agent_token()
            proxy = LoggingProxy(
                upstream,
                paths.api_log,
                agent_token=token,
                upstream_api_key=api_key,
                budget=self._episode_budget(unit),
                request_priority=episode_server_priority(self.config, unit.kind, unit.version),
                client_path=_split_endpoint(self.config.inference.endpoint)[1],
                max_request_bytes=self.config.runtime.proxy_max_request_bytes,
            )
            counted.append(proxy.usage)  # complete once the proxy has stopped
            if self.agent_sandbox == "bwrap":
                # The sandboxed agent has its own network: it reaches this proxy only through the Unix socket in a
                # folder its sandbox mounts, bridged inside to the URL it is given (nothing listens on host TCP).
                socket_dir = proxy_socket_dir(paths.root)
                socket_path = await asyncio.to_thread(create_socket_dir, socket_dir)
                outbound = None
                if self.config.runtime.sandbox_egress == "public":
                    outbound = EgressProxy(ports=self.config.runtime.sandbox_egress_ports)
                try:
                    await proxy.start(unix_socket=socket_path)
                    try:
                        if outbound is not None:
                            await outbound.start(socket_dir / EGRESS_SOCKET_NAME)
                        yield proxy_url_in_sandbox(), token
                    finally:
                        if outbound is not None:
                            await outbound.stop()
                            egress.update(outbound.counts.as_dict())
                        await proxy.stop()
                finally:
                    await asyncio.to_thread(remove_socket_dir, socket_dir)
                return
            await proxy.start()
            try:
                yield proxy.url, token
            finally:
                await proxy.stop()
            return
        # The publisher derives the upstream and the budget itself: nothing this container says chooses them.
        session = await self.proxy_sessions.open(unit)
        try:
            yield session.proxy_url, session.token
        finally:
            counted.append(UsageCounter(await self.proxy_sessions.close(session, paths.api_log)))

    # -- one attempt --

    async def run_attempt(
        self,
        request: EpisodeRequest,
        attempt: int,
        *,
        retry_of_id: int | None = None,
        on_agent_exit: Callable[[], None] | None = None,
    ) -> EpisodeOutcome:
        """Run attempt `attempt` of `request`'s unit and record it; see the module docstring for the steps.

        `on_agent_exit` is called once the agent and its proxy have stopped, before publishing: from then on the
        attempt no longer loads the endpoint (the pool frees its capacity slot there).
        """
        unit = dataclasses.replace(request.unit, attempt=attempt)
        api_key = await self.preflight()
        install = await asyncio.to_thread(lambda: self.install)  # may run npm the first time: off the loop
        started_at = datetime.now(UTC)
        await asyncio.to_thread(self._lease, "start", unit, started_at)
        renewing = asyncio.create_task(self._renew_lease(unit))
        try:
            return await self._attempt(request, unit, install, api_key, started_at, retry_of_id, on_agent_exit)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            # The row is recorded (or the attempt died without one): the unit is no longer in flight.
            await asyncio.to_thread(self._lease, "end", unit, None)

    async def _renew_lease(self, unit: EpisodeUnit) -> None:
        """Renew the attempt's lease every `lease_renew_s` while it lives: a runner that dies stops renewing, and its
        lease lapses (`LEASE_LAPSE_S`) even when the attempt has no time limit."""
        while True:
            await asyncio.sleep(self.lease_renew_s)
            await asyncio.to_thread(self._lease, "renew", unit, None)

    def _lease(self, action: str, unit: EpisodeUnit, started_at: datetime | None) -> None:
        """Start or end the attempt's lease (what `status` shows as running; `mass_ops.stages.leases`). In a pod the
        repository is the hand-off's stand-in, which does nothing: the operator and the publisher hold the lease.
        A store failure is logged: a lease only feeds `status`, and an episode never fails for it."""
        identity = unit.identity()
        try:
            if action == "start":
                self.ctx.repo.start_episode_lease(
                    self.ctx.cycle_id,
                    attempt=unit.attempt,
                    host=lease_host(),
                    started_at=started_at,
                    renewed=True,
                    **identity,
                )
            elif action == "renew":
                self.ctx.repo.renew_episode_lease(self.ctx.cycle_id, attempt=unit.attempt, **identity)
            else:
                self.ctx.repo.end_episode_lease(self.ctx.cycle_id, attempt=unit.attempt, **identity)
        except SQLAlchemyError as exc:
            logger.warning("episode %s: could not %s its lease: %s", unit.key, action, _first_line(exc))

    async def _attempt(
        self,
        request: EpisodeRequest,
        unit: EpisodeUnit,
        install: QwenInstall,
        api_key: str | None,
        started_at: datetime,
        retry_of_id: int | None,
        on_agent_exit: Callable[[], None] | None,
    ) -> EpisodeOutcome:
        """The leased part of `run_attempt`: the attempt folder, the proxy, the agent, then publishing."""
        attempt = unit.attempt
        clock = time.monotonic()
        async with self._attempt_folder(unit, request.prompt) as paths:
            if request.workspace_seed is not None:
                await asyncio.to_thread(self._seed_workspace, request.workspace_seed, paths)
            upstream, client_path = _split_endpoint(self.config.inference.endpoint)
            counted: list[UsageCounter] = []
            egress: dict[str, int] = {}
            async with self._episode_proxy(paths, upstream, api_key, unit, counted, egress) as (proxy_url, agent_token):
                client_endpoint = f"{proxy_url}{client_path}"
                settings = qwen_settings(self.config, client_base_url=client_endpoint, seed=unit.seed)
                write_settings(paths.settings, settings)
                write_settings(paths.settings_record, settings)
                scope = f"{unit.slug}-a{attempt}-{secrets.token_hex(6)}"
                env = agent_environment(
                    self.config,
                    paths,
                    agent_token=agent_token,
                    scope=scope,
                    path_value=self.environ.get("PATH", os.defpath),
                    sandbox=self.agent_sandbox,
                )
                setup_s = time.monotonic() - clock
                logger.info("episode %s attempt %d: agent starting in %s", unit.slug, attempt, paths.workspace)
                agent = await self._run_agent(install, paths, env, scope)
            if on_agent_exit is not None:
                on_agent_exit()
            finished_at = datetime.now(UTC)
            abort = threading.Event()
            work = asyncio.ensure_future(
                asyncio.to_thread(
                    self._finish,
                    request,
                    unit,
                    paths,
                    agent,
                    api_key,
                    retry_of_id=retry_of_id,
                    started_at=started_at,
                    finished_at=finished_at,
                    client_endpoint=client_endpoint,
                    env_policy=environment_policy(env, self.config.inference.api_key_env),
                    durations={"setup_s": setup_s, "agent_s": agent.duration_s},
                    usage=counted[0].totals(),
                    egress=egress,
                    abort=abort,
                )
            )
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # The publishing thread cannot be interrupted: tell it to stop before the row, wait for it (it reads
                # the folder we are about to delete), then let the cancellation through.
                abort.set()
                with contextlib.suppress(BaseException):
                    await work
                raise

    def _seed_workspace(self, seed: WorkspaceSeed, paths: AttemptPaths) -> None:
        """Fetch the request's seed through the context's store and extract it into the fresh workspace."""
        archive = paths.root / "workspace-seed.tar.gz"
        try:
            fetch_workspace_seed(self.ctx.artifacts, seed, archive)
            count = extract_workspace_seed(archive, paths.workspace, seed)
        finally:
            archive.unlink(missing_ok=True)
        logger.info("episode workspace seeded from %s (%d entries, sha256 %s…)", seed.uri, count, seed.sha256[:12])

    @contextlib.asynccontextmanager
    async def _attempt_folder(self, unit: EpisodeUnit, prompt: str) -> AsyncIterator[AttemptPaths]:
        """The attempt's folder, locked against a second run of the same attempt, removed at the end.

        Filesystem work runs on worker threads: removing a workspace with thousands of files must not stall the
        event loop that relays every other episode's stream.
        """
        root = self.scratch_dir / unit.cycle / f"{unit.slug}-a{unit.attempt}"
        lock = await asyncio.to_thread(_lock_attempt, root, unit.key)
        try:
            paths = AttemptPaths(root)
            await asyncio.to_thread(_fresh_attempt_folder, paths, prompt)
            try:
                yield paths
            finally:
                if not self.keep_scratch:
                    await asyncio.to_thread(_remove_tree, root)
        finally:
            lock.release()

    async def _run_agent(self, install: QwenInstall, paths: AttemptPaths, env: dict[str, str], scope: str) -> AgentRun:
        argv = install.argv(
            "--model", self.config.models.served_name, "--approval-mode", "yolo", "--output-format", "stream-json"
        )
        bwrap = bwrap_support().bwrap if self.agent_sandbox == "bwrap" else None
        if bwrap is not None:
            # Everything of the attempt lives in the sandbox's PID namespace: killing bwrap (its session's leader
            # below) or the agent's end takes every process of the attempt with it.
            argv = sandboxed_argv(
                argv,
                bwrap=bwrap,
                workspace=paths.workspace,
                home=paths.home,
                tmp=paths.tmp,
                socket_dir=proxy_socket_dir(paths.root),
                runtime=runtime_paths(install.node_bin, install.qwen_entry),
                egress=self.config.runtime.sandbox_egress == "public",
            )
        limit = self.config.runtime.episode_wall_clock_s
        started = time.monotonic()
        with paths.prompt.open("rb") as stdin, paths.stream.open("wb") as stdout, paths.stderr.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=paths.workspace,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: one signal reaches shells and subagents too
            )
        terminated_by = None
        try:
            # No limit (None) waits for the agent however long it runs, as the reference does.
            await asyncio.wait_for(process.wait(), timeout=limit)
        except TimeoutError:
            terminated_by = "wall_clock"
            logger.warning("episode agent pid %d exceeded the wall-clock limit of %d s: stopping", process.pid, limit)
            await self._stop_group(process)
        except BaseException:
            await self._stop_group(process)
            raise
        finally:
            # Background jobs the agent left running belong to the episode and end with it.
            _signal_group(process.pid, signal.SIGKILL)
            await asyncio.to_thread(kill_scope, scope)
        return AgentRun(process.returncode, terminated_by, time.monotonic() - started)

    async def _stop_group(self, process: asyncio.subprocess.Process) -> None:
        """TERM the agent's process group, KILL it after the grace period (or if interrupted meanwhile)."""
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=self.kill_grace_s)
        except TimeoutError:
            pass
        finally:
            _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), timeout=self.kill_grace_s)

    # -- after the agent: classify, then hand the publication to the sink (blocking I/O, on a worker thread) --

    def _finish(
        self,
        request: EpisodeRequest,
        unit: EpisodeUnit,
        paths: AttemptPaths,
        agent: AgentRun,
        api_key: str | None,
        *,
        retry_of_id: int | None,
        started_at: datetime,
        finished_at: datetime,
        client_endpoint: str,
        env_policy: str,
        durations: dict[str, float],
        usage: UsageTotals,
        egress: dict[str, int],
        abort: threading.Event,
    ) -> EpisodeOutcome:
        publication = self._publication(
            request,
            unit,
            paths,
            agent,
            api_key,
            retry_of_id=retry_of_id,
            started_at=started_at,
            finished_at=finished_at,
            client_endpoint=client_endpoint,
            env_policy=env_policy,
            durations=durations,
            usage=usage,
            egress=egress,
        )
        try:
            return self.sink.deliver(publication, abort)
        except PublishAborted:
            raise asyncio.CancelledError from None

    def _publication(
        self,
        request: EpisodeRequest,
        unit: EpisodeUnit,
        paths: AttemptPaths,
        agent: AgentRun,
        api_key: str | None,
        *,
        retry_of_id: int | None,
        started_at: datetime,
        finished_at: datetime,
        client_endpoint: str,
        env_policy: str,
        durations: dict[str, float],
        usage: UsageTotals,
        egress: dict[str, int] | None = None,
    ) -> EpisodePublication:
        """Redact the key, classify and write the status document: what the attempt publishes. `usage` is what the
        proxy counted (the row's counts); the log is read for classification only. `egress` is the egress proxy's
        counts, recorded when the attempt had one."""
        redactor = SecretRedactor(api_key or "")
        if redactor.active:
            changed = [
                name
                for name, path in (("stream", paths.stream), ("stderr", paths.stderr), ("api_log", paths.api_log))
                if redactor.file(path)
            ]
            changed += [f"workspace/{name}" for name in redactor.tree(paths.workspace)]
            if changed:
                logger.warning("episode %s: redacted the API key from %s", unit.key, ", ".join(changed))
        records = _read_proxy_log(paths.api_log)
        _gzip(paths.api_log, paths.api_log_gz)
        transcript = Transcript.parse(paths.stream.read_text(encoding="utf-8", errors="replace"))
        limits = self.config.runtime
        classification = classify(
            transcript,
            records,
            backend=self.config.inference.backend,
            terminated_by=agent.terminated_by,
            wall_clock_s=limits.episode_wall_clock_s,
        )
        store = self.ctx.artifacts
        context = StatusContext(
            unit_key=unit.key,
            attempt=unit.attempt,
            condition=request.condition,
            seed=unit.seed,
            model=self.config.models.served_name,
            endpoint=self.config.inference.endpoint,
            client_endpoint=client_endpoint,
            qwen_code_version=self.install.version,
            exit_code=agent.exit_code,
            started_at=started_at,
            finished_at=finished_at,
            prompt_source=store.uri(unit.artifact_key("prompt")),
            api_log=store.uri(unit.artifact_key("api_log")),
            api_requests=len(records),
            env_policy=env_policy,
            operational_limits={
                "http_response_timeout_ms": limits.http_response_timeout_ms,
                "foreground_shell_timeout_ms": limits.shell_timeout_ms,
                "context_window_tokens": self.config.inference.context_window_tokens,
                "max_tokens_per_model_response": self.config.inference.episode_max_output_tokens,
                "stream_idle_timeout_ms": limits.stream_idle_timeout_ms,
                "episode_wall_clock_s": limits.episode_wall_clock_s,
            },
            durations={**durations, "total_s": (finished_at - started_at).total_seconds()},
            terminated_by=agent.terminated_by,
            execution_mode=self.execution_mode,
        )
        # Whatever the agent left (a `chmod 000`) must not break the workspace tarball.
        _make_readable(paths.workspace)
        status = status_record(context, classification, usage)
        if request.workspace_seed is not None:
            # Which files the agent started from: the workspace is the seed plus the agent's work.
            status["workspace_seed"] = request.workspace_seed.as_dict()
        if egress:
            status["egress"] = egress  # connections, refused, bytes_up, bytes_down (mass_ops.compute.egress)
        return EpisodePublication(
            request=request,
            unit=unit,
            files=AttemptFiles.of_attempt(paths),
            status=status,
            record=EpisodeRecord(
                status=classification.status,
                model=context.model,
                exit_code=context.exit_code,
                failure=classification.failure,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                requests=usage.requests,
                max_prompt_tokens=usage.max_prompt_tokens,
                started_at=started_at,
                finished_at=finished_at,
                qwen_code_version=context.qwen_code_version,
                cached_prompt_tokens=usage.cached_prompt_tokens,
            ),
            retry_of_id=retry_of_id,
        )


# --- publishing: artifacts first, the row last ------------------------------------------------------------------


class PublicationSink(Protocol):
    """Where a finished attempt goes: published at once (`StoreSink`), or handed to a publisher container
    (`mass_ops.runtime.handoff.HandoffSink`). Returns the attempt's recorded outcome."""

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome: ...


class StoreSink:
    """Publishes each attempt to the cycle's own stores (the local backend, and whoever holds the credentials)."""

    def __init__(self, ctx: CycleContext) -> None:
        self.ctx = ctx
        self.limits = BudgetLimits.from_mapping(ctx.config.budgets.model_dump())

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome:
        outcome = publish_episode(self.ctx, publication, abort)
        task = publication.unit.task_id
        if not self.limits.limited((task_scope(task), CYCLE_SCOPE)):
            # The attempt's proxy recorded nothing in the ledger (it reads the store only for limited scopes): charge
            # the whole attempt now, so the cycle's spend counts every episode, as a pod's publisher does.
            record = publication.record
            charge_episode(self.ctx.repo, self.ctx.cycle_id, task, charge_key=f"episode:{outcome.episode_id}",
                           tokens=record.prompt_tokens + record.completion_tokens,
                           requests=record.requests)  # fmt: skip
        return outcome


def publish_episode(
    ctx: CycleContext, publication: EpisodePublication, abort: threading.Event | None = None
) -> EpisodeOutcome:
    """Publish every artifact of the attempt (atomically, the status document last), then record its row.

    Idempotent: artifacts of a unit attempt have fixed keys, and recording an attempt that another process already
    recorded returns that row (see `record_publication`). `abort` stops between artifacts, before the row.
    """
    artifacts = publish_artifacts(ctx.artifacts, publication, abort)
    if abort is not None and abort.is_set():
        raise PublishAborted
    return record_publication(ctx, publication, artifacts)


def publish_artifacts(
    store: ArtifactStore, publication: EpisodePublication, abort: threading.Event | None = None
) -> dict[str, ArtifactInfo]:
    """Every artifact of the attempt, each published atomically, in `PUBLISH_ORDER`; returns name → what was
    published (URI and SHA-256, both recorded in the episode's row)."""
    files, unit = publication.files, publication.unit

    def put_workspace(key: str) -> ArtifactInfo:
        if files.workspace_archived:
            return store.put_file(key, files.workspace)
        return store.put_dir(key, files.workspace, skip_escaping_links=True)

    puts: dict[str, Callable[[str], ArtifactInfo]] = {
        "workspace": put_workspace,
        "prompt": lambda key: store.put_file(key, files.prompt),
        "stream": lambda key: store.put_file(key, files.stream),
        "stderr": lambda key: store.put_file(key, files.stderr),
        "api_log": lambda key: store.put_file(key, files.api_log),
        "settings": lambda key: store.put_file(key, files.settings),
        "status": lambda key: store.put_json(key, publication.status),
    }
    published = {}
    for name in PUBLISH_ORDER:
        if abort is not None and abort.is_set():
            raise PublishAborted
        published[name] = puts[name](unit.artifact_key(name))
    return published


def record_publication(
    ctx: CycleContext, publication: EpisodePublication, published: Mapping[str, ArtifactInfo]
) -> EpisodeOutcome:
    """Commit the attempt's row (after its artifacts are durable) and return the recorded outcome."""
    request, unit, record = publication.request, publication.unit, publication.record
    row = ctx.repo.record_episode(
        ctx.cycle_id,
        task_id=unit.task_id,
        kind=unit.kind,
        seed=unit.seed,
        status=record.status,
        attempt=unit.attempt,
        version=unit.version,
        candidate=unit.candidate,
        generation=request.generation,
        condition=request.condition,
        model=record.model,
        exit_code=record.exit_code,
        failure=record.failure,
        prompt_sha256=request.prompt_sha256,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        requests=record.requests,
        max_prompt_tokens=record.max_prompt_tokens,
        started_at=record.started_at,
        finished_at=record.finished_at,
        duration_s=(record.finished_at - record.started_at).total_seconds(),
        artifacts={name: info.uri for name, info in published.items()},
        artifact_sha256={name: info.sha256 for name, info in published.items()},
        qwen_code_version=record.qwen_code_version,
        retry_of_id=publication.retry_of_id,
        cached_prompt_tokens=record.cached_prompt_tokens,
    )
    status = publication.status
    recorded_at = row.started_at or record.started_at
    if row.status != record.status or abs((recorded_at - record.started_at).total_seconds()) > 0.001:
        # Another process recorded this attempt first (same key): its row is the truth, report that one.
        logger.warning("episode %s was recorded by another run (%s); using that record", unit.key, row.status)
        status = ctx.artifacts.get_json(unit.artifact_key("status"))
    logger.info(
        "episode %s: %s (requests=%d prompt_tokens=%d completion_tokens=%d)",
        unit.key,
        row.status,
        record.requests,
        record.prompt_tokens,
        record.completion_tokens,
        extra={"episode": {"key": unit.key, "status": row.status, "episode_id": row.id}},
    )
    return EpisodeOutcome(
        request=request,
        episode_id=row.id,
        attempt=row.attempt,
        status=cast(EpisodeStatus, row.status),  # the row was written from an EpisodeStatus
        status_record=status,
        artifacts=dict(row.artifacts or {}),
    )


class _AttemptLock:
    """An exclusive `flock` on `.<attempt folder>.lock` beside the attempt folder."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path = path
        self._handle = handle

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
        self._handle.close()


def _lock_attempt(root: Path, unit_key: str) -> _AttemptLock:
    root.parent.mkdir(parents=True, exist_ok=True)
    path = root.with_name(f".{root.name}.lock")
    handle = open(path, "a")  # noqa: SIM115 - held open until release()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise EpisodeBusyError(
            f"episode {unit_key}: this attempt is already running in another process ({root})"
        ) from None
    return _AttemptLock(path, handle)


def _fresh_attempt_folder(paths: AttemptPaths, prompt: str) -> None:
    # We hold the lock, so no live run owns a leftover folder: it is the scratch of an attempt that crashed before
    # its row, which makes it no evidence of anything. Start clean.
    _remove_tree(paths.root)
    paths.create()
    paths.prompt.write_text(prompt, encoding="utf-8")


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    """`https://host:port/api/v1` → (`https://host:port`, `/api/v1`): the proxy's upstream and the client path."""
    parts = urlsplit(endpoint.rstrip("/"))
    return f"{parts.scheme}://{parts.netloc}", parts.path


def _read_proxy_log(path: Path) -> list[dict[str, Any]]:
    """The fields of each proxy record that classification and accounting read (bodies are not kept in memory)."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = loads_untrusted(line, what=str(path), max_bytes=len(line), max_depth=None)
            except UntrustedInputError:
                continue
            if not isinstance(record, dict):
                continue
            response = record.get("response")
            summary = (
                {"usage": response.get("usage"), "error": response.get("error")} if isinstance(response, dict) else None
            )
            records.append(
                {
                    "seq": record.get("seq"),
                    "path": record.get("path"),
                    "status": record.get("status"),
                    "proxy_error": record.get("proxy_error"),
                    "response": summary,
                    "budget_exhausted": record.get("budget_exhausted"),
                }
            )
    return records


def _gzip(source: Path, target: Path) -> None:
    """gzip -6 of the proxy log (an empty log still gives a valid, empty archive)."""
    with gzip.open(target, "wb", compresslevel=6) as out:
        if source.exists():
            with source.open("rb") as handle:
                shutil.copyfileobj(handle, out, 1 << 20)


def _make_readable(root: Path) -> None:
    """Give the owner read access to everything the agent left (a `chmod 000` must not break the tarball)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            path = Path(folder) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IRWXU)
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IRUSR | stat.S_IWUSR)


def _remove_tree(root: Path) -> None:
    if not root.exists():
        return
    _make_readable(root)
    shutil.rmtree(root, ignore_errors=True)
