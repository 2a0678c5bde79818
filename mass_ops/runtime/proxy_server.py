"""`LoggingProxy`: the per-episode logging reverse proxy in front of the model server (docs/proxy.md).

Every request the agent may make is forwarded to the upstream and answered with the upstream's status, headers and
body; SSE streams are relayed chunk by chunk, never buffered. Token check (401), route allowlist (403/400), body
limit (413), unreadable generation requests (400) and budgets (402) are answered here without reaching the upstream;
an upstream failure before the response starts is a 502. One record per exchange is appended to the log after the
client has the whole response, off the event loop, in the order exchanges ended (`proxy_records`, `record_writer`).
"""

from __future__ import annotations

import asyncio
import hmac
import io
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from mass_ops.errors import InfrastructureError
from mass_ops.runtime.body_parsers import prepare_generation_off_loop
from mass_ops.runtime.episode_budget import BUDGET_ERROR_CODE, BUDGET_STATUS, EpisodeBudget
from mass_ops.runtime.generation_request import GenerationRequestError
from mass_ops.runtime.outcome import UsageCounter
from mass_ops.runtime.proxy_access import (
    BEARER,
    CREDENTIAL_HEADERS,
    DEFAULT_CLIENT_PATH,
    GENERATION_ROUTES,
    MAX_REQUEST_BYTES,
    MODELS_ROUTE,
    ProxyConfigError,
    allowed_route,
)
from mass_ops.runtime.proxy_records import LOGGED_RESPONSE_HEADERS, Exchange, RecordLog
from mass_ops.runtime.record_writer import append_record
from mass_ops.runtime.sse import UsageChunkFilter
from mass_ops.store.budgets import Refusal

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
CONNECT_TIMEOUT_S = 30.0
HANDLER_DRAIN_S = 5.0  # how long stop() waits for in-flight handlers to write their records
WHOLE_BODY_BYTES = 1024**2
RELAY_READ_BUFFER = 2**18  # bytes


class ProxySessionError(InfrastructureError):
    """A pod's episode proxy did not open or close a session (it is not up, or refused)."""


@dataclass(eq=False)
class _Session:
    """One episode's share of a proxy: the token it accepts (None = no check), its upstream and its log."""

    name: str
    token: bytes | None
    upstream: str
    log: RecordLog
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    pending: set[asyncio.Task[None]] = field(default_factory=set)
    last_record: asyncio.Task[None] | None = None  # the newest record task: the next one is written after it
    records: int = 0
    budget: EpisodeBudget | None = None
    priority: int | None = None  # stamped on every completion request (docs/proxy.md, "Server priority")
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
            RecordLog(self.log_path, redact=self._upstream_api_key),
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
        exchange: Exchange | None = None,
        error_type: str | None = None,
    ) -> web.Response:
        """`status` with a one-line OpenAI-shaped error; never forwarded. Recorded in `log` with `rejected` = `reason`
        (with the request body only when `exchange` holds it)."""
        assert log is not None
        if exchange is None:
            exchange = Exchange(seq=next(log.seq), method=request.method, path=request.path)
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
        """Answer one agent request: refused here (400, 401, 403, 413; 400 or 402 for a generation request) or
        forwarded; every answer leaves a record."""
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
        exchange = Exchange(seq=next(session.seq), method=request.method, path=request.path)
        body = await self._read_body(request)
        if body is None:
            exchange.request_bytes = request.content_length or self.max_request_bytes + 1
            message = (
                f"the request body is larger than {self.max_request_bytes} bytes (runtime.proxy_max_request_bytes)"
            )
            return self._refuse(session, request, 413, "body_too_large", message, exchange=exchange)
        exchange.request_body = body
        exchange.request_bytes = len(body)
        if route in GENERATION_ROUTES:
            refusal = await self._prepare_generation(request, session, route, exchange)
            if refusal is not None:
                return refusal
        return await self._forward(request, session, exchange)

    async def _prepare_generation(
        self, request: web.Request, session: _Session, route: str, exchange: Exchange
    ) -> web.Response | None:
        """Put the generation request as forwarded into `exchange` and hold its need on the session's budget; the
        refusal instead when it may not be forwarded (400 unreadable, 402 over budget)."""
        budget = session.budget
        try:
            prepared = await prepare_generation_off_loop(
                route,
                exchange.request_body,
                default_max_tokens=budget.default_max_tokens if budget is not None else None,
                priority=session.priority,
            )
        except GenerationRequestError as exc:
            return self._refuse(session, request, 400, "bad_generation_request", str(exc), exchange=exchange)
        exchange.request_body, exchange.usage_added = prepared.body, prepared.usage_added
        exchange.request_bytes = len(prepared.body)
        if budget is not None and prepared.need is not None:
            # The session's earlier requests count as their whole need until their records settle them to what they
            # used; an agent sends its next request as soon as it has read an answer, often before that record is
            # written. Settle them first, so that whether this request fits does not depend on a race.
            if session.last_record is not None and not session.last_record.done():
                await asyncio.wait([session.last_record])
            # The shared ledger is a database read: off the loop that relays every other stream.
            admit = budget.admit
            refused = await asyncio.to_thread(admit, prepared.need) if budget.uses_store else admit(prepared.need)
            if refused is not None:
                return self._refuse_over_budget(session, exchange, refused)
            exchange.budget_need = prepared.need
        return None

    async def _forward(self, request: web.Request, session: _Session, exchange: Exchange) -> web.StreamResponse:
        """Send the request to the session's upstream and relay its answer (502 when that fails before any byte
        reached the client); the exchange's record is queued whatever happens."""
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
        self, request: web.Request, upstream: aiohttp.ClientResponse, exchange: Exchange
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

    def _refuse_over_budget(self, session: _Session, exchange: Exchange, refused: Refusal) -> web.Response:
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

    def _record_later(self, log: _Session, exchange: Exchange) -> None:
        """Build and append the record off the event loop, after the log's previous record (docs/proxy.md)."""
        task = asyncio.get_running_loop().create_task(self._record_after(log.last_record, log, exchange))
        log.last_record = task
        log.pending.add(task)
        task.add_done_callback(log.pending.discard)

    async def _record_after(self, previous: asyncio.Task[None] | None, log: _Session, exchange: Exchange) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its failure is its own (raised by stop()); this record is still written
        await asyncio.to_thread(self._append, log, exchange)

    def _append(self, log: _Session, exchange: Exchange) -> None:
        usage: Any = None
        try:
            usage = append_record(log.log, exchange, keep_raw_sse=self.keep_raw_sse)
            log.records += 1
        finally:
            log.usage.count(exchange.path, usage)
            if log.budget is not None and exchange.budget_need is not None:
                generated = exchange.server_may_have_generated()
                log.budget.settle(exchange.budget_need, usage, server_may_have_generated=generated)


def _end_to_end_headers(headers: Any) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones, including any the `Connection` header names (RFC 9110 §7.6.1)."""
    named = {token.strip().lower() for value in headers.getall("Connection", []) for token in value.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP_HEADERS and k.lower() not in named]


def _close_client(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()
