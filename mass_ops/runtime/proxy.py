"""Logging reverse proxy between the agent (qwen-code) and the model server; its log is the episode's trajectory.

Every request the agent may make (see "Routes") is forwarded (generation requests as "Budgets" and "Server priority"
say) to the upstream (method, path + query, body, end-to-end headers) and answered with the upstream's status,
headers and body; SSE streams are relayed chunk by chunk as they arrive, never buffered.
One JSONL record per request is appended to the log when the exchange ends (MASS_SPEC §4):

    ts_start, ts_start_iso, method, path, seq, request_bytes, request | request_raw, status, response_headers,
    stream, response_bytes, response | response_raw, sse_raw, duration_s, [client_disconnected], [proxy_error],
    [rejected], [proxy_added_usage], [budget_exhausted], [cached_prompt_tokens]

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

Routes (ISSUE #25.2): the agent needs generation and the model list, nothing else, so only these are forwarded,
under the endpoint's client path (`client_path`, e.g. `/v1`): POST `chat/completions`, `completions`, `responses`;
GET `models` and `models/<id>` (`allowed_route`, matched on the raw request target). Any other method or path gets
HTTP 403 with one line and a record (`rejected`: `route_not_allowed`) and never reaches the upstream with the key;
a request target that is not a path (`GET http://host/ HTTP/1.1`) gets 400 (`bad_request_target`). A body is read
in the pieces it arrives in, up to `max_request_bytes` (`runtime.proxy_max_request_bytes`): a larger one, or one
whose Content-Length says so, gets 413 (`body_too_large`) and is not kept. A generation request is read and written
again as compact JSON (`prepare_generation`), so the server reads exactly the fields the proxy read; one that cannot
be read that way gets 400 (`bad_generation_request`, see below). A body of `PARSE_PROCESS_BYTES` or more is read in
a body parser process (`_BodyParsers`): a 30 MB parse holds the GIL, so on the loop or a thread it would stall
every other request of the proxy.

Budgets (ISSUE #15.2, #25.1): given an `EpisodeBudget`, every generation request is checked before it is forwarded.
Its need is the request's prompt estimate (forwarded bytes / 4) plus prompts (a completions batch) x sequences
(`n`, `best_of`) x its output cap (the largest of `max_tokens` / `max_completion_tokens`, or `max_output_tokens`;
ints, floats and numeric strings are read and rounded up; anything else is a 400). A request without a cap is
forwarded with the episode's default output (`default_max_tokens`) as its cap, so the server cannot generate past
what the budget holds for it. Responses-API requests that make the server generate from state the proxy cannot see
(background, previous_response_id, conversation, stored prompts, built-in tools) are refused with 400. When the need
does not fit what is left of the episode's token budget (this proxy's spend plus its requests in flight), or of the
cycle's shared ledger scopes (`mass_ops.store.budgets`: the task's and the cycle's), the request gets HTTP 402 with
an OpenAI-shaped error whose `code` is `budget_exhausted` — never forwarded — and its record carries
`budget_exhausted` (scope, setting, limit, spent, need). Each response's reported usage (prompt + completion, or
input + output tokens) is added to the episode's spend and to the ledger when its record is written. Every stream
is asked for its usage: a chat or completions stream without `stream_options.include_usage` is forwarded with it on,
and the usage-only chunk this adds is dropped from what the agent is relayed (`sse.UsageChunkFilter`; the record
keeps the stream as the server sent it and says `proxy_added_usage`). An exchange that reports no usage although the
server may have generated (a 2xx or 5xx without usage, a stream cut short) is charged its whole need: spend is never
counted as 0 for work the server did. Where the server reports cached prompt tokens
(`usage.prompt_tokens_details.cached_tokens`), the record carries them as `cached_prompt_tokens` too.

Server priority (ISSUE #17.2): given `request_priority`, every generation request is forwarded with its top-level
`priority` set to that value — the episode's place on the cycle's critical path, for a vLLM server that schedules by
priority (`mass_ops.critical_path`). It replaces any priority the agent sent: the agent is untrusted and must not
move its own work up the server's queue. The record holds the body as forwarded.

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
`python -m mass_ops.runtime.session_proxy --sessions-dir DIR --control-socket SOCKET ...`). Session control is
served on that Unix socket only, in a volume the sandbox does not mount: the publisher opens one session per attempt
(`open_proxy_session`: a fresh token, a budget and a log file of its own under DIR) and closes it when the agent has
ended (`close_proxy_session`, which answers with the session's own usage counters), so each attempt gets exactly
its own log and counts, and the agent can neither open, end nor read a session. The key is added only for the
configured upstreams and hosts under the allowed suffixes (the pod's egress policy reaches nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import hmac
import io
import itertools
import json
import logging
import math
import os
import re
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from mass_ops.errors import InfrastructureError, InputError
from mass_ops.runtime.outcome import UsageCounter
from mass_ops.runtime.sse import SSEAssembler, UsageChunkFilter
from mass_ops.store.budgets import EPISODE_SCOPE, BudgetLedger, Refusal
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

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
# The largest request body the proxy reads (`runtime.proxy_max_request_bytes`); a full 256K-token context is ~1 MB.
MAX_REQUEST_BYTES = 32 * 1024**2
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
# A request refused by a budget: 402 (payment required), which OpenAI clients and qwen-code do not retry as they do a
# 429, and an error code no server uses, so neither the agent nor the classifier can take it for anything else.
BUDGET_STATUS = 402
BUDGET_ERROR_CODE = "budget_exhausted"
PROMPT_BYTES_PER_TOKEN = 4
DEFAULT_CLIENT_PATH = "/v1"
# Bodies from this size on are parsed by a worker process: a JSON parse holds the GIL, on a thread as on the loop.
PARSE_PROCESS_BYTES = 256 * 1024
PARSE_PROCESSES = 2


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
    """(tokens, cached prompt tokens or None) of an OpenAI `usage` object (zeros if absent). Tokens are prompt +
    completion (Chat/Completions) or input + output (Responses), or `total_tokens` where that is larger."""

    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    if not isinstance(usage, dict):
        return 0, None
    total = max(
        count(usage.get("prompt_tokens")) + count(usage.get("completion_tokens")),
        count(usage.get("input_tokens")) + count(usage.get("output_tokens")),
        count(usage.get("total_tokens")),
    )
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
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

    def settle(self, need: int, usage: Any, *, server_may_have_generated: bool = True) -> None:
        """The admitted request of `need` ended with `usage` (None when it failed): add its spend, end its hold.

        Without reported tokens the request is charged its whole `need` unless the server surely generated nothing
        (it was never reached, or refused the request): unreported spend is never counted as 0."""
        tokens, _cached = usage_tokens(usage)
        if tokens == 0 and server_may_have_generated:
            tokens = need
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


# -- What the agent may send (module docstring, "Routes" and "Budgets") ---------------------------------------------

CHAT_ROUTE = "/chat/completions"
COMPLETIONS_ROUTE = "/completions"
RESPONSES_ROUTE = "/responses"
MODELS_ROUTE = "/models"
GENERATION_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE)
# A model id in `GET <client path>/models/<id>` ("Qwen/Qwen3-4B", "vendor/model:free"): no segment starting with a
# dot and no percent-escape, so no upstream can read it as another path.
MODEL_ID = re.compile(r"[A-Za-z0-9_~:@+-][A-Za-z0-9._~:@+-]*(?:/[A-Za-z0-9_~:@+-][A-Za-z0-9._~:@+-]*)*")


def allowed_route(method: str, raw_path: str, client_path: str) -> str | None:
    """The route `method raw_path` asks for (one of GENERATION_ROUTES or MODELS_ROUTE), or None when the agent may
    not use it. `raw_path` is the request target as sent (not percent-decoded); its query string is ignored."""
    path = raw_path.partition("?")[0]
    if not path.startswith(client_path + "/"):
        return None
    route = path[len(client_path) :]
    if method == "POST" and route in GENERATION_ROUTES:
        return route
    if method == "GET" and (
        route == MODELS_ROUTE
        or (route.startswith(MODELS_ROUTE + "/") and MODEL_ID.fullmatch(route[len(MODELS_ROUTE) + 1 :]))
    ):
        return MODELS_ROUTE
    return None


@dataclass(frozen=True)
class _RouteFields:
    """The request fields of one generation route that bound what the server may generate."""

    max_tokens: tuple[str, ...]  # caps on one sequence's output (the server obeys the largest it reads)
    added_max_tokens: str  # set to the episode's default output when the request sets none
    sequences: tuple[str, ...]  # multiply the sequences generated per prompt (n, best_of)
    stream_usage: bool  # a stream reports usage only when asked (`stream_options.include_usage`)
    refused: tuple[str, ...]  # make the server generate from state the proxy cannot see


_ROUTE_FIELDS = {
    CHAT_ROUTE: _RouteFields(("max_completion_tokens", "max_tokens"), "max_tokens", ("n", "best_of"), True, ()),
    COMPLETIONS_ROUTE: _RouteFields(("max_tokens",), "max_tokens", ("n", "best_of"), True, ()),
    RESPONSES_ROUTE: _RouteFields(
        ("max_output_tokens",),
        "max_output_tokens",
        (),
        False,
        ("background", "previous_response_id", "conversation", "prompt"),
    ),
}


class GenerationRequestError(InputError):
    """A generation request the proxy does not forward (HTTP 400): the one-line reason."""


@dataclass(frozen=True)
class GenerationRequest:
    """A generation request as the proxy forwards it."""

    body: bytes  # the body as forwarded: canonical JSON, so the server reads exactly the fields the proxy read
    need: int | None  # the most tokens it may use (prompt estimate + its output allowance); None without a budget
    usage_added: bool  # the proxy asked the stream for a usage chunk the agent did not ask for (the relay drops it)


def prepare_generation(
    route: str, body: bytes, *, default_max_tokens: int | None, priority: int | None
) -> GenerationRequest:
    """Read a generation request's body and return it as forwarded, with what it may spend.

    Refused (GenerationRequestError) when the body is no JSON object, an output cap is not a number of at least 1 or
    `n` / `best_of` not one of at least 0 (ints, floats and numeric strings are read, rounded up), `stream` is not a
    boolean, or the request would have the server generate from server-side state (Responses: background,
    previous_response_id, conversation, stored prompts, built-in tools). Forwarded with: a stream's
    `stream_options.include_usage` on; with a budget (`default_max_tokens`), an output cap of that size when the
    request sets none; `priority` when given. The body is written again as compact JSON, so duplicate keys or escapes
    cannot make the server read other values than the proxy. The need is the prompt estimate (forwarded bytes / 4)
    plus prompts x sequences (n, best_of) x the largest output cap.
    """
    try:
        # The body is already bounded by the proxy's request limit; the nesting is left to the parser's stack.
        document = loads_untrusted(body, what="request body", max_bytes=len(body), max_depth=None)
    except UntrustedInputError:
        raise GenerationRequestError("the body is not JSON the proxy can read") from None
    if not isinstance(document, dict):
        raise GenerationRequestError("the body is not a JSON object")
    fields = _ROUTE_FIELDS[route]
    for name in fields.refused:
        if document.get(name) not in (None, False):
            raise GenerationRequestError(
                f"`{name}` is not accepted by the episode proxy (the server would generate from state its budget "
                "cannot see)"
            )
    tools = document.get("tools") if route == RESPONSES_ROUTE else None
    if isinstance(tools, list) and any(not isinstance(tool, dict) or tool.get("type") != "function" for tool in tools):
        raise GenerationRequestError("only `function` tools are accepted by the episode proxy (built-in tools loop)")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GenerationRequestError("`stream` must be true or false")
    usage_added = False
    if stream and fields.stream_usage:
        options = document.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise GenerationRequestError("`stream_options` must be an object")
        if (options or {}).get("include_usage") is not True:
            document["stream_options"] = {**(options or {}), "include_usage": True}
            usage_added = True
    # A cap of 0 is refused: some servers read it as "no cap".
    caps = [_token_count(document, name, least=1) for name in fields.max_tokens if document.get(name) is not None]
    sequences = max([1, *(_token_count(document, name) for name in fields.sequences if document.get(name) is not None)])
    if default_max_tokens is not None and not caps:
        document[fields.added_max_tokens] = default_max_tokens
    if priority is not None:
        document["priority"] = int(priority)
    forwarded = _json_bytes(document)
    if default_max_tokens is None:
        return GenerationRequest(forwarded, None, usage_added)
    prompts = _prompt_count(document.get("prompt")) if route == COMPLETIONS_ROUTE else 1
    output = max(caps, default=default_max_tokens)
    need = -(-len(forwarded) // PROMPT_BYTES_PER_TOKEN) + prompts * sequences * output
    return GenerationRequest(forwarded, need, usage_added)


def _token_count(document: dict[str, Any], name: str, *, least: int = 0) -> int:
    """The request's `name` as a count of at least `least` (a float or numeric string rounded up);
    GenerationRequestError otherwise."""
    value = document[name]
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    number = math.nan
    if isinstance(value, float):
        number = value
    elif isinstance(value, str) and len(value) <= 64:
        with contextlib.suppress(ValueError):
            number = float(value.strip())
    if not math.isfinite(number) or math.ceil(number) < least or number < 0:
        shown = json.dumps(value)[:40] if isinstance(value, str | int | float | bool) else type(value).__name__
        raise GenerationRequestError(f"`{name}` must be a number of at least {least}, not {shown}")
    return math.ceil(number)


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions request: a list of strings or of token lists is a batch; anything else one prompt."""
    if isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        return len(prompt)
    return 1


def _json_bytes(document: dict[str, Any]) -> bytes:
    """`document` as compact JSON; non-ASCII text stays as it is unless it holds a lone surrogate (kept escaped)."""
    try:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii")
    except RecursionError:
        raise GenerationRequestError("the body is nested too deeply") from None


class _BodyParsers:
    """Worker processes that prepare large generation requests (`PARSE_PROCESS_BYTES`), shared by every proxy of
    this process and started on first use. JSON parsing holds the GIL: on the loop or a thread of this process a
    30 MB body would stall every other stream the proxy relays."""

    _pool: ProcessPoolExecutor | None = None
    _lock = threading.Lock()

    @classmethod
    def submit(cls, call: functools.partial[GenerationRequest]) -> Future[GenerationRequest]:
        """Start `call` in a worker (may block while the first workers start: call it off the loop)."""
        import multiprocessing

        with cls._lock:
            if cls._pool is None:
                # forkserver: forking this process (threads, an event loop) could copy a held lock into the child.
                context = multiprocessing.get_context("forkserver")
                cls._pool = ProcessPoolExecutor(max_workers=PARSE_PROCESSES, mp_context=context)
            return cls._pool.submit(call)

    @classmethod
    def discard(cls) -> None:
        """Drop a broken pool (the next large body starts a new one)."""
        with cls._lock:
            pool, cls._pool = cls._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


async def prepare_generation_off_loop(
    route: str, body: bytes, *, default_max_tokens: int | None, priority: int | None
) -> GenerationRequest:
    """`prepare_generation`, run in a worker process for a large body (inline for a small one, where the parse
    costs the loop less than the hand-off); on a thread if no worker can run."""
    call = functools.partial(prepare_generation, route, body, default_max_tokens=default_max_tokens, priority=priority)
    if len(body) < PARSE_PROCESS_BYTES:
        return call()
    try:
        future = await asyncio.to_thread(_BodyParsers.submit, call)
        return await asyncio.wrap_future(future)
    except (BrokenProcessPool, OSError, RuntimeError) as exc:
        logger.warning("episode proxy: no body parser process (%s); parsing on a thread", type(exc).__name__)
        _BodyParsers.discard()
        return await asyncio.to_thread(call)


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
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    pending: set[asyncio.Task[None]] = field(default_factory=set)
    last_record: asyncio.Task[None] | None = None  # the newest record task: the next one is written after it
    records: int = 0
    budget: EpisodeBudget | None = None
    priority: int | None = None  # stamped on every completion request (module docstring, "Server priority")
    # what this session's exchanges used, counted as each is settled: the row's counts (the log is evidence only)
    usage: UsageCounter = field(default_factory=UsageCounter)


class LoggingProxy:
    """Reverse proxy to `upstream_base_url` (scheme://host[:port][/prefix], no `/v1`) logging to `log_path`.

    With `agent_token`, only requests bearing that token pass (401 otherwise), and their credentials are replaced
    by `upstream_api_key` (if given); without it the proxy is open and forwards the client's headers as they are.
    Either way only the routes under `client_path` that `allowed_route` names are forwarded (403 otherwise), and no
    body over `max_request_bytes` is read (413). Use `await start()` / `await stop()` or `async with`. `port` and
    `url` are valid after start.
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
        client_path: str = DEFAULT_CLIENT_PATH,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        if upstream_api_key is not None and agent_token is None:
            # An open proxy that adds the key would hand the key's power to anything that can reach the port.
            raise ProxyConfigError("episode proxy: an upstream key needs an agent token (the proxy would be open)")
        client_path = client_path.rstrip("/")
        if client_path and (not client_path.startswith("/") or "?" in client_path or "%" in client_path):
            raise ProxyConfigError(f"episode proxy: client path {client_path!r} must be a plain path such as /v1")
        if max_request_bytes < 1:
            raise ProxyConfigError("episode proxy: the request body limit must be at least 1 byte")
        self.client_path = client_path
        self.max_request_bytes = max_request_bytes
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
        # The episode session's counts (the row's); read its totals after stop(), when every exchange is settled.
        self.usage = UsageCounter()

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
            usage=self.usage,
        )
        self._sessions[episode.name] = episode
        self._rejections = episode  # one log per episode: its refused requests belong to its trajectory's evidence

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._handle)

    async def start(self, unix_socket: Path | str | None = None) -> None:
        """Listen on `host:port`, or with `unix_socket` on that Unix socket only (a sandboxed agent reaches it
        through a bind mount and its bridge: `mass_ops.compute.sandbox`; `port` and `url` are then unset)."""
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
        app = web.Application(client_max_size=self.max_request_bytes)
        self._add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        if unix_socket is not None:
            await web.UnixSite(self._runner, str(unix_socket)).start()
            return
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
        # `Expect: 100-continue` was already answered by this server, which holds the whole body, decompressed.
        dropped = {"accept-encoding", "expect", "content-encoding"}
        if self._token_auth:
            dropped |= CREDENTIAL_HEADERS
        headers = [(k, v) for k, v in _end_to_end_headers(request.headers) if k.lower() not in dropped]
        headers.append(("Accept-Encoding", "identity"))
        if self._upstream_api_key is not None:
            headers.append(("Authorization", f"Bearer {self._upstream_api_key}"))
        return headers

    def _reject(self, request: web.Request, reason: str) -> web.Response:
        """401 without reading the body or contacting the upstream; recorded without headers or body."""
        message = "missing episode token" if reason == "missing_token" else "wrong episode token"
        return self._refuse(self._rejections, request, 401, reason, message, error_type="authentication_error")

    def _refuse(
        self,
        log: _Session | None,
        request: web.Request,
        status: int,
        reason: str,
        message: str,
        *,
        exchange: _Exchange | None = None,
        error_type: str | None = None,
    ) -> web.Response:
        """`status` with a one-line OpenAI-shaped error; never forwarded. Recorded in `log` with `rejected` = `reason`
        (with the request body only when `exchange` holds it)."""
        assert log is not None
        if exchange is None:
            exchange = _Exchange(seq=next(log.seq), method=request.method, path=request.path)
            exchange.request_bytes = request.content_length or 0
        exchange.status, exchange.rejected = status, reason
        error = {"message": f"episode proxy: {message}", "type": error_type or reason, "code": reason}
        exchange.response_body += json.dumps({"error": error}).encode()
        exchange.response_bytes = len(exchange.response_body)
        self._record_later(log, exchange)
        return web.json_response({"error": error}, status=status)

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The request body, read piece by piece as it arrives; None (nothing kept) once it is larger than
        `max_request_bytes`, which a Content-Length says before any byte is read."""
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            return None
        pieces, size = [], 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            pieces.append(chunk)
        return b"".join(pieces)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if not request.raw_path.startswith("/"):
            # Absolute-form (`GET http://host/ HTTP/1.1`) or asterisk-form: this proxy forwards to its upstream only.
            message = "the request target must be a path on this proxy, not a URL"
            return self._refuse(self._rejections, request, 400, "bad_request_target", message)
        handler = asyncio.current_task()
        session, reason = self._authenticate(request)
        if session is None:
            return self._reject(request, reason or "wrong_token")
        route = allowed_route(request.method, request.raw_path, self.client_path)
        if route is None:
            allowed = ", ".join(f"POST {self.client_path}{name}" for name in GENERATION_ROUTES)
            message = (
                f"{request.method} {request.path[:200]} is not a route the agent may use (allowed: {allowed}, "
                f"GET {self.client_path}{MODELS_ROUTE}[/<model>])"
            )
            return self._refuse(session, request, 403, "route_not_allowed", message)
        if handler is not None:
            for tracked in (self._handlers, session.handlers):
                tracked.add(handler)
                handler.add_done_callback(tracked.discard)
        exchange = _Exchange(seq=next(session.seq), method=request.method, path=request.path)
        body = await self._read_body(request)
        if body is None:
            exchange.request_bytes = request.content_length or self.max_request_bytes + 1
            message = (
                f"the request body is larger than {self.max_request_bytes} bytes (runtime.proxy_max_request_bytes)"
            )
            return self._refuse(session, request, 413, "body_too_large", message, exchange=exchange)
        exchange.request_body = body
        exchange.request_bytes = len(body)
        budget = session.budget
        if route in GENERATION_ROUTES:
            try:
                prepared = await prepare_generation_off_loop(
                    route,
                    body,
                    default_max_tokens=budget.default_max_tokens if budget is not None else None,
                    priority=session.priority,
                )
            except GenerationRequestError as exc:
                return self._refuse(session, request, 400, "bad_generation_request", str(exc), exchange=exchange)
            exchange.request_body, exchange.usage_added = prepared.body, prepared.usage_added
            exchange.request_bytes = len(prepared.body)
            if budget is not None and prepared.need is not None:
                # The shared ledger is a database read: off the loop that relays every other stream.
                admit = budget.admit
                refused = await asyncio.to_thread(admit, prepared.need) if budget.uses_store else admit(prepared.need)
                if refused is not None:
                    return self._refuse_over_budget(session, exchange, refused)
                exchange.budget_need = prepared.need
        target = URL(session.upstream + request.raw_path, encoded=True)
        try:
            if self._session is None:  # stop() began while this request was read: nothing goes out any more
                exchange.upstream_unreached = True
                raise aiohttp.ClientConnectionError("the proxy is stopping")
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
            exchange.upstream_unreached |= isinstance(exc, aiohttp.ClientConnectorError)
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
        # The usage chunk the proxy asked for is the record's (the assembler sees it), not the agent's.
        usage_filter = UsageChunkFilter() if exchange.stream and exchange.usage_added else None
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
                    if usage_filter is not None and (rest := usage_filter.close()):
                        await response.write(rest)
                    await response.write_eof()
                    break
                sink(chunk)
                exchange.response_bytes += len(chunk)
                if usage_filter is None:
                    await response.write(chunk)
                elif relayed := usage_filter.feed(chunk):
                    await response.write(relayed)
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
            log.usage.count(exchange.path, usage)
            if log.budget is not None and exchange.budget_need is not None:
                generated = exchange.server_may_have_generated()
                log.budget.settle(exchange.budget_need, usage, server_may_have_generated=generated)

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
    rejected: str | None = None  # why the proxy refused the request (token, route, size, body): never forwarded
    usage_added: bool = False  # the proxy asked the stream for usage; the agent was relayed the stream without it
    upstream_unreached: bool = False  # no connection to the upstream was made: it cannot have generated anything
    budget_need: int | None = None  # tokens held for this request by the episode's budget until it is settled
    budget_exhausted: dict[str, Any] | None = None  # the budget that refused it (never forwarded)

    def server_may_have_generated(self) -> bool:
        """Whether the upstream may have generated for this exchange: it was reached and did not refuse it (4xx)."""
        return not self.upstream_unreached and not (self.status is not None and 400 <= self.status < 500)

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
        if self.usage_added:
            record["proxy_added_usage"] = True
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
    "usage_added",
    "budget_exhausted",
)


def _put_body(record: dict[str, Any], key: str, body: bytes) -> None:
    """Store `body` as parsed JSON under `key`, else as text under `<key>_raw` (None for an empty body)."""
    if not body:
        record[key] = None
        return
    try:
        record[key] = loads_untrusted(body, what=key, max_bytes=len(body), max_depth=None)
    except UntrustedInputError:
        record[f"{key}_raw"] = body.decode("utf-8", errors="replace")


def _close_client(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(f"{port}\n")
    os.replace(handle.name, path)


async def _serve(args: argparse.Namespace) -> None:
    proxy = LoggingProxy(
        args.upstream[0],
        args.log,
        host=args.host,
        port=args.listen,
        keep_raw_sse=args.keep_raw_sse,
        request_priority=args.request_priority,
        client_path=args.client_path,
        max_request_bytes=args.max_request_bytes,
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


def run_proxy_main(main: Coroutine[Any, Any, None]) -> None:
    """Run the proxy process's `main` on uvloop where it is installed (a relay's CPU per byte is mostly the event
    loop's), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's `--client-path` and `--max-request-bytes` (what the agent may send), for every proxy command."""
    parser.add_argument(
        "--client-path", default=DEFAULT_CLIENT_PATH, help="the path of the endpoint under which routes are allowed"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="larger request bodies get HTTP 413"
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m mass_ops.runtime.proxy --listen PORT --upstream URL --log PATH [--port-file F]
    [--request-priority N] [--client-path /v1] [--max-request-bytes N]`: an open, keyless logging proxy (a pod's
    keyed one: `mass_ops.runtime.session_proxy`)."""
    if (sys.argv[1:] if argv is None else argv) == [RECORD_WRITER_FLAG]:
        _record_writer_main()
        return
    parser = argparse.ArgumentParser(prog="python -m mass_ops.runtime.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="port to bind (0 = ephemeral, see --port-file)")
    parser.add_argument("--upstream", action="append", required=True, help="model server base URL without /v1")
    parser.add_argument("--log", required=True, help="JSONL file the request records are appended to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--keep-raw-sse", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--request-priority", type=int, help="stamp this vLLM priority on every completion request (lower first)"
    )
    add_route_arguments(parser)
    args = parser.parse_args(argv)
    if len(args.upstream) > 1:
        parser.error("one --upstream (several go with a pod's session proxy: python -m mass_ops.runtime.session_proxy)")
    with contextlib.suppress(KeyboardInterrupt):
        try:
            run_proxy_main(_serve(args))
        except ProxyConfigError as exc:
            parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    # Run the module's own copy, not this `__main__` one: the body parser processes unpickle its functions and
    # exceptions by the module's name, and `except` clauses must name the same classes.
    from mass_ops.runtime.proxy import main as module_main

    module_main()
