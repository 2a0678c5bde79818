"""Logging reverse proxy between the agent (qwen-code) and the model server; its log is the episode's trajectory.

Every request is forwarded unchanged to the upstream (method, path + query, body, end-to-end headers) and answered
with the upstream's status, headers and body; SSE streams are relayed chunk by chunk as they arrive, never buffered.
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
reassembly, serialisation) is built on a worker thread after the client has the whole response, so records land in
completion order (sort by `seq` for request order). Each record is one `write()` on an O_APPEND descriptor, so lines
stay whole when exchanges finish together; `stop()` waits for every pending record before closing the log.

Deployment decision: **one proxy per episode, on an ephemeral port** (`port=0`), not one shared proxy.
- Isolation: the log *is* the episode's trajectory; a per-episode proxy needs no request-to-episode attribution
  (qwen-code sends no episode id) and the log file is complete and closed when the episode ends, ready to gzip.
- Crash containment: a proxy failure (or a pathological stream) affects one episode, which the runner retries as an
  infrastructure failure; a shared proxy would fail every concurrent episode at once.
- Concurrency: ephemeral ports let any number of episodes run side by side without port bookkeeping; in a sandbox
  pod the proxy runs as the pod's own process (`python -m mass_ops.runtime.proxy`) and the pod's egress policy only
  needs to allow the model server.
The cost is one aiohttp server per episode (a few MB, milliseconds to start), negligible next to an episode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from mass_ops.runtime.sse import SSEAssembler

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
WHOLE_BODY_BYTES = 1024**2


def _end_to_end_headers(headers: Any) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones, including any the `Connection` header names (RFC 9110 §7.6.1)."""
    named = {token.strip().lower() for value in headers.getall("Connection", []) for token in value.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP_HEADERS and k.lower() not in named]


RELAY_READ_BUFFER = 2**18  # bytes


class _RecordLog:
    """Append-only JSONL file; one `os.write` per record so concurrent records never interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LoggingProxy:
    """Reverse proxy to `upstream_base_url` (scheme://host[:port][/prefix], no `/v1`) logging to `log_path`.

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
    ) -> None:
        self.upstream_base_url = upstream_base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.host = host
        self.keep_raw_sse = keep_raw_sse
        self._requested_port = port
        self._port: int | None = None
        self._seq = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log: _RecordLog | None = None
        self._pending: set[asyncio.Task[None]] = set()
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

    async def start(self) -> None:
        self._log = _RecordLog(self.log_path)
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
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        # Close the upstream side first so a stalled stream ends, then let every handler reach its `finally` (which
        # queues the exchange's record) before the log closes: a record must not be lost at shutdown.
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=HANDLER_DRAIN_S)
        if self._pending:
            await asyncio.gather(*self._pending)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def __aenter__(self) -> LoggingProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        assert self._session is not None
        exchange = _Exchange(seq=next(self._seq), method=request.method, path=request.path)
        exchange.request_body = await request.read()
        # `Expect: 100-continue` was already answered by this server, which holds the whole body.
        headers = [
            (k, v) for k, v in _end_to_end_headers(request.headers) if k.lower() not in ("accept-encoding", "expect")
        ]
        headers.append(("Accept-Encoding", "identity"))
        target = URL(self.upstream_base_url + request.raw_path, encoded=True)
        try:
            async with self._session.request(
                request.method,
                target,
                headers=headers,
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
            self._record_later(exchange)
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

    def _record_later(self, exchange: _Exchange) -> None:
        """Parse and append the record on a worker thread, so neither this client nor others wait for it."""
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._append, exchange))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _append(self, exchange: _Exchange) -> None:
        assert self._log is not None
        self._log.append(exchange.to_record(keep_raw_sse=self.keep_raw_sse))


@dataclass
class _Exchange:
    """What one request/response exchange left behind; `to_record()` turns it into the log record."""

    seq: int
    method: str
    path: str
    ts_start: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    request_body: bytes = b""
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    assembler: SSEAssembler = field(default_factory=SSEAssembler)
    response_body: bytearray = field(default_factory=bytearray)
    response_bytes: int = 0
    duration_s: float = 0.0
    client_disconnected: bool = False
    proxy_error: str | None = None

    def to_record(self, *, keep_raw_sse: bool) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ts_start": self.ts_start,
            "ts_start_iso": datetime.fromtimestamp(self.ts_start, UTC).isoformat(),
            "method": self.method,
            "path": self.path,
            "seq": self.seq,
            "request_bytes": len(self.request_body),
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
        return record


def _put_body(record: dict[str, Any], key: str, body: bytes) -> None:
    """Store `body` as parsed JSON under `key`, else as text under `<key>_raw` (None for an empty body)."""
    if not body:
        record[key] = None
        return
    try:
        record[key] = json.loads(body)
    except ValueError:
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
    proxy = LoggingProxy(args.upstream, args.log, host=args.host, port=args.listen, keep_raw_sse=args.keep_raw_sse)
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


def main(argv: list[str] | None = None) -> None:
    """`python -m mass_ops.runtime.proxy --listen PORT --upstream URL --log PATH [--port-file F]`."""
    parser = argparse.ArgumentParser(prog="python -m mass_ops.runtime.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="port to bind (0 = ephemeral, see --port-file)")
    parser.add_argument("--upstream", required=True, help="model server base URL without /v1")
    parser.add_argument("--log", required=True, help="JSONL file the request records are appended to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--keep-raw-sse", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
