"""Logging reverse proxy between the agent (qwen-code) and the model server; its log is the episode's trajectory.

Every request is forwarded unchanged (but see "Server priority") to the upstream (method, path + query, body,
end-to-end headers) and answered with the upstream's status, headers and body; SSE streams are relayed chunk by chunk
as they arrive, never buffered.
One JSONL record per request is appended to the log when the exchange ends (MASS_SPEC §4):

    ts_start, ts_start_iso, method, path, seq, request_bytes, request | request_raw, status, response_headers,
    stream, response_bytes, response | response_raw, sse_raw, duration_s, [client_disconnected], [proxy_error]

`response` is the parsed JSON body, or for a stream the `chat.completion.reassembled` object of `sse.py`. `path` is
logged without its query string and only the response headers `content-type` and `x-request-id` are logged: keys can
travel in headers and query strings, and the log becomes training data and an artifact. An upstream failure before
the response starts yields HTTP 502 to the client and `proxy_error` = the exception class name only (messages can
quote URLs and headers); a failure mid-stream is recorded the same way and the client connection is closed so the
client sees the stream cut as it happened.

Logging stays off the relay path: bytes are only copied while they pass, and the record (JSON parsing, SSE
reassembly, serialisation) is built after the client has the whole response. Records of one log are written one
after another in the order their exchanges ended (sort by `seq` for request order). Each record is one `write()` on
an O_APPEND descriptor, so lines stay whole; `stop()` waits for every pending record before closing the log.
Small records are built on a worker thread. A large one (request plus response of `RECORD_PROCESS_BYTES` or more) is
built by the record writer, a child process shared by every proxy of this process (`_RecordWriter`): building a
50 MB stream's record takes seconds of Python, and on a thread of this process it would hold the GIL that the relay
needs, adding the interpreter's switch interval (5 ms) to every wake-up of the event loop — the p95 tail of small
requests — and slowing the streams it relays meanwhile. The writer runs at a lower CPU priority than the relay,
writes the very record the thread would have written (same code), and answers with the response's usage for the
budget; if it cannot be started or fails, the record is built on the thread instead, so none is lost.

The proxy, not the agent, holds the inference key (ISSUE #13.4: redaction alone let encoded copies of a key the
agent could read reach its workspace). Given `agent_token`, the proxy accepts only requests that carry
`Authorization: Bearer <agent_token>` (compared in constant time); any other request gets HTTP 401, never reaches the
upstream, and is logged without its headers or body (`rejected`: `missing_token` or `wrong_token`). Accepted requests
lose the agent's `Authorization` header and get `Authorization: Bearer <upstream_api_key>` instead. The token is a
random value per episode (`new_agent_token`), worthless once the episode's proxy session ends. As a second line of
defence every record is written with the upstream key's bytes replaced by `[REDACTED]` (an upstream could echo it).

Budgets (ISSUE #15.2): given an `EpisodeBudget`, every chat completion is checked before it is forwarded. Its need
is the request's prompt estimate (body bytes / 4: the JSON around the messages makes it an over-estimate) plus its
`max_tokens` / `max_completion_tokens` (else the configured episode max output). When the need does not fit what is
left of the episode's token budget (this proxy's spend plus its requests in flight), or of the cycle's shared ledger
scopes (`mass_ops.store.budgets`: the task's and the cycle's), the request gets HTTP 402 with an OpenAI-shaped error
whose `code` is `budget_exhausted` — never forwarded — and its record carries `budget_exhausted` (scope, setting,
limit, spent, need). Each response's reported usage is added to the episode's spend and to the ledger when its
record is written. Where the server reports cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`), the
record carries them as `cached_prompt_tokens` too.

Server priority (ISSUE #17.2): given `request_priority`, every completion request that is a JSON object is forwarded
with its top-level `priority` set to that value — the episode's place on the cycle's critical path, for a vLLM server
that schedules by priority (`mass_ops.critical_path`). It replaces any priority the agent sent: the agent is
untrusted and must not move its own work up the server's queue. This is the one change the proxy makes to a
request's body, and the record holds the body as forwarded. When the body holds no `"priority"` key anywhere, the
field is appended without parsing the body (a copy, no JSON round trip); otherwise the body is parsed and written
again with the field set.

Deployment decision: **one proxy per episode, on an ephemeral port** (`port=0`), not one shared proxy.
- Isolation: the log *is* the episode's trajectory; a per-episode proxy needs no request-to-episode attribution
  (qwen-code sends no episode id) and the log file is complete and closed when the episode ends, ready to gzip.
- Crash containment: a proxy failure (or a pathological stream) affects one episode, which the runner retries as an
  infrastructure failure; a shared proxy would fail every concurrent episode at once.
- Concurrency: ephemeral ports let any number of episodes run side by side without port bookkeeping.
The cost is one aiohttp server per episode (a few MB, milliseconds to start), negligible next to an episode.

In a Kubernetes episode pod the key must not be in the agent's container at all (the agent's shell commands could
read any process's environment there), so the proxy runs in a container of its own beside the sandbox and the
publisher — containers of one pod share the network — as a `SessionProxy` (`serve_episode_proxy`, started as
`python -m mass_ops.runtime.proxy --sessions-dir DIR ...`). The sandbox's runner opens one session per attempt
(`open_proxy_session`: a fresh token and a log file of its own under DIR, which the sandbox mounts read-only) and
closes it when the agent has ended (`close_proxy_session`), so each attempt still gets exactly its own log. Session
control (`/_mass_proxy/...`) is reachable from the sandbox: the agent could open sessions of its own, but every
request it makes with the key still passes through this proxy and is logged; the key is added only for the
configured upstreams and hosts under the allowed suffixes (the pod's egress policy reaches nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import hmac
import io
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from yarl import URL

from mass_ops.errors import InfrastructureError, InputError
from mass_ops.runtime.sse import SSEAssembler
from mass_ops.store.budgets import EPISODE_SCOPE, BudgetLedger, Refusal

logger = logging.getLogger(__name__)

HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
LOGGED_RESPONSE_HEADERS = ("content-type", "x-request-id")
MAX_REQUEST_BYTES = 4 * 1024**3
CONNECT_TIMEOUT_S = 30.0
HANDLER_DRAIN_S = 5.0  # how long stop() waits for in-flight handlers to write their records
# Records whose request + response bodies reach this size are built by the record writer process, not on a thread
# (about 10 ms of Python per 256 KiB of SSE: below this a thread's GIL hold costs the relay less than the hand-off).
RECORD_PROCESS_BYTES = 256 * 1024
RECORD_WRITER_NICE = 10  # the writer yields the CPU to the relay: a record can wait, a stream cannot
RECORD_WRITER_FLAG = "--record-writer"
WHOLE_BODY_BYTES = 1024**2
# Headers that carry credentials: with token auth the agent's are dropped and the proxy sets its own.
CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})
BEARER = "bearer "
TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits
DEFAULT_KEY_VALUE = "EMPTY"  # what a local vLLM accepts when it was started without --api-key (the reference default)
MIN_REDACTED_SECRET = 8  # shorter "keys" (e.g. EMPTY) are placeholders; replacing them would corrupt ordinary text
REDACTION = b"[REDACTED]"
# Session control of a pod's `SessionProxy` (a prefix no OpenAI-compatible route uses).
CONTROL_PREFIX = "/_mass_proxy"
CONTROL_TIMEOUT_S = 30.0
MAX_SESSIONS = 64
REJECTED_LOG = "rejected.jsonl"
# A request refused by a budget: 402 (payment required), which OpenAI clients and qwen-code do not retry as they do a
# 429, and an error code no server uses, so neither the agent nor the classifier can take it for anything else.
BUDGET_STATUS = 402
BUDGET_ERROR_CODE = "budget_exhausted"
COMPLETION_PATH_SUFFIXES = ("/chat/completions", "/completions")
PROMPT_BYTES_PER_TOKEN = 4


class ProxyConfigError(InputError):
    """The proxy cannot start as asked (key variable, upstreams, arguments)."""


class ProxySessionError(InfrastructureError):
    """A pod's episode proxy did not open or close a session (it is not up, or refused)."""


def new_agent_token() -> str:
    """A fresh per-episode token: what the agent presents to its proxy instead of a key."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def upstream_key_from_env(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The upstream key from variable `name` ("EMPTY" when unset, as a local server without --api-key accepts).

    Whitespace would break the Authorization header: refused with one line naming the variable, never the value.
    """
    value = (os.environ if environ is None else environ).get(name, "") or DEFAULT_KEY_VALUE
    if any(char.isspace() for char in value):
        raise ProxyConfigError(f"episode proxy: environment variable {name} (the API key) contains whitespace")
    return value


def usage_tokens(usage: Any) -> tuple[int, int | None]:
    """(prompt + completion tokens, cached prompt tokens or None) of an OpenAI `usage` object (zeros if absent)."""
    if not isinstance(usage, dict):
        return 0, None
    total = sum(
        value
        for value in (usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0
    )
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return total, cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def usage_cost(usage: Any) -> float:
    """The server-reported cost of a response in USD (OpenRouter's `usage.cost`), else 0."""
    cost = usage.get("cost") if isinstance(usage, dict) else None
    return float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) and cost > 0 else 0.0


class EpisodeBudget:
    """What one episode's proxy enforces before forwarding a completion (module docstring, "Budgets").

    `episode_tokens` is held here in memory (the proxy sees all of the episode's requests); `ledger` + `scopes`
    are the cycle's shared budgets (the task's and the cycle's). Thread-safe: records are settled on worker threads.
    """

    def __init__(
        self,
        *,
        episode_tokens: int | None,
        default_max_tokens: int,
        ledger: BudgetLedger | None = None,
        scopes: Sequence[str] = (),
    ) -> None:
        self.episode_tokens = episode_tokens
        self.default_max_tokens = default_max_tokens
        self.ledger = ledger if ledger is not None and ledger.limits.limited(scopes) else None
        self.ledger_scopes = tuple(scopes)
        self.spent = 0  # tokens of this episode's responses so far
        self.in_flight = 0  # needs of admitted requests whose spend is not settled yet
        self.refusals = 0
        self._lock = threading.Lock()

    @property
    def uses_store(self) -> bool:
        """Whether admitting a request reads the metadata store (then call `admit` off the event loop)."""
        return self.ledger is not None

    def need(self, body: bytes) -> int:
        """Tokens a request may use at most: its prompt estimate plus its max output tokens."""
        max_tokens = None
        try:
            document = json.loads(body) if body else None
        except (ValueError, RecursionError):  # nesting deeper than the parser's stack is not JSON we can read
            document = None
        if isinstance(document, dict):
            for name in ("max_completion_tokens", "max_tokens"):
                value = document.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    max_tokens = value
                    break
        prompt = -(-len(body) // PROMPT_BYTES_PER_TOKEN)
        return prompt + (max_tokens if max_tokens is not None else self.default_max_tokens)

    def admit(self, need: int) -> Refusal | None:
        """Hold `need` in flight and return None, or return why the request may not be sent."""
        with self._lock:
            used = self.spent + self.in_flight
            if self.episode_tokens is not None and used + need > self.episode_tokens:
                self.refusals += 1
                return Refusal(EPISODE_SCOPE, "budgets.episode_tokens", self.episode_tokens, used, need, "tokens")
            self.in_flight += need
        if self.ledger is not None:
            refused = self.ledger.try_admit(self.ledger_scopes, need)
            if refused is not None:
                with self._lock:
                    self.in_flight -= need
                    self.refusals += 1
                return refused
        return None

    def settle(self, need: int, usage: Any) -> None:
        """The admitted request of `need` ended with `usage` (None when it failed): add its spend, end its hold."""
        tokens, _cached = usage_tokens(usage)
        try:
            if self.ledger is not None:
                self.ledger.record(self.ledger_scopes, tokens=tokens, cost_usd=usage_cost(usage))
        except Exception as exc:  # the record must still be written; the spend stays counted for this episode
            logger.warning("episode proxy: could not record %d tokens in the budget ledger: %s", tokens, exc)
        finally:
            with self._lock:
                self.spent += tokens
                self.in_flight -= need
            if self.ledger is not None:
                self.ledger.release(self.ledger_scopes, need)


PRIORITY_KEY = b'"priority"'
JSON_WHITESPACE = b" \t\r\n"


def with_priority(body: bytes, priority: int) -> bytes:
    """`body` with its top-level `priority` set to `priority` when it is a JSON object; any other body as it is (the
    upstream answers it as it would have)."""
    text = body.strip()
    if not (text.startswith(b"{") and text.endswith(b"}")):
        return body
    field = PRIORITY_KEY + b":" + str(int(priority)).encode()
    if PRIORITY_KEY not in text:
        # No key of that name anywhere: insert it before the closing brace, one copy instead of a parse (a request
        # late in an episode can be a megabyte).
        end = len(text) - 1
        while text[end - 1] in JSON_WHITESPACE:
            end -= 1
        separator = b"" if end == 1 else b","
        return b"".join((memoryview(text)[:end], separator, field, b"}"))
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(document, dict):
        return body
    document["priority"] = int(priority)
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _end_to_end_headers(headers: Any) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones, including any the `Connection` header names (RFC 9110 §7.6.1)."""
    named = {token.strip().lower() for value in headers.getall("Connection", []) for token in value.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP_HEADERS and k.lower() not in named]


RELAY_READ_BUFFER = 2**18  # bytes


def _redaction_needles(secret: str | None) -> tuple[bytes, ...]:
    """The byte forms of `secret` a JSON record can hold (raw and JSON-escaped); none for placeholders."""
    if not secret or secret == DEFAULT_KEY_VALUE or len(secret.encode()) < MIN_REDACTED_SECRET:
        return ()
    forms = {secret.encode("utf-8"), json.dumps(secret)[1:-1].encode("utf-8")}
    return tuple(sorted(forms, key=len, reverse=True))


def _record_line(record: dict[str, Any], needles: Sequence[bytes]) -> bytes:
    """`record` as one redacted JSONL line."""
    data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    for needle in needles:
        data = data.replace(needle, REDACTION)
    return data


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _RecordLog:
    """Append-only JSONL file; one `os.write` per record so concurrent records never interleave."""

    def __init__(self, path: Path, *, redact: str | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.needles = _redaction_needles(redact)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, record: dict[str, Any]) -> None:
        _write_all(self._fd, _record_line(record, self.needles))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _RecordWriterError(Exception):
    """The record writer process is gone or broke the protocol (the caller builds the record itself)."""


class _RecordWriter:
    """A child process that builds and appends large records (module docstring); one per proxy process.

    Protocol on its stdin/stdout, one exchange at a time: the parent sends a frame `!III` (header, request body and
    response payload lengths) + a JSON header (log path, redaction needles, the exchange's small fields) + the two
    payloads; the child appends the record to the log and answers `!I` + JSON `{"usage": ...}` (the response's usage,
    for the budget) or `{"error": "<class name>"}` when it could not build or write the record.
    """

    _shared: _RecordWriter | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mass_ops.runtime.proxy", RECORD_WRITER_FLAG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._to_child = self._process.stdin.fileno()
        self._from_child = self._process.stdout.fileno()
        self._lock = threading.Lock()
        self.broken = False

    @classmethod
    def shared(cls) -> _RecordWriter | None:
        """This process's writer, started on first use (and again if it broke); None if it cannot start."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared.broken:
                try:
                    cls._shared = cls()
                except OSError as exc:
                    logger.warning("episode proxy: no record writer process (%s); records built on threads", exc)
                    return None
                atexit.register(cls._shared.close)
            return cls._shared

    def append(self, log: _RecordLog, exchange: _Exchange, *, keep_raw_sse: bool) -> Any:
        """Have the child append `exchange`'s record to `log`; returns the response's usage. _RecordWriterError."""
        # A stream's pieces go to the child one by one: joining 50 MB here would hold this process's GIL meanwhile.
        payload = exchange.assembler.pieces() if exchange.stream else [exchange.response_body]
        payload_size = sum(len(piece) for piece in payload)
        header = json.dumps(
            {
                "log": str(log.path),
                "needles": [needle.decode("utf-8") for needle in log.needles],
                "keep_raw_sse": keep_raw_sse,
                "exchange": exchange.small_fields(),
            }
        ).encode("utf-8")
        with self._lock:
            if self.broken:
                raise _RecordWriterError("record writer already failed")
            try:
                _write_all(self._to_child, struct.pack("!III", len(header), len(exchange.request_body), payload_size))
                for part in (header, exchange.request_body, *payload):
                    _write_all(self._to_child, part)
                (size,) = struct.unpack("!I", _read_exactly(self._from_child, 4))
                answer = json.loads(_read_exactly(self._from_child, size))
            except (OSError, ValueError, struct.error) as exc:
                self.broken = True
                self.close()
                raise _RecordWriterError(type(exc).__name__) from None
        if not isinstance(answer, dict) or "error" in answer:
            # The child wrote nothing (it answers only after a whole write, or instead of one).
            error = answer.get("error") if isinstance(answer, dict) else "malformed answer"
            raise _RecordWriterError(str(error))
        return answer.get("usage")

    def close(self) -> None:
        """End the child (it exits on end of input) and reap it."""
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(timeout=HANDLER_DRAIN_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


def _read_exactly(fd: int, size: int) -> bytearray:
    """`size` bytes from `fd`; OSError when the pipe ends first."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise OSError("record writer pipe closed")
        data += chunk
    return data


def _record_writer_main() -> None:
    """The record writer process: read frames from stdin, append records, answer on stdout (`_RecordWriter`)."""
    with contextlib.suppress(OSError):
        os.nice(RECORD_WRITER_NICE)
    requests, answers = 0, os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the answers
    while True:
        try:
            head = _read_exactly(requests, 12)
        except OSError:
            return  # the parent closed the pipe (or exited): no record can be pending
        header_size, request_size, payload_size = struct.unpack("!III", head)
        header = json.loads(_read_exactly(requests, header_size))
        request_body = bytes(_read_exactly(requests, request_size))
        payload = _read_exactly(requests, payload_size)
        try:
            exchange = _Exchange.from_small_fields(header["exchange"], request_body, payload)
            record = exchange.to_record(keep_raw_sse=header["keep_raw_sse"])
            line = _record_line(record, [needle.encode("utf-8") for needle in header["needles"]])
            fd = os.open(header["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                _write_all(fd, line)
            finally:
                os.close(fd)
            response = record.get("response")
            answer: dict[str, Any] = {"usage": response.get("usage") if isinstance(response, dict) else None}
        except Exception as exc:  # the parent builds this record itself; the writer serves the next one
            answer = {"error": type(exc).__name__}
        data = json.dumps(answer).encode("utf-8")
        _write_all(answers, struct.pack("!I", len(data)) + data)


@dataclass(eq=False)
class _Session:
    """One episode's share of a proxy: the token it accepts (None = no check), its upstream and its log."""

    name: str
    token: bytes | None
    upstream: str
    log: _RecordLog
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    pending: set[asyncio.Task[None]] = field(default_factory=set)
    last_record: asyncio.Task[None] | None = None  # the newest record task: the next one is written after it
    records: int = 0
    budget: EpisodeBudget | None = None
    priority: int | None = None  # stamped on every completion request (module docstring, "Server priority")


class LoggingProxy:
    """Reverse proxy to `upstream_base_url` (scheme://host[:port][/prefix], no `/v1`) logging to `log_path`.

    With `agent_token`, only requests bearing that token pass (401 otherwise), and their credentials are replaced
    by `upstream_api_key` (if given); without it the proxy is open and forwards the client's headers as they are.
    Use `await start()` / `await stop()` or `async with`. `port` and `url` are valid after start.
    """

    def __init__(
        self,
        upstream_base_url: str,
        log_path: Path | str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keep_raw_sse: bool = True,
        agent_token: str | None = None,
        upstream_api_key: str | None = None,
        budget: EpisodeBudget | None = None,
        request_priority: int | None = None,
    ) -> None:
        if upstream_api_key is not None and agent_token is None:
            # An open proxy that adds the key would hand the key's power to anything that can reach the port.
            raise ProxyConfigError("episode proxy: an upstream key needs an agent token (the proxy would be open)")
        self.upstream_base_url = upstream_base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.host = host
        self.keep_raw_sse = keep_raw_sse
        self._agent_token = agent_token
        self._upstream_api_key = upstream_api_key
        self.budget = budget
        self.request_priority = request_priority
        self._requested_port = port
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sessions: dict[str, _Session] = {}
        self._rejections: _Session | None = None  # where refused requests are logged
        self._handlers: set[asyncio.Task[object]] = set()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LoggingProxy.port read before start()")
        return self._port

    @property
    def url(self) -> str:
        """Base URL clients use instead of the upstream's (append `/v1` for OpenAI clients)."""
        return f"http://{self.host}:{self.port}"

    @property
    def _token_auth(self) -> bool:
        return self._agent_token is not None

    def _open_logs(self) -> None:
        token = self._agent_token.encode() if self._agent_token is not None else None
        episode = _Session(
            "episode",
            token,
            self.upstream_base_url,
            _RecordLog(self.log_path, redact=self._upstream_api_key),
            budget=self.budget,
            priority=self.request_priority,
        )
        self._sessions[episode.name] = episode
        self._rejections = episode  # one log per episode: its refused requests belong to its trajectory's evidence

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._handle)

    async def start(self) -> None:
        self._open_logs()
        # No total/read timeout: a reasoning model may think for many minutes before its first byte; limit=0 because
        # the per-episode proxy must never queue the agent's parallel subagent requests behind a pool limit.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            # Larger reads mean fewer relay iterations per megabyte; each chunk is still sent on as soon as it
            # arrives (a read returns whatever is buffered, never waiting to fill the buffer).
            read_bufsize=RELAY_READ_BUFFER,
        )
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        self._add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        # Close the upstream side first so a stalled stream ends, then let every handler reach its `finally` (which
        # queues the exchange's record) before the logs close: a record must not be lost at shutdown.
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=HANDLER_DRAIN_S)
        logs = list(self._sessions.values())
        if self._rejections is not None and self._rejections not in logs:
            logs.append(self._rejections)
        for log in logs:
            if log.pending:
                await asyncio.gather(*log.pending)
            log.log.close()
        self._sessions.clear()
        self._rejections = None

    async def __aenter__(self) -> LoggingProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _authenticate(self, request: web.Request) -> tuple[_Session | None, str | None]:
        """The session whose token the request bears, else (None, why). Every token is compared, in constant time."""
        if not self._token_auth:
            return next(iter(self._sessions.values())), None
        header = request.headers.get("Authorization", "")
        if not header.lower().startswith(BEARER) or not header[len(BEARER) :].strip():
            return None, "missing_token"
        presented = header[len(BEARER) :].strip().encode("utf-8", errors="replace")
        match = None
        for session in list(self._sessions.values()):
            if session.token is not None and hmac.compare_digest(session.token, presented):
                match = session
        return (match, None) if match is not None else (None, "wrong_token")

    def _upstream_headers(self, request: web.Request) -> list[tuple[str, str]]:
        # `Expect: 100-continue` was already answered by this server, which holds the whole body.
        dropped = {"accept-encoding", "expect"}
        if self._token_auth:
            dropped |= CREDENTIAL_HEADERS
        headers = [(k, v) for k, v in _end_to_end_headers(request.headers) if k.lower() not in dropped]
        headers.append(("Accept-Encoding", "identity"))
        if self._upstream_api_key is not None:
            headers.append(("Authorization", f"Bearer {self._upstream_api_key}"))
        return headers

    def _reject(self, request: web.Request, reason: str) -> web.Response:
        """401 without reading the body or contacting the upstream; recorded without headers or body."""
        log = self._rejections
        assert log is not None
        exchange = _Exchange(seq=next(log.seq), method=request.method, path=request.path, status=401, rejected=reason)
        exchange.request_bytes = request.content_length or 0
        self._record_later(log, exchange)
        message = "missing episode token" if reason == "missing_token" else "wrong episode token"
        return web.json_response(
            {"error": {"message": f"episode proxy: {message}", "type": "authentication_error"}}, status=401
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        handler = asyncio.current_task()
        session, reason = self._authenticate(request)
        if session is None:
            return self._reject(request, reason or "wrong_token")
        if handler is not None:
            for tracked in (self._handlers, session.handlers):
                tracked.add(handler)
                handler.add_done_callback(tracked.discard)
        assert self._session is not None
        exchange = _Exchange(seq=next(session.seq), method=request.method, path=request.path)
        exchange.request_body = await request.read()
        completion = request.method == "POST" and request.path.endswith(COMPLETION_PATH_SUFFIXES)
        if completion and session.priority is not None:
            exchange.request_body = with_priority(exchange.request_body, session.priority)
        exchange.request_bytes = len(exchange.request_body)
        budget = session.budget
        if budget is not None and completion:
            need = budget.need(exchange.request_body)
            # The shared ledger is a database read: off the loop that relays every other stream.
            refused = await asyncio.to_thread(budget.admit, need) if budget.uses_store else budget.admit(need)
            if refused is not None:
                return self._refuse_over_budget(session, exchange, refused)
            exchange.budget_need = need
        target = URL(session.upstream + request.raw_path, encoded=True)
        try:
            async with self._session.request(
                request.method,
                target,
                headers=self._upstream_headers(request),
                # A file-like payload is sent in pieces (raw bytes would be written in one blocking call).
                data=io.BytesIO(exchange.request_body) if exchange.request_body else None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Content-Type"),
            ) as upstream:
                response = await self._relay(request, upstream, exchange)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # Raised before any byte reached the client (failures mid-body are handled in _relay).
            exchange.proxy_error = type(exc).__name__
            exchange.status = 502
            response = web.json_response(
                {"error": {"message": f"upstream request failed: {type(exc).__name__}", "type": "proxy_error"}},
                status=502,
            )
        except asyncio.CancelledError:
            exchange.client_disconnected = True
            raise
        finally:
            exchange.duration_s = time.monotonic() - exchange.started
            self._record_later(session, exchange)
        return response

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, exchange: _Exchange
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("Content-Type", "")
        exchange.stream = content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
        exchange.status = upstream.status
        exchange.response_headers = {
            name: upstream.headers[name] for name in LOGGED_RESPONSE_HEADERS if name in upstream.headers
        }
        headers = _end_to_end_headers(upstream.headers)
        length = upstream.content_length
        if not exchange.stream and length is not None and length <= WHOLE_BODY_BYTES:
            # Small complete bodies go out in one write with their headers: the cheapest path for short calls.
            body = await upstream.read()
            exchange.response_body += body
            exchange.response_bytes = len(body)
            return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in headers:
            response.headers.add(name, value)
        if not exchange.stream and length is not None:
            response.content_length = length
        sink = exchange.assembler.feed if exchange.stream else exchange.response_body.extend
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    # Headers are already sent: mirror the cut to the client instead of inventing an ending.
                    exchange.proxy_error = type(exc).__name__
                    _close_client(request)
                    break
                if not chunk:
                    await response.write_eof()
                    break
                sink(chunk)
                exchange.response_bytes += len(chunk)
                await response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            exchange.client_disconnected = True
        return response

    def _refuse_over_budget(self, session: _Session, exchange: _Exchange, refused: Refusal) -> web.Response:
        """HTTP 402 `budget_exhausted`, never forwarded; the record says which budget refused and why."""
        exchange.status = BUDGET_STATUS
        exchange.budget_exhausted = {
            "scope": refused.scope,
            "setting": refused.setting,
            "limit": refused.limit,
            "spent": refused.spent,
            "need": refused.need,
            "unit": refused.unit,
        }
        error = {"message": refused.message, "type": BUDGET_ERROR_CODE, "code": BUDGET_ERROR_CODE}
        exchange.response_body += json.dumps({"error": error}).encode()
        exchange.response_bytes = len(exchange.response_body)
        self._record_later(session, exchange)
        return web.json_response({"error": error}, status=BUDGET_STATUS)

    def _record_later(self, log: _Session, exchange: _Exchange) -> None:
        """Build and append the record off the event loop, after the log's previous record (module docstring)."""
        task = asyncio.get_running_loop().create_task(self._record_after(log.last_record, log, exchange))
        log.last_record = task
        log.pending.add(task)
        task.add_done_callback(log.pending.discard)

    async def _record_after(self, previous: asyncio.Task[None] | None, log: _Session, exchange: _Exchange) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its failure is its own (raised by stop()); this record is still written
        await asyncio.to_thread(self._append, log, exchange)

    def _append(self, log: _Session, exchange: _Exchange) -> None:
        usage: Any = None
        try:
            usage = self._append_record(log.log, exchange)
            log.records += 1
        finally:
            if log.budget is not None and exchange.budget_need is not None:
                log.budget.settle(exchange.budget_need, usage)

    def _append_record(self, log: _RecordLog, exchange: _Exchange) -> Any:
        """Append `exchange`'s record to `log` (large ones by the record writer); returns the response's usage."""
        if exchange.body_bytes() >= RECORD_PROCESS_BYTES:
            writer = _RecordWriter.shared()
            if writer is not None:
                try:
                    return writer.append(log, exchange, keep_raw_sse=self.keep_raw_sse)
                except _RecordWriterError as exc:
                    logger.warning("episode proxy: record writer failed (%s); record %d built here", exc, exchange.seq)
        record = exchange.to_record(keep_raw_sse=self.keep_raw_sse)
        log.append(record)
        response = record.get("response")
        return response.get("usage") if isinstance(response, dict) else None


@dataclass
class _Exchange:
    """What one request/response exchange left behind; `to_record()` turns it into the log record."""

    seq: int
    method: str
    path: str
    ts_start: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    request_body: bytes = b""
    request_bytes: int = 0
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    assembler: SSEAssembler = field(default_factory=SSEAssembler)
    response_body: bytearray = field(default_factory=bytearray)
    response_bytes: int = 0
    duration_s: float = 0.0
    client_disconnected: bool = False
    proxy_error: str | None = None
    rejected: str | None = None  # why the proxy refused the request (no token, wrong token): never forwarded
    budget_need: int | None = None  # tokens held for this request by the episode's budget until it is settled
    budget_exhausted: dict[str, Any] | None = None  # the budget that refused it (never forwarded)

    def body_bytes(self) -> int:
        """Bytes of request and response body the record is built from."""
        return len(self.request_body) + (self.assembler.size if self.stream else len(self.response_body))

    def small_fields(self) -> dict[str, Any]:
        """The JSON-able fields `to_record()` reads besides the bodies (what the record writer is sent)."""
        return {name: getattr(self, name) for name in _SMALL_FIELDS}

    @classmethod
    def from_small_fields(cls, fields: dict[str, Any], request_body: bytes, payload: bytearray) -> _Exchange:
        """The exchange `small_fields()` came from, given its request body and response body (or raw SSE)."""
        exchange = cls(**{name: fields[name] for name in _SMALL_FIELDS}, request_body=request_body)
        if exchange.stream:
            exchange.assembler.raw = payload
        else:
            exchange.response_body = payload
        return exchange

    def to_record(self, *, keep_raw_sse: bool) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ts_start": self.ts_start,
            "ts_start_iso": datetime.fromtimestamp(self.ts_start, UTC).isoformat(),
            "method": self.method,
            "path": self.path,
            "seq": self.seq,
            "request_bytes": self.request_bytes,
        }
        _put_body(record, "request", self.request_body)
        record["status"] = self.status
        record["response_headers"] = self.response_headers
        record["stream"] = self.stream
        record["response_bytes"] = self.response_bytes
        if self.stream:
            record["response"] = self.assembler.result()
            if keep_raw_sse:
                record["sse_raw"] = self.assembler.raw.decode("utf-8", errors="replace")
        elif self.proxy_error is None or self.response_body:
            _put_body(record, "response", bytes(self.response_body))
        else:
            record["response"] = None
        record["duration_s"] = round(self.duration_s, 6)
        if self.client_disconnected:
            record["client_disconnected"] = True
        if self.proxy_error is not None:
            record["proxy_error"] = self.proxy_error
        if self.rejected is not None:
            record["rejected"] = self.rejected
        if self.budget_exhausted is not None:
            record["budget_exhausted"] = self.budget_exhausted
        response = record.get("response")
        _total, cached = usage_tokens(response.get("usage") if isinstance(response, dict) else None)
        if cached is not None:
            record["cached_prompt_tokens"] = cached
        return record


_SMALL_FIELDS = (
    "seq",
    "method",
    "path",
    "ts_start",
    "request_bytes",
    "status",
    "response_headers",
    "stream",
    "response_bytes",
    "duration_s",
    "client_disconnected",
    "proxy_error",
    "rejected",
    "budget_exhausted",
)


def _put_body(record: dict[str, Any], key: str, body: bytes) -> None:
    """Store `body` as parsed JSON under `key`, else as text under `<key>_raw` (None for an empty body)."""
    if not body:
        record[key] = None
        return
    try:
        record[key] = json.loads(body)
    except (ValueError, RecursionError):
        record[f"{key}_raw"] = body.decode("utf-8", errors="replace")


def _close_client(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(f"{port}\n")
    os.replace(handle.name, path)


# --- a pod's proxy: one session per attempt ------------------------------------------------------------------------


def _base_url(url: str) -> str | None:
    """`url` as scheme://host[:port][/path] without a trailing slash; None unless a plain http(s) URL."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.query or parts.fragment:
        return None
    return f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")


class SessionProxy(LoggingProxy):
    """The episode proxy of a Kubernetes pod: each attempt opens a session with its own token and log.

    `upstreams` are the base URLs a session may name (the first is the default); a URL on a host ending in one of
    `allowed_host_suffixes` (e.g. `.<namespace>.svc`: a rollout's server of another generation) is accepted too.
    The key is sent to no other host. Control routes (JSON):

        POST {CONTROL_PREFIX}/sessions              {"upstream"?, "episode_tokens"?, "default_max_tokens"?}
                                                                       -> 201 {"session", "token", "log"}
        POST {CONTROL_PREFIX}/sessions/ID/close     {"discard"?}       -> 200 {"records"}
        GET  {CONTROL_PREFIX}/health                                   -> 200 {"status": "ok", "sessions"}

    `log` is the session log's file name under `sessions_dir`; refused requests go to `rejected.jsonl` there.
    `request_priority` is stamped on every session's completion requests (the pod runs one episode).
    """

    def __init__(
        self,
        sessions_dir: Path | str,
        *,
        upstreams: Sequence[str],
        upstream_api_key: str,
        allowed_host_suffixes: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        keep_raw_sse: bool = True,
        request_priority: int | None = None,
    ) -> None:
        bases = [_base_url(url) for url in upstreams]
        if not bases or any(base is None for base in bases):
            raise ProxyConfigError(f"episode proxy: --upstream {list(upstreams)} must be http(s) base URLs")
        if any(not suffix.startswith(".") or len(suffix) < 2 for suffix in allowed_host_suffixes):
            raise ProxyConfigError("episode proxy: an allowed host suffix starts with '.' (e.g. .mass-ops.svc)")
        self.sessions_dir = Path(sessions_dir)
        self.upstreams = tuple(base for base in bases if base is not None)
        self.allowed_host_suffixes = tuple(suffix.lower() for suffix in allowed_host_suffixes)
        super().__init__(
            self.upstreams[0],
            self.sessions_dir / REJECTED_LOG,
            host,
            port,
            keep_raw_sse=keep_raw_sse,
            agent_token="",  # token auth on; sessions bring the tokens
            upstream_api_key=upstream_api_key,
            # The pod's, for every session: fixed when the pod starts, so the sandbox cannot choose its own.
            request_priority=request_priority,
        )

    def _open_logs(self) -> None:
        self._rejections = _Session("rejected", None, self.upstream_base_url, _RecordLog(self.log_path))

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post(f"{CONTROL_PREFIX}/sessions", self._open_session)
        app.router.add_post(f"{CONTROL_PREFIX}/sessions/{{session}}/close", self._close_session)
        app.router.add_get(f"{CONTROL_PREFIX}/health", self._health)
        super()._add_routes(app)

    def allowed_upstream(self, url: str | None) -> str | None:
        """The base URL a session may use for `url` (None: the default), or None when the key may not go there."""
        if url is None:
            return self.upstreams[0]
        base = _base_url(url)
        if base is None:
            return None
        host = (urlsplit(base).hostname or "").lower()
        if base in self.upstreams or any(host.endswith(suffix) for suffix in self.allowed_host_suffixes):
            return base
        return None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self._sessions)})

    async def _open_session(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        upstream = self.allowed_upstream(body.get("upstream") if isinstance(body.get("upstream"), str) else None)
        if upstream is None or ("upstream" in body and not isinstance(body["upstream"], str)):
            return _control_error(403, "upstream not allowed for this proxy")
        if len(self._sessions) >= MAX_SESSIONS:
            return _control_error(429, f"too many open sessions ({MAX_SESSIONS})")
        limits = [body.get(key) for key in ("episode_tokens", "default_max_tokens")]
        if any(value is not None and (not isinstance(value, int) or value < 1) for value in limits):
            return _control_error(400, "episode_tokens and default_max_tokens must be positive integers")
        budget = None
        if limits[0] is not None:
            # A pod's proxy holds the episode's own token budget; the cycle's shared ledger is checked by the runner
            # before each attempt (this container has no metadata store).
            budget = EpisodeBudget(episode_tokens=limits[0], default_max_tokens=limits[1] or 1)
        name = secrets.token_hex(8)
        token = new_agent_token()
        log = _RecordLog(self.sessions_dir / f"{name}.jsonl", redact=self._upstream_api_key)
        self._sessions[name] = _Session(
            name, token.encode(), upstream, log, budget=budget, priority=self.request_priority
        )
        return web.json_response({"session": name, "token": token, "log": log.path.name}, status=201)

    async def _close_session(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        session = self._sessions.pop(request.match_info["session"], None)
        if session is None:
            return _control_error(404, "no such session")
        # The agent has ended: give in-flight exchanges a moment to finish, then cut them (their records are kept).
        if session.handlers:
            _done, stuck = await asyncio.wait(set(session.handlers), timeout=HANDLER_DRAIN_S)
            for handler in stuck:
                handler.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=HANDLER_DRAIN_S)
        if session.pending:
            await asyncio.gather(*session.pending)
        session.log.close()
        if body.get("discard") is True:
            session.log.path.unlink(missing_ok=True)
        return web.json_response({"records": session.records})


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


def _control_error(status: int, message: str) -> web.Response:
    error = {"message": f"episode proxy: {message}", "type": "proxy_control"}
    return web.json_response({"error": error}, status=status)


@dataclass(frozen=True)
class ProxySession:
    """One attempt's session with a pod's `SessionProxy`: where the agent connects, with which token, and where
    the session's log can be read (the proxy's log folder as mounted on the reader's side)."""

    proxy_url: str
    name: str
    token: str
    log_path: Path


async def _control(proxy_url: str, path: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    url = f"{proxy_url.rstrip('/')}{CONTROL_PREFIX}{path}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as client,
            client.post(url, json=payload) as response,
        ):
            status = response.status
            data = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        raise ProxySessionError(f"episode proxy {proxy_url}: POST {path} failed: {type(exc).__name__}") from None
    if status >= 300 or not isinstance(data, dict):
        detail = ((data or {}).get("error") or {}).get("message") if isinstance(data, dict) else None
        raise ProxySessionError(f"episode proxy {proxy_url}: POST {path} answered HTTP {status} ({detail})")
    return data


async def open_proxy_session(
    proxy_url: str,
    log_dir: Path | str,
    *,
    upstream: str | None = None,
    timeout_s: float = CONTROL_TIMEOUT_S,
    episode_tokens: int | None = None,
    default_max_tokens: int | None = None,
) -> ProxySession:
    """Open a session on the pod's proxy at `proxy_url` (its logs readable under `log_dir`); ProxySessionError.

    `episode_tokens` (with the request default `default_max_tokens`) makes the session enforce that token budget."""
    payload: dict[str, Any] = {} if upstream is None else {"upstream": upstream}
    if episode_tokens is not None:
        payload |= {"episode_tokens": episode_tokens, "default_max_tokens": default_max_tokens}
    data = await _control(proxy_url, "/sessions", payload, timeout_s)
    name, token, log = data.get("session"), data.get("token"), data.get("log")
    if not all(isinstance(value, str) and value for value in (name, token, log)) or Path(str(log)).name != log:
        raise ProxySessionError(f"episode proxy {proxy_url}: the session answer is malformed")
    return ProxySession(proxy_url.rstrip("/"), str(name), str(token), Path(log_dir) / str(log))


async def close_proxy_session(
    session: ProxySession, *, discard: bool = False, timeout_s: float = CONTROL_TIMEOUT_S
) -> int:
    """Close `session` once its agent has ended; after this its log is complete. Returns the record count."""
    data = await _control(session.proxy_url, f"/sessions/{session.name}/close", {"discard": discard}, timeout_s)
    records = data.get("records")
    return records if isinstance(records, int) else 0


def copy_session_log(session: ProxySession, target: Path) -> None:
    """Copy a closed session's log to `target` (an empty file when the proxy logged nothing)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with session.log_path.open("rb") as source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    except FileNotFoundError:
        target.write_bytes(b"")


async def serve_episode_proxy(
    *,
    sessions_dir: Path | str,
    upstreams: Sequence[str],
    key_env: str,
    allowed_host_suffixes: Sequence[str] = (),
    listen: int = 0,
    host: str = "127.0.0.1",
    environ: Mapping[str, str] | None = None,
    port_file: Path | str | None = None,
    stop: asyncio.Event | None = None,
    request_priority: int | None = None,
) -> None:
    """Run a pod's `SessionProxy` until SIGTERM/SIGINT (or `stop`): the key comes from variable `key_env` of this
    process, which is the only one in the pod that holds it."""
    proxy = SessionProxy(
        sessions_dir,
        upstreams=upstreams,
        upstream_api_key=upstream_key_from_env(key_env, environ),
        allowed_host_suffixes=allowed_host_suffixes,
        host=host,
        port=listen,
        request_priority=request_priority,
    )
    await proxy.start()
    stopped = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # signal handlers exist only in the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
    if port_file:
        _write_port_file(Path(port_file), proxy.port)
    print(f"episode proxy on {proxy.url} -> {', '.join(proxy.upstreams)}, sessions in {sessions_dir}", flush=True)
    try:
        await stopped.wait()
    finally:
        await proxy.stop()


async def _serve(args: argparse.Namespace) -> None:
    proxy = LoggingProxy(
        args.upstream[0],
        args.log,
        host=args.host,
        port=args.listen,
        keep_raw_sse=args.keep_raw_sse,
        request_priority=args.request_priority,
    )
    await proxy.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    if args.port_file:
        _write_port_file(Path(args.port_file), proxy.port)
    print(f"logging proxy on {proxy.url} -> {proxy.upstream_base_url}, log {proxy.log_path}", flush=True)
    try:
        await stopped.wait()
    finally:
        await proxy.stop()


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run the proxy process's `main` on uvloop where it is installed (a relay's CPU per byte is mostly the event
    loop's), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def main(argv: list[str] | None = None) -> None:
    """`python -m mass_ops.runtime.proxy --listen PORT --upstream URL (--log PATH | --sessions-dir DIR --key-env
    NAME [--upstream URL ...] [--allow-host-suffix .ns.svc ...]) [--port-file F] [--request-priority N]`."""
    parser = argparse.ArgumentParser(prog="python -m mass_ops.runtime.proxy", description=__doc__.split("\n")[0])
    if (sys.argv[1:] if argv is None else argv) == [RECORD_WRITER_FLAG]:
        _record_writer_main()
        return
    parser.add_argument("--listen", type=int, required=True, help="port to bind (0 = ephemeral, see --port-file)")
    parser.add_argument(
        "--upstream", action="append", required=True, help="model server base URL without /v1 (sessions: repeatable)"
    )
    parser.add_argument("--log", help="JSONL file the request records are appended to (an open, keyless proxy)")
    parser.add_argument("--sessions-dir", help="a pod's episode proxy: one session log per attempt in this folder")
    parser.add_argument("--key-env", help="with --sessions-dir: the variable holding the upstream API key")
    parser.add_argument("--allow-host-suffix", action="append", default=[], help="with --sessions-dir (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--keep-raw-sse", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--request-priority", type=int, help="stamp this vLLM priority on every completion request (lower first)"
    )
    args = parser.parse_args(argv)
    if (args.log is None) == (args.sessions_dir is None):
        parser.error("give exactly one of --log or --sessions-dir")
    if args.sessions_dir is not None and not args.key_env:
        parser.error("--sessions-dir needs --key-env")
    if args.log is not None and (args.key_env or args.allow_host_suffix or len(args.upstream) > 1):
        parser.error("--key-env, --allow-host-suffix and several --upstream go with --sessions-dir")
    with contextlib.suppress(KeyboardInterrupt):
        if args.sessions_dir is None:
            _run(_serve(args))
            return
        try:
            _run(
                serve_episode_proxy(
                    sessions_dir=args.sessions_dir,
                    upstreams=args.upstream,
                    key_env=args.key_env,
                    allowed_host_suffixes=args.allow_host_suffix,
                    listen=args.listen,
                    host=args.host,
                    port_file=args.port_file,
                    request_priority=args.request_priority,
                )
            )
        except ProxyConfigError as exc:
            parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    main()
