"""The hand-off between the two containers of a Kubernetes episode pod: the sandbox runs, the publisher publishes.

Why two containers: the agent runs model-written shell commands (yolo mode) as the sandbox container's user, and that
user can read the environment of every process in its container (`/proc/<pid>/environ`). So the sandbox container
holds the inference key and nothing else; the artifact-store and metadata-DB credentials live in the pod's second
container, the publisher, which shares one emptyDir with the sandbox and nothing more (in particular no process
namespace: `shareProcessNamespace` must stay off, or the agent could read the publisher's environment).

The folder, each file written atomically (temporary name, then rename) and by one side only:

    prompt.txt                 publisher  the prompt of the pod's unit, when the publisher was given one (`--prompt-uri
                                          --prompt-sha256`): fetched from the store and checked against the hash the
                                          operator computed, written first; the sandbox waits for it, then reads it
    workspace-seed.tar.gz      publisher  a benchmark task's starting files, when the publisher was given a seed
                                          (`--workspace-seed-uri --workspace-seed-sha256`): fetched from the cycle's
                                          seed artifact of that hash, checked, written before prompt.txt; the
                                          sandbox's runner extracts it (through `LedgerArtifacts.get_file`)
    request.json               sandbox    the units it will run (identity, condition, prompt hash) and the config hash,
                                          written before any agent starts; the publisher captures it at once
    ledger.json                publisher  each unit's recorded attempts (reuse, or which attempt comes next), the
                                          store URL, and for a rollout the server of the generation it evaluates
    sandbox.alive              sandbox    heartbeat (its mtime) while `mass-ops episode run` lives
    publisher.alive            publisher  heartbeat while `mass-ops episode publish` lives
    attempts/<slug>/a<N>/      sandbox    one finished attempt in stored form (workspace.tar.gz, prompt.txt, ...); built
                                          under a temporary name with `publication.json` (status document and row
                                          fields) written last, then renamed: a folder under its final name is whole
    acks/<slug>-a<N>.json      publisher  that attempt's recorded outcome (episode id, artifact URIs), or its error
    sessions/<id>.open         sandbox    the runner asks for the proxy session of attempt N (id: <slug>-a<N>-t<try>)
    sessions/<id>.session.json publisher  the answer: the agent's proxy URL and token, or why not (and if transient)
    sessions/<id>.close        sandbox    the agent has ended: close the session
    sessions/<id>.log          publisher  a copy of the closed session's log, for the runner's classification
    sessions/<id>.closed.json  publisher  the proxy's own record count and usage counters of the closed session
    complete.json              sandbox    the marker, written last: `episode run` has ended, with its exit status
    publisher-failed.json      publisher  the publisher gave up (one line): the sandbox stops waiting

Sequence: the publisher writes prompt.txt when it has a prompt to deliver (the sandbox, which reaches no store, cannot
fetch it); the sandbox reads its prompt, writes request.json and waits for the ledger; its `EpisodePool` plans from
the ledger as it would from the database; each finished attempt is handed over (`HandoffSink`) and the sandbox waits
for its ack. So, as with local publishing, an attempt's artifacts and row are durable before the next attempt of that
unit starts, and the retry links to the real row. The publisher (`HandoffPublisher`) publishes each attempt with the
runner's own `publish_episode` — artifacts first, the row last, idempotent — and stops once complete.json is there and
every handed-over attempt is acknowledged.

Trust: the runner shares the sandbox container with the agent, so everything in this folder is the agent's to write,
swap or delete. The publisher takes every attempt's identity from request.json as read before any agent ran, derives
every artifact key itself (the delivered prompt's too: a URI other than the cycle's prompt artifact of that hash is
refused), refuses a request announcing another prompt than the one it delivered, and checks each attempt's prompt
against the announced hash. It opens every file it reads or uploads once, below the folder, without following a link
(`mass_ops.store.untrusted.open_beneath`): a regular file with one link, checked on the descriptor and read or
uploaded from that descriptor, so a name swapped for a link after a check, or a hard link to a file elsewhere,
publishes nothing but the agent's own bytes. A hand-off that ends without its marker (the sandbox container died) is
refused with one line, and nothing of an unfinished attempt is published.

Proxy sessions (`--proxy-control`, the pod's `SessionProxy`): the proxy's control socket and session logs lie in a
volume the sandbox does not mount, and only the publisher opens sessions: for an announced unit, at its next
attempt, one per attempt (so at most one open per unit), towards the upstream the publisher derives itself (the
ledger's rollout server, the benchmark's `--endpoint`, else the configured endpoint) after checking that endpoint
through the proxy (the preflight), with the episode's token budget. The ledger says so (`proxy_sessions`), and the
runner then asks for its session in sessions/. The publisher closes a session when the runner asks or, at the
latest, when its attempt is handed over, and publishes that session's log as the proxy wrote it, with the row's
`requests` and token counts (and the status document's `usage` and `api_requests`) from the proxy's own counters.
What the agent writes here can change neither. The rest of what an attempt measured (status, files) is the
sandbox's word — as much as under local publishing, where the agent shares the runner's user too.

Budgets: the pod's proxy holds only the episode's token budget (it reaches no store; the publisher sets it on each
session it opens). The ledger carries the announced units' task and cycle spend as the publisher read it, which the
sandbox's pool checks before each attempt as it would the store; and the publisher charges each attempt's tokens
and server-reported cost to its task and the cycle on every ingest of the attempt, keyed by the attempt's row: the
charge's marker commits with the increments (`budget_charges`), so a retried ingest — even one after a publisher
killed between the row and the charge — adds the spend exactly once. A proxy session whose attempt has no row when
the sandbox ends (the agent stopped its runner before the hand-over) is charged too, keyed by the session.

Leases (`mass-ops status`): the operator that created the pod leased its unit's next attempt; the publisher ends the
lease when it ingests an attempt (recorded or not), and every announced unit's once the sandbox has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import hashlib
import itertools
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar, cast
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    StringConstraints,
    ValidationError,
)

from mass_ops.compute.kubernetes import EpisodeServer, proxy_upstream
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, load_task_catalogue
from mass_ops.errors import InfrastructureError
from mass_ops.layout import BENCHMARK_TASK_NAME, EPISODE_FILES, HANDOFF_PROMPT_FILE, EpisodeKind, EpisodeUnit
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, EpisodeStatus, WorkspaceSeed, workspace_seed_key
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.proxy import ProxySessionError, usage_cost
from mass_ops.runtime.runner import (
    AttemptFiles,
    AttemptSession,
    EndpointUnreachableError,
    EpisodePreflightError,
    EpisodePublication,
    EpisodeRecord,
    PublishAborted,
    check_endpoint,
    publish_episode,
)
from mass_ops.runtime.runner import _read_proxy_log as read_proxy_log  # the one reader of a proxy log's records
from mass_ops.runtime.session_proxy import (
    ClosedSession,
    ProxySession,
    close_proxy_session,
    open_proxy_session,
)
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import (
    ArtifactIntegrityError,
    ArtifactNotFoundError,
    ArtifactStore,
    file_sha256,
    write_tarball,
)
from mass_ops.store.budgets import charge_episode, episode_scopes
from mass_ops.store.untrusted import JSON_MAX_BYTES, UntrustedInputError, loads_untrusted, open_beneath, read_beneath

logger = logging.getLogger(__name__)

FORMAT: Final = 1
PROMPT_FILE = HANDOFF_PROMPT_FILE
SEED_FILE = "workspace-seed.tar.gz"
REQUEST_FILE = "request.json"
LEDGER_FILE = "ledger.json"
COMPLETE_FILE = "complete.json"
PUBLISHER_FAILED_FILE = "publisher-failed.json"
PUBLICATION_FILE = "publication.json"
SANDBOX_ALIVE = "sandbox.alive"
SESSIONS_DIR = "sessions"
# What the runner may ask of the publisher in sessions/ (id: <unit slug>-a<attempt>-t<try of that attempt>).
_SESSION_ASK = re.compile(
    r"(?P<id>(?P<slug>[A-Za-z0-9._-]+)-a(?P<attempt>[1-9][0-9]{0,8})-t[0-9]{1,9})\.(?P<ask>open|close)"
)
PROMPT_MAX_BYTES = 64 << 20
PUBLISHER_ALIVE = "publisher.alive"
HEARTBEAT_INTERVAL_S = 2.0
POLL_S = 0.2
# A side whose heartbeat is older than this has stopped (a container killed, OOM): the other side gives up.
DEFAULT_STALE_AFTER_S = 60.0
# How long each side waits for the other to start: both containers of a pod start together, but Python imports
# and, for the publisher, the first database round trip take a while on a busy node.
DEFAULT_START_TIMEOUT_S = 600.0
# The files of an attempt folder besides publication.json, in stored form (the workspace as its tarball).
ATTEMPT_FILES = ("workspace", "prompt", "stream", "stderr", "api_log", "settings")
# The publisher's credentials: never in what it writes to the folder, which the agent's container can read.
CREDENTIAL_ENV = ("MASS_METADATA_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
MIN_SCRUBBED = 4  # shorter values would also hit ordinary words
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_HEX64 = r"^[0-9a-f]{64}$"

_Model = TypeVar("_Model", bound=BaseModel)
_T = TypeVar("_T")


class HandoffError(InfrastructureError):
    """The other side failed, gave up or broke the protocol; the message is one line."""


class IncompleteHandoffError(HandoffError):
    """The hand-off ended without its marker, or holds something it must not: nothing of it was published."""


class PromptDeliveryError(IncompleteHandoffError):
    """The prompt the publisher was given cannot be handed over (not the cycle's prompt artifact of that hash, missing,
    or other bytes): no agent starts, nothing is published."""


class SeedDeliveryError(IncompleteHandoffError):
    """The workspace seed the publisher was given cannot be handed over (not the cycle's seed artifact of that hash,
    missing, or other bytes): no agent starts, nothing is published."""


@dataclass(frozen=True)
class PromptDelivery:
    """The prompt the publisher hands to the sandbox: its artifact URI and the SHA-256 the operator computed."""

    uri: str
    sha256: str


@dataclass(frozen=True)
class PodProxy:
    """The pod's `SessionProxy` as the publisher reaches it: its control socket and its session-log folder (both in
    a volume the sandbox does not mount)."""

    control_socket: Path
    sessions_dir: Path


# --- documents --------------------------------------------------------------------------------------------------


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HandoffUnit(_Document):
    """One unit the sandbox runs, as announced before any agent started."""

    task_id: PositiveInt | Annotated[str, StringConstraints(pattern=f"^{BENCHMARK_TASK_NAME.pattern}$")]
    kind: EpisodeKind
    seed: NonNegativeInt
    version: NonNegativeInt | None = None
    candidate: NonNegativeInt | None = None
    generation: str | None = None
    condition: str
    prompt_sha256: str = Field(pattern=_HEX64)
    workspace_seed_sha256: str | None = Field(default=None, pattern=_HEX64)

    @classmethod
    def of_request(cls, request: EpisodeRequest) -> HandoffUnit:
        unit = request.unit
        seed = request.workspace_seed
        return cls(
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            version=unit.version,
            candidate=unit.candidate,
            generation=unit.generation,
            condition=request.condition,
            prompt_sha256=request.prompt_sha256,
            workspace_seed_sha256=None if seed is None else seed.sha256,
        )

    def unit(self, cycle: str, attempt: int = 1) -> EpisodeUnit:
        return EpisodeUnit(
            cycle,
            self.task_id,  # type: ignore[arg-type]  # a benchmark unit's task is its instance name (str)
            self.kind,
            self.seed,
            self.version,
            self.candidate,
            attempt,
            self.generation,
        )


class HandoffRequest(_Document):
    format: Literal[1] = FORMAT
    cycle: str
    config_hash: str = Field(pattern=_HEX64)
    units: list[HandoffUnit] = Field(min_length=1)


class RecordedAttempt(_Document):
    """One recorded attempt of a unit, as the pool's planning reads it (the fields of the `Episode` row it uses)."""

    id: int
    attempt: PositiveInt
    status: str
    prompt_sha256: str | None
    artifacts: dict[str, str] = {}
    status_record: dict[str, Any] | None = None  # only for a final attempt: a reused outcome reports it


class ServingTarget(_Document):
    """The server of the generation a rollout evaluates (`mass_ops.serving.GenerationServer`)."""

    generation: str
    endpoint: str
    served_name: str


class ScopeSpend(_Document):
    """One budget scope's spend as the publisher read it when the pod started (the fields `BudgetLedger` reads)."""

    tokens: NonNegativeInt = 0
    cost_usd: float = 0.0
    requests: NonNegativeInt = 0
    refused_need: NonNegativeInt | None = None


class Ledger(_Document):
    format: Literal[1] = FORMAT
    cycle_id: int
    artifact_url: str
    serving: ServingTarget | None = None
    attempts: dict[str, list[RecordedAttempt]]  # by unit slug, first attempt first
    # the announced units' task and cycle budget scopes at the pod's start: the sandbox's pool checks them before
    # each attempt as it would the store (the operator admitted the pod on the same rule)
    budget_spend: dict[str, ScopeSpend] = {}
    # the publisher opens each attempt's proxy session (the runner asks in sessions/; module docstring)
    proxy_sessions: bool = False


class AttemptHandoff(_Document):
    """publication.json: what the attempt's row and status document say (its files lie beside it)."""

    format: Literal[1] = FORMAT
    unit: str
    attempt: PositiveInt
    record: EpisodeRecord
    status: dict[str, Any]


class Ack(_Document):
    unit: str
    attempt: PositiveInt
    episode_id: int | None = None
    status: EpisodeStatus | None = None
    artifacts: dict[str, str] = {}
    status_record: dict[str, Any] | None = None
    error: str | None = None


class Completion(_Document):
    exit_code: int
    error: str | None = None


class PublisherFailure(_Document):
    error: str


class SessionGrant(_Document):
    """sessions/<id>.session.json: the attempt's proxy session (URL and token for the agent), or why not."""

    proxy_url: str | None = None
    token: str | None = None
    error: str | None = None
    transient: bool = False  # the endpoint or the proxy did not answer: the runner waits and asks again


class SessionClosed(_Document):
    """sessions/<id>.closed.json: the closed session's record count and usage as the proxy counted them."""

    records: NonNegativeInt = 0
    usage: dict[str, NonNegativeInt] = {}
    error: str | None = None


# --- the folder -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """The shared folder (see the module docstring for its layout)."""

    root: Path

    def path(self, name: str) -> Path:
        return self.root / name

    def attempt_dir(self, slug: str, attempt: int) -> Path:
        return self.root / "attempts" / slug / f"a{attempt}"

    def ack_path(self, slug: str, attempt: int) -> Path:
        return self.root / "acks" / f"{slug}-a{attempt}.json"

    def write(self, path: Path, document: BaseModel) -> None:
        """Write `document` as JSON at `path` atomically (a reader sees all of it or nothing)."""
        self.write_bytes(path, document.model_dump_json().encode("utf-8"))

    def write_bytes(self, path: Path, data: bytes) -> None:
        """Write `data` at `path` atomically."""
        self.write_chunks(path, [data])

    def write_chunks(self, path: Path, chunks: Iterable[bytes]) -> None:
        """Write `chunks` at `path` (below the folder) atomically, following no link: the other side may have put
        one at the path, its temporary name or any folder on the way, and a write must not land elsewhere.
        `IncompleteHandoffError` when a folder on the way is a link."""
        relative = path.relative_to(self.root)
        name, temp = relative.name, f".{relative.name}.partial"
        self.root.mkdir(parents=True, exist_ok=True)  # the shared volume itself: no other side chose it
        folder = os.open(self.root, _FOLDER_FLAGS)
        try:
            for part in relative.parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=folder)
                try:
                    inner = os.open(part, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=folder)
                except OSError:
                    raise IncompleteHandoffError(f"hand-off {self.root}: {part}/ is a link or not a folder") from None
                os.close(folder)
                folder = inner
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=folder)
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
            )
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)  # a link at `name` is replaced, not followed
        finally:
            os.close(folder)

    def read(self, path: Path, model: type[_Model]) -> _Model:
        """The document at `path` (below the folder: opened once, no link followed, a regular file with one link, at
        most `JSON_MAX_BYTES`); `IncompleteHandoffError` naming it when it is not a valid `model`."""
        try:
            data = read_beneath(self.root, path.relative_to(self.root), max_bytes=JSON_MAX_BYTES)
        except (FileNotFoundError, UntrustedInputError, ValueError):
            raise IncompleteHandoffError(f"hand-off {self.root}: {self._name(path)} is not a regular file") from None
        try:
            return model.model_validate_json(data)
        except (OSError, ValidationError) as exc:
            problem = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
            where = ".".join(str(part) for part in problem["loc"]) or "document"
            raise IncompleteHandoffError(
                f"hand-off {self.root}: {self._name(path)} is not a valid {model.__name__}: {where}: {problem['msg']}"
            ) from None

    def age_s(self, name: str) -> float | None:
        """Seconds since heartbeat `name` was last touched, or None when it never was."""
        try:
            return max(0.0, time.time() - self.path(name).stat().st_mtime)
        except FileNotFoundError:
            return None

    def _name(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


class Heartbeat:
    """Touches a file every `interval_s` seconds on a daemon thread, from `__enter__` to `__exit__`."""

    def __init__(self, path: Path, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{path.name}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.path.touch()


def _wait(found: Callable[[], _T | None], problem: Callable[[], str | None], *, timeout_s: float, what: str) -> _T:
    """Poll until `found()` returns something; `problem()` (the other side failed or stopped) and the timeout end the
    wait with `HandoffError`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = found()
        if value is not None:
            return value
        reason = problem()
        if reason is not None:
            raise HandoffError(f"{what}: {reason}")
        if time.monotonic() >= deadline:
            raise HandoffError(f"{what}: nothing after {timeout_s:g} s")
        time.sleep(POLL_S)


def api_log_cost(path: Path) -> float:
    """The server-reported cost in USD summed over an attempt's proxy records (gzip JSON lines; 0 without costs):
    what the local proxy would have charged, response by response."""
    total = 0.0
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = loads_untrusted(line, what=str(path), max_bytes=len(line), max_depth=None)
            except UntrustedInputError:
                continue  # a record cut short is not spend anyone can prove
            response = record.get("response") if isinstance(record, dict) else None
            total += usage_cost(response.get("usage") if isinstance(response, dict) else None)
    return total


# --- the sandbox side: `mass-ops episode run --handoff DIR` -----------------------------------------------------


class LedgerRepository:
    """The one read of the metadata store the sandbox's `EpisodePool` makes (`episode_attempts`), answered from
    the ledger. Any other call fails: the sandbox has no database."""

    def __init__(self, cycle: str, ledger: Ledger) -> None:
        self._cycle = cycle
        self._attempts = ledger.attempts
        self._spend = ledger.budget_spend

    def budget_spend(self, cycle_id: int, scopes: Sequence[str] | None = None) -> dict[str, ScopeSpend]:
        """The budget scopes' spend as of the pod's start (what `BudgetLedger.exhausted` reads)."""
        del cycle_id
        return {scope: spend for scope, spend in self._spend.items() if scopes is None or scope in scopes}

    def note_budget_refusal(self, cycle_id: int, scope: str, need: int) -> None:
        """Nothing to note: a pod's proxy holds only the episode budget, whose refusals stay in its records."""
        del cycle_id, scope, need

    def mark_budget_once(self, cycle_id: int, key: str) -> bool:
        """Never marks: the sandbox has no store, so budget alerts are raised where the spend is recorded (the
        publisher's ingestion, the operator's admission check)."""
        del cycle_id, key
        return False

    def start_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to lease: the operator leased the pod's unit when it created the pod."""
        del cycle_id, unit

    def renew_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to renew: a pod's lease is the operator's (it lapses by age, not by renewals)."""
        del cycle_id, unit

    def end_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to end here: the publisher ends the lease when it ingests the attempt."""
        del cycle_id, unit

    def episode_attempts(
        self,
        cycle_id: int,
        *,
        task_id: int,
        kind: str,
        seed: int,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
    ) -> list[RecordedAttempt]:
        del cycle_id
        unit = EpisodeUnit(self._cycle, task_id, cast(EpisodeKind, kind), seed, version, candidate, 1, generation)
        return list(self._attempts.get(unit.slug, []))


class LedgerArtifacts:
    """The publisher's artifact store as the sandbox sees it: URIs (no credentials needed to name an object), and
    the status documents of final attempts, which the ledger carries. Nothing is read from or written to the store."""

    def __init__(
        self,
        store: ArtifactStore,
        statuses: dict[str, dict[str, Any]],
        *,
        cycle: str | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self._store = store
        self._statuses = statuses
        self._cycle = cycle
        self._handoff = handoff

    @property
    def url(self) -> str:
        return self._store.url

    def uri(self, key: str) -> str:
        return self._store.uri(key)

    def key_of(self, uri: str) -> str:
        return self._store.key_of(uri)

    def get_file(self, key: str, dest: str | os.PathLike[str], *, sha256: str | None = None) -> None:
        """The workspace seed the publisher delivered (`SEED_FILE`), copied to `dest` when `key` is the cycle's
        seed key of its SHA-256 (and `sha256`, when given, is that hash); `ArtifactNotFoundError` otherwise — the
        sandbox reaches no store."""
        delivered = None if self._handoff is None else self._handoff.path(SEED_FILE)
        if delivered is not None and self._cycle is not None and delivered.is_file() and not delivered.is_symlink():
            actual, _size = file_sha256(delivered)
            if key == workspace_seed_key(self._cycle, actual) and sha256 in (None, actual):
                target = Path(dest)
                temp = target.with_name(f".{target.name}.partial")
                shutil.copyfile(delivered, temp)
                os.replace(temp, target)
                return
        raise ArtifactNotFoundError(f"artifact {self.uri(key)} is not in the hand-off")

    def get_json(self, key: str) -> Any:
        if key not in self._statuses:
            raise ArtifactNotFoundError(f"artifact {self.uri(key)} is not in the hand-off ledger")
        return self._statuses[key]


class SandboxHandoff:
    """The sandbox's end: announce the units, wait for the ledger, hand attempts over, and mark the end.

    Use as a context manager around the whole run: it keeps the heartbeat and, on exit, writes complete.json with
    the run's exit status (an exception's `exit_code`, as `typer.Exit` carries it, else 1; 0 without exception).
    """

    def __init__(
        self,
        root: Path,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        ack_timeout_s: float | None = None,
    ) -> None:
        self.handoff = Handoff(Path(root))
        self.start_timeout_s = start_timeout_s
        self.stale_after_s = stale_after_s
        self.ack_timeout_s = ack_timeout_s
        self.ledger: Ledger | None = None  # the publisher's answer to the announcement (`open`)
        self._heartbeat: Heartbeat | None = None

    def __enter__(self) -> SandboxHandoff:
        handoff = self.handoff
        used = [name for name in (REQUEST_FILE, COMPLETE_FILE) if handoff.path(name).exists()]
        if used:
            raise HandoffError(f"hand-off {handoff.root}: already used by another run ({used[0]} exists)")
        self._heartbeat = Heartbeat(handoff.path(SANDBOX_ALIVE)).__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        code = 0 if exc is None else getattr(exc, "exit_code", 1)
        # An exit with a status has said why already; anything else leaves its first line for the publisher's log.
        error = None if exc is None or hasattr(exc, "exit_code") else (str(exc).splitlines() or [repr(exc)])[0]
        try:
            self.handoff.write(self.handoff.path(COMPLETE_FILE), Completion(exit_code=code, error=error))
        finally:
            if self._heartbeat is not None:
                self._heartbeat.__exit__(None, None, None)

    def publisher_problem(self) -> str | None:
        """Why the publisher will not answer, or None while it may."""
        failed = self.handoff.path(PUBLISHER_FAILED_FILE)
        if failed.exists():
            with contextlib.suppress(HandoffError):
                return f"the publisher gave up: {self.handoff.read(failed, PublisherFailure).error}"
            return "the publisher gave up"
        age = self.handoff.age_s(PUBLISHER_ALIVE)
        if age is not None and age > self.stale_after_s:
            return f"the publisher stopped (no heartbeat for {age:.0f} s)"
        return None

    def await_prompt(self, path: Path) -> None:
        """Wait until the publisher has written `path` when it is the hand-off's prompt file (a prompt file elsewhere
        is the caller's own); HandoffError when the publisher gives up or stops first, or after the start timeout."""
        if Path(path).absolute() != self.handoff.path(PROMPT_FILE).absolute():
            return
        _wait(
            lambda: True if path.is_file() else None,
            self.publisher_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {self.handoff.root}: waiting for the publisher's {PROMPT_FILE}",
        )

    def open(self, config: CycleConfig, requests: Sequence[EpisodeRequest]) -> CycleContext:
        """Announce `requests`, wait for the publisher's ledger, and return the context the pool runs in."""
        handoff = self.handoff
        announced = HandoffRequest(
            cycle=config.cycle_name,
            config_hash=config.config_hash(),
            units=[HandoffUnit.of_request(request) for request in requests],
        )
        handoff.write(handoff.path(REQUEST_FILE), announced)
        ledger_path = handoff.path(LEDGER_FILE)
        ledger = _wait(
            lambda: handoff.read(ledger_path, Ledger) if ledger_path.exists() else None,
            self.publisher_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {handoff.root}: waiting for the publisher's ledger",
        )
        self.ledger = ledger
        if ledger.serving is not None:
            # A rollout runs on the server of the generation it evaluates; only the publisher can look it up.
            from mass_ops.serving import GenerationServer, serving_config

            config = serving_config(config, GenerationServer(**ledger.serving.model_dump()))
        statuses = {}
        for request in requests:
            for recorded in ledger.attempts.get(request.unit.slug, []):
                if recorded.status_record is not None:
                    unit = dataclasses.replace(request.unit, attempt=recorded.attempt)
                    statuses[unit.artifact_key("status")] = recorded.status_record
        return CycleContext(
            config=config,
            catalogue=load_task_catalogue(config),
            repo=cast(Any, LedgerRepository(config.cycle_name, ledger)),
            artifacts=cast(
                Any,
                LedgerArtifacts(
                    open_artifact_store(ledger.artifact_url), statuses, cycle=config.cycle_name, handoff=handoff
                ),
            ),
            cycle_id=ledger.cycle_id,
        )

    @property
    def sink(self) -> HandoffSink:
        return HandoffSink(self)

    @property
    def proxy_sessions(self) -> HandoffProxySessions | None:
        """Where the runner gets each attempt's proxy session when the publisher opens them (its ledger says so)."""
        if self.ledger is None or not self.ledger.proxy_sessions:
            return None
        return HandoffProxySessions(self)


class HandoffProxySessions:
    """The runner's proxy sessions in a pod (`runner.ProxySessions`): asked of the publisher in sessions/, never of
    the proxy, whose control socket this container cannot reach."""

    def __init__(self, session: SandboxHandoff, *, answer_timeout_s: float | None = None) -> None:
        self.session = session
        self.answer_timeout_s = answer_timeout_s
        self._tries = itertools.count(1)

    async def open(self, unit: EpisodeUnit) -> AttemptSession:
        """The session of attempt `unit.attempt`: `EndpointUnreachableError` when the publisher's preflight found the
        endpoint (or the proxy) not answering, `EpisodePreflightError` when it refused for good."""
        name = f"{unit.slug}-a{unit.attempt}-t{next(self._tries)}"
        grant = await self._ask(name, "open", f"{name}.session.json", SessionGrant)
        if grant.error is not None or not grant.proxy_url or not grant.token:
            error = grant.error or "the session answer is empty"
            raise (EndpointUnreachableError if grant.transient else EpisodePreflightError)(error)
        return AttemptSession(name=name, proxy_url=grant.proxy_url, token=grant.token)

    async def close(self, session: AttemptSession, api_log: Path) -> UsageTotals:
        """Have the publisher close `session`; its log (as the proxy wrote it) lands at `api_log`; returns the
        proxy's counts."""
        handoff = self.session.handoff
        closed = await self._ask(session.name, "close", f"{session.name}.closed.json", SessionClosed)
        if closed.error is not None:
            raise HandoffError(f"proxy session {session.name}: {closed.error}")
        copy = handoff.path(SESSIONS_DIR) / f"{session.name}.log"
        await asyncio.to_thread(_move_file, copy, api_log)
        return UsageTotals.from_mapping(closed.usage)

    async def _ask(self, name: str, ask: str, answer_name: str, model: type[_Model]) -> _Model:
        handoff = self.session.handoff
        answer = handoff.path(SESSIONS_DIR) / answer_name
        answer.unlink(missing_ok=True)  # an answer planted before the question is not the publisher's
        handoff.write_bytes(handoff.path(SESSIONS_DIR) / f"{name}.{ask}", b"")
        # As for an ack: the publisher may be busy publishing another unit's attempt; its heartbeat says it lives.
        limit = self.answer_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while not answer.exists():
            problem = self.session.publisher_problem()
            if problem is not None:
                raise HandoffError(f"proxy session {name}: {problem}")
            if deadline is not None and time.monotonic() >= deadline:
                raise HandoffError(f"proxy session {name}: no answer from the publisher after {limit:g} s")
            await asyncio.sleep(POLL_S)
        return handoff.read(answer, model)


def _move_file(source: Path, target: Path) -> None:
    """Copy `source` to `target` and remove `source` (they lie on different volumes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as inp, target.open("wb") as out:
        shutil.copyfileobj(inp, out, 1 << 20)
    source.unlink(missing_ok=True)


class HandoffSink:
    """A `PublicationSink` that hands each attempt to the publisher and returns the outcome it recorded."""

    def __init__(self, session: SandboxHandoff) -> None:
        self.session = session

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome:
        handoff = self.session.handoff
        unit = publication.unit
        folder = handoff.attempt_dir(unit.slug, unit.attempt)
        if folder.exists():
            raise HandoffError(f"episode {unit.key}: attempt already handed over in {handoff.root}")
        staging = folder.with_name(f".{folder.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            self._write_files(publication, staging, abort)
            handoff.write(
                staging / PUBLICATION_FILE,
                AttemptHandoff(
                    unit=unit.slug, attempt=unit.attempt, record=publication.record, status=publication.status
                ),
            )
            os.rename(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # From here the attempt belongs to the publisher: it is published even if this run is cancelled now.
        ack_path = handoff.ack_path(unit.slug, unit.attempt)

        def problem() -> str | None:
            if abort.is_set():
                raise PublishAborted
            return self.session.publisher_problem()

        ack = _wait(
            lambda: handoff.read(ack_path, Ack) if ack_path.exists() else None,
            problem,
            timeout_s=self.session.ack_timeout_s or float("inf"),
            what=f"episode {unit.key}: waiting for the publisher",
        )
        if ack.error is not None or ack.episode_id is None or ack.status is None:
            raise HandoffError(f"episode {unit.key}: the publisher could not publish it: {ack.error}")
        return EpisodeOutcome(
            request=publication.request,
            episode_id=ack.episode_id,
            attempt=ack.attempt,
            status=ack.status,
            status_record=ack.status_record or publication.status,
            artifacts=dict(ack.artifacts),
        )

    @staticmethod
    def _write_files(publication: EpisodePublication, folder: Path, abort: threading.Event) -> None:
        """The attempt's files in stored form: the workspace as the same deterministic tarball `put_dir` stores."""
        files = publication.files
        for name in ATTEMPT_FILES:
            if abort.is_set():
                raise PublishAborted
            target = folder / EPISODE_FILES[name]
            if name == "workspace" and not files.workspace_archived:
                with target.open("wb") as out:
                    write_tarball(files.workspace, out, skip_escaping_links=True)
            else:
                shutil.copyfile(getattr(files, name), target)


# --- the publisher side: `mass-ops episode publish --handoff DIR` -----------------------------------------------


class HandoffPublisher:
    """The publisher's end: capture the request, answer with the ledger, open and close each attempt's session on the
    pod's proxy (given `proxy`), publish each attempt, acknowledge it.

    `run()` returns 0 when every handed-over attempt was published, 1 when any could not be (each error is in its
    ack and the log); it raises `IncompleteHandoffError` for a hand-off that ended without its marker or holds
    something invalid, and `HandoffError` when the cycle cannot be reached. Either way publisher-failed.json tells
    a sandbox that still waits.
    """

    def __init__(
        self,
        config: CycleConfig,
        root: Path,
        *,
        attach: Callable[[CycleConfig], CycleContext] | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        on_outcome: Callable[[EpisodeOutcome], None] | None = None,
        environ: Mapping[str, str] | None = None,
        prompt: PromptDelivery | None = None,
        workspace_seed: WorkspaceSeed | None = None,
        proxy: PodProxy | None = None,
        server: EpisodeServer | None = None,
    ) -> None:
        self.config = config
        self.handoff = Handoff(Path(root))
        self.prompt = prompt
        self.workspace_seed = workspace_seed
        self.proxy = proxy
        self.server = server  # a benchmark episode's server (`--endpoint --served-name`), as the pod spec names it
        self._sessions: dict[tuple[str, int], _AttemptProxySession] = {}
        self._handled_asks: set[str] = set()
        self._private: Path | None = None  # the publisher's own scratch (not in the hand-off): logs it publishes
        self.attach = attach
        self.start_timeout_s = start_timeout_s
        self.stale_after_s = stale_after_s
        self.on_outcome = on_outcome
        self.failures = 0
        env = os.environ if environ is None else environ
        values = [env.get(name, "") for name in CREDENTIAL_ENV] + [config.storage.metadata_url]
        values += [urlsplit(value).password or "" for value in values if "://" in value]
        # Longest first, so a URL goes whole before its password would cut it.
        self._secrets = sorted({v for v in values if len(v) >= MIN_SCRUBBED}, key=len, reverse=True)

    def scrubbed(self, message: str) -> str:
        """`message` without any of the publisher's credentials (it goes where the agent can read)."""
        for secret in self._secrets:
            message = message.replace(secret, "[REDACTED]")
        return message

    def run(self) -> int:
        handoff = self.handoff
        handoff.root.mkdir(parents=True, exist_ok=True)
        try:
            with Heartbeat(handoff.path(PUBLISHER_ALIVE)), self._scratch():
                ctx = None
                if self.workspace_seed is not None:
                    # Before the prompt: the sandbox starts once prompt.txt is there, and finds its seed beside it.
                    ctx = self._attach()
                    self._deliver_seed(ctx, self.workspace_seed)
                if self.prompt is not None:
                    ctx = ctx or self._attach()
                    self._deliver_prompt(ctx, self.prompt)
                request = self._await_request()
                if request is None:
                    logger.info("hand-off %s: the episode container ended before announcing a unit", handoff.root)
                    return 0
                ctx = ctx or self._attach()
                ledger = self._ledger(ctx, request)
                handoff.write(handoff.path(LEDGER_FILE), ledger)
                self._serve(ctx, request, ledger)
        except HandoffError as exc:
            handoff.write(handoff.path(PUBLISHER_FAILED_FILE), PublisherFailure(error=self.scrubbed(str(exc))))
            raise
        except BaseException as exc:
            message = self.scrubbed((str(exc).splitlines() or [""])[0])
            handoff.write(
                handoff.path(PUBLISHER_FAILED_FILE), PublisherFailure(error=f"{type(exc).__name__}: {message}")
            )
            raise
        return 1 if self.failures else 0

    @contextlib.contextmanager
    def _scratch(self) -> Any:
        """The publisher's private folder for the run (under its own TMPDIR), removed at the end."""
        self._private = Path(tempfile.mkdtemp(prefix="mass-publisher-"))
        try:
            yield
        finally:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    # -- steps --

    def _deliver_prompt(self, ctx: CycleContext, prompt: PromptDelivery) -> None:
        """Fetch the prompt from the cycle's content-addressed key of its hash, check the bytes, write prompt.txt."""
        from mass_ops.layout import episode_prompt_key

        try:
            key = episode_prompt_key(ctx.cycle_name, prompt.sha256)
        except ValueError as exc:
            raise PromptDeliveryError(f"--prompt-sha256: {exc}") from None
        if ctx.artifacts.uri(key) != prompt.uri:
            raise PromptDeliveryError(
                f"--prompt-uri: {prompt.uri} is not the prompt artifact of cycle {ctx.cycle_name} with SHA-256 "
                f"{prompt.sha256[:12]}… (expected {ctx.artifacts.uri(key)})"
            )
        try:
            data = ctx.artifacts.get_bytes(key)
        except ArtifactNotFoundError:
            raise PromptDeliveryError(f"--prompt-uri: {prompt.uri} does not exist") from None
        if hashlib.sha256(data).hexdigest() != prompt.sha256:
            raise PromptDeliveryError(f"--prompt-uri: {prompt.uri} does not hold the prompt of SHA-256 {prompt.sha256}")
        self.handoff.write_bytes(self.handoff.path(PROMPT_FILE), data)

    def _deliver_seed(self, ctx: CycleContext, seed: WorkspaceSeed) -> None:
        """Fetch the workspace seed from the cycle's content-addressed key of its hash, checked, into `SEED_FILE`."""
        key = workspace_seed_key(ctx.cycle_name, seed.sha256)
        if ctx.artifacts.uri(key) != seed.uri:
            raise SeedDeliveryError(
                f"--workspace-seed-uri: {seed.uri} is not the workspace seed of cycle {ctx.cycle_name} with SHA-256 "
                f"{seed.sha256[:12]}… (expected {ctx.artifacts.uri(key)})"
            )
        target = self.handoff.path(SEED_FILE)
        try:
            ctx.artifacts.get_file(key, target, sha256=seed.sha256)  # atomic, and only when the bytes check
        except ArtifactNotFoundError:
            raise SeedDeliveryError(f"--workspace-seed-uri: {seed.uri} does not exist") from None
        except ArtifactIntegrityError:
            raise SeedDeliveryError(
                f"--workspace-seed-uri: {seed.uri} does not hold the seed of SHA-256 {seed.sha256}"
            ) from None

    def _sandbox_problem(self) -> str | None:
        age = self.handoff.age_s(SANDBOX_ALIVE)
        if age is not None and age > self.stale_after_s:
            return f"the episode container stopped (no heartbeat for {age:.0f} s)"
        return None

    def _await_request(self) -> HandoffRequest | None:
        """The announced units; None when the run ended without announcing any (it refused its input)."""
        path, complete = self.handoff.path(REQUEST_FILE), self.handoff.path(COMPLETE_FILE)

        def found() -> HandoffRequest | Literal[False] | None:
            if path.exists():
                return self.handoff.read(path, HandoffRequest)
            return False if complete.exists() else None

        request: HandoffRequest | Literal[False] = _wait(
            found,
            self._sandbox_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {self.handoff.root}: waiting for the episode container's request",
        )
        if request is False:
            return None
        if request.cycle != self.config.cycle_name or request.config_hash != self.config.config_hash():
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: the episode container runs cycle {request.cycle!r} with config "
                f"{request.config_hash[:12]}…, this publisher has cycle {self.config.cycle_name!r} with config "
                f"{self.config.config_hash()[:12]}… (both must read the same config)"
            )
        slugs = [unit.unit(request.cycle).slug for unit in request.units]
        if len(set(slugs)) != len(slugs):
            raise IncompleteHandoffError(f"hand-off {self.handoff.root}: request.json names a unit twice")
        delivered = None if self.workspace_seed is None else self.workspace_seed.sha256
        for unit, slug in zip(request.units, slugs, strict=True):
            if unit.workspace_seed_sha256 != delivered:
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root}: request.json announces {slug} with workspace seed "
                    f"{(unit.workspace_seed_sha256 or 'none')[:12]}, not the seed this publisher delivered "
                    f"({(delivered or 'none')[:12]})"
                )
        if self.prompt is not None:
            for unit, slug in zip(request.units, slugs, strict=True):
                if unit.prompt_sha256 != self.prompt.sha256:
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root}: request.json announces {slug} with prompt "
                        f"{unit.prompt_sha256[:12]}…, not the prompt {self.prompt.sha256[:12]}… this publisher "
                        f"delivered in {PROMPT_FILE}"
                    )
        return request

    def _attach(self) -> CycleContext:
        if self.attach is not None:
            return self.attach(self.config)
        from mass_ops.context import attach_cycle

        return attach_cycle(self.config)

    def _ledger(self, ctx: CycleContext, request: HandoffRequest) -> Ledger:
        attempts: dict[str, list[RecordedAttempt]] = {}
        for announced in request.units:
            unit = announced.unit(request.cycle)
            rows = ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity())
            final = next((row for row in reversed(rows) if row.status in ("succeeded", "model_failure")), None)
            status_record = None
            if final is not None:
                key = dataclasses.replace(unit, attempt=final.attempt).artifact_key("status")
                status_record = ctx.artifacts.get_json(key)
            attempts[unit.slug] = [
                RecordedAttempt(
                    id=row.id,
                    attempt=row.attempt,
                    status=row.status,
                    prompt_sha256=row.prompt_sha256,
                    artifacts=dict(row.artifacts or {}),
                    status_record=status_record if row is final else None,
                )
                for row in rows
            ]
        scopes = {scope for announced in request.units for scope in episode_scopes(announced.task_id)}
        spend = ctx.repo.budget_spend(ctx.cycle_id, sorted(scopes))
        return Ledger(
            cycle_id=ctx.cycle_id,
            artifact_url=ctx.artifacts.url,
            serving=self._serving(ctx, request),
            proxy_sessions=self.proxy is not None,
            attempts=attempts,
            budget_spend={
                scope: ScopeSpend(
                    tokens=row.tokens, cost_usd=row.cost_usd, requests=row.requests, refused_need=row.refused_need
                )
                for scope, row in spend.items()
            },
        )

    @staticmethod
    def _serving(ctx: CycleContext, request: HandoffRequest) -> ServingTarget | None:
        generations = {unit.generation for unit in request.units if unit.kind == "rollout" and unit.generation}
        if not generations:
            return None
        if len(generations) > 1:
            raise IncompleteHandoffError(f"request.json: rollouts of several generations {sorted(generations)}")
        from mass_ops.serving import evaluation_scope, generation_server

        server = generation_server(ctx, generations.pop(), evaluation_scope(ctx.config))
        return ServingTarget(**server.as_dict())

    def _serve(self, ctx: CycleContext, request: HandoffRequest, ledger: Ledger) -> None:
        """Publish attempts as they come until the marker is there and nothing is left, or the sandbox stopped."""
        units = {announced.unit(request.cycle).slug: announced for announced in request.units}
        expected = {slug: (ledger.attempts[slug][-1].attempt + 1 if ledger.attempts[slug] else 1) for slug in units}
        try:
            self._serve_until_complete(ctx, request, ledger, units, expected)
        finally:
            # The sandbox has ended: no attempt of its units runs any more, whether it was handed over or not.
            self._close_unrecorded_sessions(ctx, request.cycle, units)
            for slug, announced in units.items():
                self._end_lease(ctx, announced.unit(request.cycle, expected[slug]))

    def _serve_until_complete(
        self,
        ctx: CycleContext,
        request: HandoffRequest,
        ledger: Ledger,
        units: dict[str, HandoffUnit],
        expected: dict[str, int],
    ) -> None:
        complete = self.handoff.path(COMPLETE_FILE)
        while True:
            finished = complete.exists()  # read before the scan: what came before the marker is on disk now
            self._answer_session_asks(ledger, units, expected)
            for slug, announced in units.items():
                while self.handoff.attempt_dir(slug, expected[slug]).exists():
                    self._publish(ctx, request.cycle, announced, expected[slug])
                    expected[slug] += 1
            if finished:
                self._check_leftovers(units, expected)
                return
            stopped = self._sandbox_problem()
            if stopped is not None:
                self._check_leftovers(units, expected)
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root} is incomplete: {stopped} before writing {COMPLETE_FILE}; "
                    "what it handed over is published, nothing else"
                )
            time.sleep(POLL_S)

    def _check_leftovers(self, units: dict[str, HandoffUnit], expected: dict[str, int]) -> None:
        """Refuse what lies in attempts/ but was never completed, or does not belong to an announced unit."""
        attempts_root = self.handoff.root / "attempts"
        if not attempts_root.is_dir():
            return
        for unit_dir in sorted(attempts_root.iterdir()):
            slug = unit_dir.name
            for entry in sorted(unit_dir.iterdir()) if unit_dir.is_dir() else [unit_dir]:
                name = entry.name
                if slug in units and name.startswith(".") and name.endswith(".partial"):
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root} is incomplete: attempt {name[1:].removesuffix('.partial')} "
                        f"of {slug} was never finished (no {PUBLICATION_FILE}); nothing of it was published"
                    )
                known = slug in units and name.startswith("a") and name[1:].isdigit() and int(name[1:]) < expected[slug]
                if not known:
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root}: attempts/{slug}/{name} is not an attempt the episode "
                        "container announced in order; it was not published"
                    )

    def _publish(self, ctx: CycleContext, cycle: str, announced: HandoffUnit, attempt: int) -> None:
        unit = announced.unit(cycle, attempt)
        ack_path = self.handoff.ack_path(unit.slug, attempt)
        # Every file of the attempt stays open from its check until it is uploaded and charged (no check-then-use).
        with contextlib.ExitStack() as held:
            try:
                publication = self._publication(ctx, announced, unit, held)
                outcome = publish_episode(ctx, publication)
            except IncompleteHandoffError:
                raise
            except Exception as exc:
                self._end_lease(ctx, unit)  # the attempt has ended, recorded or not
                self.failures += 1
                message = self.scrubbed((str(exc).splitlines() or [""])[0])
                error = f"{type(exc).__name__}: {message}"
                logger.error("episode %s: publishing failed: %s", unit.key, error)
                self.handoff.write(ack_path, Ack(unit=unit.slug, attempt=attempt, error=error))
                return
            self.handoff.write(
                ack_path,
                Ack(
                    unit=unit.slug,
                    attempt=attempt,
                    episode_id=outcome.episode_id,
                    status=outcome.status,
                    artifacts=outcome.artifacts,
                    status_record=outcome.status_record,
                ),
            )
            self._end_lease(ctx, unit)  # its row is recorded: the operator's lease of the pod's attempt ends
            self._charge(ctx, publication, outcome)  # once per attempt, whichever ingest gets here first
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _end_lease(self, ctx: CycleContext, unit: EpisodeUnit) -> None:
        """End the unit's lease of attempt `unit.attempt` or earlier (`status` stops showing it running); a failure
        is logged, never fatal: a lease left behind goes stale on its own."""
        try:
            ctx.repo.end_episode_lease(ctx.cycle_id, attempt=unit.attempt, **unit.identity())
        except Exception as exc:
            message = self.scrubbed((str(exc).splitlines() or [""])[0])
            logger.warning("episode %s: could not end its lease: %s: %s", unit.key, type(exc).__name__, message)

    def _charge(self, ctx: CycleContext, publication: EpisodePublication, outcome: EpisodeOutcome) -> None:
        """Charge the attempt's spend to its task's and the cycle's budget scopes: the pod's proxy could not (it has
        no store). Keyed by the attempt's row, so every ingest may call it and the spend is added once; a failure is
        logged, not fatal (the row is durable, a rerun of the ingest charges it, and a ledger that misses spend must
        not lose the episode)."""
        record = publication.record
        tokens = record.prompt_tokens + record.completion_tokens
        try:
            cost = api_log_cost(publication.files.api_log)
            charge_episode(
                ctx.repo,
                ctx.cycle_id,
                publication.unit.task_id,
                charge_key=f"episode:{outcome.episode_id}",
                tokens=tokens,
                cost_usd=cost,
                requests=record.requests,
            )
        except Exception as exc:
            message = self.scrubbed((str(exc).splitlines() or [""])[0])
            logger.error(
                "episode %s (id %s): could not charge %d tokens to the budget ledger: %s: %s",
                publication.unit.key,
                outcome.episode_id,
                tokens,
                type(exc).__name__,
                message,
            )

    def _publication(
        self, ctx: CycleContext, announced: HandoffUnit, unit: EpisodeUnit, held: contextlib.ExitStack
    ) -> EpisodePublication:
        """The attempt as the runner built it, with identity and keys from the request, files from the folder (each
        opened once and held in `held`), and — with a pod proxy — the proxy's own log and counts."""
        folder = self.handoff.attempt_dir(unit.slug, unit.attempt)
        document = self.handoff.read(folder / PUBLICATION_FILE, AttemptHandoff)
        if (document.unit, document.attempt) != (unit.slug, unit.attempt):
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: {folder.name} of {unit.slug} describes {document.unit} attempt "
                f"{document.attempt}"
            )
        paths: dict[str, Path] = {}
        descriptors: dict[str, int] = {}
        for name in ATTEMPT_FILES:
            relative = folder.relative_to(self.handoff.root) / EPISODE_FILES[name]
            try:
                descriptors[name] = held.enter_context(open_beneath(self.handoff.root, relative))
            except (FileNotFoundError, UntrustedInputError):
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root}: {unit.slug}/a{unit.attempt}/{relative.name} is missing or not a "
                    "regular file of its own (a link, or a file with other hard links)"
                ) from None
            # The store reads the checked descriptor's file through its /proc name: that opens the very file held
            # here, whatever the folder's name points at by then.
            paths[name] = Path(f"/proc/self/fd/{descriptors[name]}")
        prompt = _read_descriptor(descriptors["prompt"], PROMPT_MAX_BYTES)
        if prompt is None or hashlib.sha256(prompt).hexdigest() != announced.prompt_sha256:
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: the prompt of {unit.slug}/a{unit.attempt} differs from the one "
                "announced before the episode started"
            )
        record, status = document.record, document.status
        if self.proxy is not None:
            closed, log = self._attempt_log(unit)
            paths["api_log"] = log
            record, status = _with_proxy_counts(record, status, closed)
        request = EpisodeRequest(unit=announced.unit(unit.cycle), condition=announced.condition, prompt=prompt.decode())
        previous = [
            row for row in ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity()) if row.attempt == unit.attempt - 1
        ]
        return EpisodePublication(
            request=request,
            unit=unit,
            files=AttemptFiles(workspace_archived=True, **paths),
            status=status,
            record=record,
            retry_of_id=previous[0].id if previous else None,
        )

    # -- proxy sessions (with a pod proxy: the module docstring) --

    def _answer_session_asks(self, ledger: Ledger, units: dict[str, HandoffUnit], expected: dict[str, int]) -> None:
        """Answer what the runner asked in sessions/ since the last look: opens first, then closes."""
        folder = self.handoff.path(SESSIONS_DIR)
        if self.proxy is None or not folder.is_dir() or folder.is_symlink():
            return
        asks = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name in self._handled_asks:
                    continue
                self._handled_asks.add(entry.name)  # answers and strays too: each name is looked at once
                match = _SESSION_ASK.fullmatch(entry.name)
                if match is not None:
                    asks.append(match)
        for match in sorted(asks, key=lambda m: (m["ask"] != "open", m["id"])):
            slug, attempt, name = match["slug"], int(match["attempt"]), match["id"]
            if match["ask"] == "open":
                grant = self._grant(ledger, units, expected, slug, attempt)
                self.handoff.write(folder / f"{name}.session.json", grant)
            else:
                self.handoff.write(folder / f"{name}.closed.json", self._close_for_runner(slug, attempt, name))

    def _grant(
        self, ledger: Ledger, units: dict[str, HandoffUnit], expected: dict[str, int], slug: str, attempt: int
    ) -> SessionGrant:
        """Open the proxy session of `slug`'s attempt `attempt` when it is an announced unit's next attempt and has
        had none yet, towards the upstream derived here, after checking the endpoint through the proxy."""
        if slug not in units:
            return SessionGrant(error=f"proxy session: {slug} is not a unit this pod announced")
        if attempt != expected[slug]:
            return SessionGrant(error=f"proxy session: attempt {attempt} is not the next attempt of {slug}")
        if (slug, attempt) in self._sessions:
            return SessionGrant(error=f"proxy session: attempt {attempt} of {slug} already has its session")
        assert self.proxy is not None
        config = self._attempt_config(ledger, units[slug])
        try:
            session = asyncio.run(self._open_checked(config))
        except (EndpointUnreachableError, ProxySessionError) as exc:
            return SessionGrant(error=self.scrubbed(str(exc)), transient=True)
        except EpisodePreflightError as exc:
            return SessionGrant(error=self.scrubbed(str(exc)))
        self._sessions[(slug, attempt)] = _AttemptProxySession(session)
        logger.info("episode %s attempt %d: proxy session %s opened", slug, attempt, session.name)
        return SessionGrant(proxy_url=session.proxy_url, token=session.token)

    def _attempt_config(self, ledger: Ledger, announced: HandoffUnit) -> CycleConfig:
        """The config an attempt of `announced` runs under: on the rollout's server from the ledger, the benchmark's
        server this publisher was given, else the cycle's endpoint."""
        from mass_ops.serving import GenerationServer, serving_config

        if ledger.serving is not None:
            return serving_config(self.config, GenerationServer(**ledger.serving.model_dump()))
        if self.server is not None:
            server = GenerationServer(str(announced.generation), self.server.endpoint, self.server.served_name)
            return serving_config(self.config, server)
        return self.config

    async def _open_checked(self, config: CycleConfig) -> ProxySession:
        """The preflight (GET /models through a throwaway session), then the attempt's budgeted session."""
        assert self.proxy is not None
        proxy, upstream = self.proxy, proxy_upstream(config)
        check = await open_proxy_session(proxy.control_socket, proxy.sessions_dir, upstream=upstream)
        try:
            await check_endpoint(config, check.token, via=check.proxy_url)
        finally:
            with contextlib.suppress(ProxySessionError):
                await close_proxy_session(proxy.control_socket, check, discard=True)
        return await open_proxy_session(
            proxy.control_socket,
            proxy.sessions_dir,
            upstream=upstream,
            episode_tokens=config.budgets.episode_tokens,
            default_max_tokens=config.inference.episode_max_output_tokens,
        )

    def _close_for_runner(self, slug: str, attempt: int, name: str) -> SessionClosed:
        """Close the attempt's session and put a copy of its log beside the answer (the runner classifies from it)."""
        entry = self._sessions.get((slug, attempt))
        if entry is None:
            return SessionClosed(error=f"attempt {attempt} of {slug} has no proxy session")
        closed = self._closed(entry)
        self.handoff.write_chunks(self.handoff.path(SESSIONS_DIR) / f"{name}.log", _file_chunks(entry.session.log_path))
        return SessionClosed(records=closed.records, usage=closed.usage.as_dict())

    def _closed(self, entry: _AttemptProxySession) -> ClosedSession:
        """Close `entry`'s session once (its token stops working, its exchanges are settled) and return the proxy's
        counts; a proxy that cannot answer any more leaves its log, which the proxy alone wrote: counted from it."""
        if entry.closed is None:
            assert self.proxy is not None
            try:
                entry.closed = asyncio.run(close_proxy_session(self.proxy.control_socket, entry.session))
            except ProxySessionError as exc:
                logger.warning("proxy session %s: %s; counting its log instead", entry.session.name, exc)
                records = read_proxy_log(entry.session.log_path)
                entry.closed = ClosedSession(len(records), UsageTotals.from_records(records))
        return entry.closed

    def _attempt_log(self, unit: EpisodeUnit) -> tuple[ClosedSession, Path]:
        """The attempt's session, closed, and its log gzipped into the publisher's own folder (what is published)."""
        entry = self._sessions.get((unit.slug, unit.attempt))
        if entry is None:
            raise HandoffError(f"attempt {unit.attempt} of {unit.slug} had no proxy session: no record vouches for it")
        closed = self._closed(entry)
        assert self._private is not None
        target = self._private / f"{unit.slug}-a{unit.attempt}.api_requests.jsonl.gz"
        # A session that logged nothing has no file: an empty log, as the runner's own gzip makes of it.
        with (
            gzip.open(target, "wb", compresslevel=6) as out,
            contextlib.suppress(FileNotFoundError),
            entry.session.log_path.open("rb") as source,
        ):
            shutil.copyfileobj(source, out, 1 << 20)
        return closed, target

    def _close_unrecorded_sessions(self, ctx: CycleContext, cycle: str, units: dict[str, HandoffUnit]) -> None:
        """Close every session whose attempt has no row (never handed over, or its publishing failed) and charge what
        it spent to its task and the cycle, keyed by the session: an agent that stops its runner before the hand-over
        must not spend off the ledger. Charging is logged, never fatal (as `_charge`)."""
        for (slug, attempt), entry in self._sessions.items():
            closed = self._closed(entry)
            unit = units[slug].unit(cycle, attempt)
            usage, tokens = closed.usage, closed.usage.prompt_tokens + closed.usage.completion_tokens
            try:
                rows = ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity())
                if any(row.attempt == attempt for row in rows):
                    continue  # recorded: charged by its row (`_charge`), on this ingest or a retried one
                logger.warning(
                    "episode %s attempt %d: its proxy session %s ended unrecorded (%d requests, %d tokens): charged",
                    slug,
                    attempt,
                    entry.session.name,
                    usage.requests,
                    tokens,
                )
                records = read_proxy_log(entry.session.log_path)
                cost = sum(usage_cost((record["response"] or {}).get("usage")) for record in records)
                charge_episode(
                    ctx.repo,
                    ctx.cycle_id,
                    unit.task_id,
                    charge_key=f"proxy-session:{entry.session.name}",
                    tokens=tokens,
                    cost_usd=cost,
                    requests=usage.requests,
                )
            except Exception as exc:
                message = self.scrubbed((str(exc).splitlines() or [""])[0])
                logger.error("episode %s attempt %d: could not charge its session: %s", slug, attempt, message)


@dataclass
class _AttemptProxySession:
    """A session the publisher opened for one attempt, and what the proxy answered when it was closed."""

    session: ProxySession
    closed: ClosedSession | None = None


def _with_proxy_counts(
    record: EpisodeRecord, status: dict[str, Any], closed: ClosedSession
) -> tuple[EpisodeRecord, dict[str, Any]]:
    """The row's fields and the status document with the proxy's counts in place of what the sandbox said."""
    usage = closed.usage
    counts = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "requests": usage.requests,
        "max_prompt_tokens": usage.max_prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
    }
    status = {**status, "usage": usage.as_dict()}
    if isinstance(status.get("hiw"), dict):
        status["hiw"] = {**status["hiw"], "api_requests": closed.records}
    return record.model_copy(update=counts), status


def _file_chunks(path: Path) -> Iterator[bytes]:
    """The bytes of `path` (a file of the publisher's side) in pieces; nothing when it does not exist."""
    with contextlib.suppress(FileNotFoundError), path.open("rb") as source:
        while chunk := source.read(1 << 20):
            yield chunk


def _read_descriptor(fd: int, max_bytes: int) -> bytes | None:
    """The whole file behind `fd` from its start (None when over `max_bytes`), leaving its offset alone."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.pread(fd, 1 << 20, total):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            return None
    return b"".join(chunks)
