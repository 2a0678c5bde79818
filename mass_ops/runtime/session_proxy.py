"""A Kubernetes episode pod's keyed proxy: one `LoggingProxy` whose sessions (one per attempt) each bring a token, a
budget and a log of their own; `python -m mass_ops.runtime.session_proxy` runs it in the pod's proxy container.

Two listeners, two audiences. The agent's TCP listener (127.0.0.1, shared by every container of the pod) relays
model requests bearing a session's token and nothing else: it has no control route. Session control — open a
session (its upstream, budget and log), close it (its records and the proxy's own usage counters) — is served on a
Unix socket in the proxy's volume, which only the proxy and publisher containers mount; the session logs lie there
too. So the sandbox, where the agent runs, can neither open, close nor discard a session, nor choose where the key
goes, nor read or write a log: the publisher opens each attempt's session for the runner and publishes that
session's log and counts (`mass_ops.runtime.handoff`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from mass_ops.runtime.episode_budget import EpisodeBudget
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.proxy import _write_port_file, add_route_arguments, run_proxy_main
from mass_ops.runtime.proxy_access import (
    DEFAULT_CLIENT_PATH,
    MAX_REQUEST_BYTES,
    ProxyConfigError,
    new_agent_token,
    upstream_key_from_env,
)
from mass_ops.runtime.proxy_records import RecordLog as _RecordLog
from mass_ops.runtime.proxy_server import HANDLER_DRAIN_S, LoggingProxy, ProxySessionError, _Session

CONTROL_PREFIX = "/_mass_proxy"
CONTROL_TIMEOUT_S = 30.0
MAX_SESSIONS = 64
REJECTED_LOG = "rejected.jsonl"
CONTROL_HOST = "http://episode-proxy"  # the host part of a control URL: the Unix socket is what connects


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
    """The episode proxy of a Kubernetes pod: each attempt gets a session with its own token, budget and log.

    `upstreams` are the base URLs a session may name (the first is the default); a URL on a host ending in one of
    `allowed_host_suffixes` (e.g. `.<namespace>.svc`: a rollout's server of another generation) is accepted too.
    The key is sent to no other host. Control routes (JSON), served on the Unix socket `control_socket` only — the
    TCP listener answers 404 under `CONTROL_PREFIX`:

        POST {CONTROL_PREFIX}/sessions              {"upstream"?, "episode_tokens"?, "default_max_tokens"?}
                                                                       -> 201 {"session", "token", "log", "url"}
        POST {CONTROL_PREFIX}/sessions/ID/close     {"discard"?}       -> 200 {"records", "usage"}
        GET  {CONTROL_PREFIX}/health                                   -> 200 {"status": "ok", "sessions"}

    `log` is the session log's file name under `sessions_dir`, `url` the TCP listener the agent connects to; refused
    requests go to `rejected.jsonl` there. `usage` is the session's `UsageTotals` as the proxy counted them while
    settling each exchange. `request_priority` is stamped on every session's completion requests (the pod runs one
    episode).
    """

    def __init__(
        self,
        sessions_dir: Path | str,
        *,
        control_socket: Path | str,
        upstreams: Sequence[str],
        upstream_api_key: str,
        allowed_host_suffixes: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        keep_raw_sse: bool = True,
        request_priority: int | None = None,
        client_path: str = DEFAULT_CLIENT_PATH,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        bases = [_base_url(url) for url in upstreams]
        if not bases or any(base is None for base in bases):
            raise ProxyConfigError(f"episode proxy: --upstream {list(upstreams)} must be http(s) base URLs")
        if any(not suffix.startswith(".") or len(suffix) < 2 for suffix in allowed_host_suffixes):
            raise ProxyConfigError("episode proxy: an allowed host suffix starts with '.' (e.g. .mass-ops.svc)")
        self.sessions_dir = Path(sessions_dir)
        self.control_socket = Path(control_socket)
        self._control_runner: web.AppRunner | None = None
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
            client_path=client_path,  # the agent's routes (the allowlist) and their size limit: LoggingProxy
            max_request_bytes=max_request_bytes,
        )

    def _open_logs(self) -> None:
        self._rejections = _Session("rejected", None, self.upstream_base_url, _RecordLog(self.log_path))

    def _add_routes(self, app: web.Application) -> None:
        # The agent's listener: control is not served here, and its paths are not relayed either.
        app.router.add_route("*", f"{CONTROL_PREFIX}{{tail:.*}}", self._no_control)
        super()._add_routes(app)

    async def start(self, unix_socket: Path | str | None = None) -> None:
        """Start the agent's listener, then the control socket (a stale socket file is replaced)."""
        await super().start(unix_socket)
        control = web.Application(client_max_size=1 << 20)
        control.router.add_post(f"{CONTROL_PREFIX}/sessions", self._open_session)
        control.router.add_post(f"{CONTROL_PREFIX}/sessions/{{session}}/close", self._close_session)
        control.router.add_get(f"{CONTROL_PREFIX}/health", self._health)
        self._control_runner = web.AppRunner(control, access_log=None, shutdown_timeout=1.0)
        await self._control_runner.setup()
        try:
            self.control_socket.parent.mkdir(parents=True, exist_ok=True)
            self.control_socket.unlink(missing_ok=True)
            await web.UnixSite(self._control_runner, str(self.control_socket)).start()
            os.chmod(self.control_socket, 0o600)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop taking control requests first (no session opens during shutdown), then the relay and the logs."""
        if self._control_runner is not None:
            await self._control_runner.cleanup()
            self._control_runner = None
        await super().stop()

    async def _no_control(self, request: web.Request) -> web.Response:
        return _control_error(404, "no such route")

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
        episode_tokens, default_max_tokens = (body.get(key) for key in ("episode_tokens", "default_max_tokens"))
        limits = [episode_tokens, default_max_tokens]
        if any(value is not None and (not isinstance(value, int) or value < 1) for value in limits):
            return _control_error(400, "episode_tokens and default_max_tokens must be positive integers")
        if episode_tokens is not None and default_max_tokens is None:
            # The default becomes the cap of every uncapped request: a budget needs a real one, never a guess.
            return _control_error(400, "episode_tokens needs default_max_tokens (the cap of an uncapped request)")
        budget = None
        if episode_tokens is not None and default_max_tokens is not None:
            # A pod's proxy holds the episode's own token budget; the cycle's shared ledger is checked by the runner
            # before each attempt (this container has no metadata store).
            budget = EpisodeBudget(episode_tokens=episode_tokens, default_max_tokens=default_max_tokens)
        name = secrets.token_hex(8)
        token = new_agent_token()
        log = _RecordLog(self.sessions_dir / f"{name}.jsonl", redact=self._upstream_api_key)
        self._sessions[name] = _Session(
            name, token.encode(), upstream, log, budget=budget, priority=self.request_priority
        )
        answer = {"session": name, "token": token, "log": log.path.name, "url": self.url}
        return web.json_response(answer, status=201)

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
        return web.json_response({"records": session.records, "usage": session.usage.totals().as_dict()})


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
    """One attempt's session with a pod's `SessionProxy`: where the agent connects, with which token, and where the
    session's log can be read (the proxy's log folder as mounted on the control side)."""

    proxy_url: str
    name: str
    token: str
    log_path: Path


@dataclass(frozen=True)
class ClosedSession:
    """What the proxy answered when it closed a session: its record count and its own usage counters."""

    records: int
    usage: UsageTotals


async def _control(control_socket: Path | str, path: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    url = f"{CONTROL_HOST}{CONTROL_PREFIX}{path}"
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(control_socket)),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as client,
            client.post(url, json=payload) as response,
        ):
            status = response.status
            data = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        raise ProxySessionError(f"episode proxy {control_socket}: POST {path} failed: {type(exc).__name__}") from None
    if status >= 300 or not isinstance(data, dict):
        detail = ((data or {}).get("error") or {}).get("message") if isinstance(data, dict) else None
        raise ProxySessionError(f"episode proxy {control_socket}: POST {path} answered HTTP {status} ({detail})")
    return data


async def open_proxy_session(
    control_socket: Path | str,
    sessions_dir: Path | str,
    *,
    upstream: str | None = None,
    timeout_s: float = CONTROL_TIMEOUT_S,
    episode_tokens: int | None = None,
    default_max_tokens: int | None = None,
) -> ProxySession:
    """Open a session on the pod's proxy through its control socket (its logs readable under `sessions_dir`);
    ProxySessionError. `episode_tokens` (with the request default `default_max_tokens`) makes the session enforce
    that token budget."""
    payload: dict[str, Any] = {} if upstream is None else {"upstream": upstream}
    if episode_tokens is not None:
        payload |= {"episode_tokens": episode_tokens, "default_max_tokens": default_max_tokens}
    data = await _control(control_socket, "/sessions", payload, timeout_s)
    name, token, log, url = (data.get(field) for field in ("session", "token", "log", "url"))
    if not all(isinstance(value, str) and value for value in (name, token, log, url)) or Path(str(log)).name != log:
        raise ProxySessionError(f"episode proxy {control_socket}: the session answer is malformed")
    return ProxySession(str(url).rstrip("/"), str(name), str(token), Path(sessions_dir) / str(log))


async def close_proxy_session(
    control_socket: Path | str,
    session: ProxySession,
    *,
    discard: bool = False,
    timeout_s: float = CONTROL_TIMEOUT_S,
) -> ClosedSession:
    """Close `session`: its token stops working, its in-flight exchanges are settled, its log is complete.
    Returns the proxy's record count and usage counters; ProxySessionError."""
    data = await _control(control_socket, f"/sessions/{session.name}/close", {"discard": discard}, timeout_s)
    records = data.get("records")
    return ClosedSession(
        records if isinstance(records, int) and not isinstance(records, bool) and records >= 0 else 0,
        UsageTotals.from_mapping(data.get("usage")),
    )


async def serve_episode_proxy(
    *,
    sessions_dir: Path | str,
    control_socket: Path | str,
    upstreams: Sequence[str],
    key_env: str,
    allowed_host_suffixes: Sequence[str] = (),
    listen: int = 0,
    host: str = "127.0.0.1",
    environ: Mapping[str, str] | None = None,
    port_file: Path | str | None = None,
    stop: asyncio.Event | None = None,
    request_priority: int | None = None,
    client_path: str = DEFAULT_CLIENT_PATH,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> None:
    """Run a pod's `SessionProxy` until SIGTERM/SIGINT (or `stop`): the key comes from variable `key_env` of this
    process, which is the only one in the pod that holds it."""
    proxy = SessionProxy(
        sessions_dir,
        control_socket=control_socket,
        upstreams=upstreams,
        upstream_api_key=upstream_key_from_env(key_env, environ),
        allowed_host_suffixes=allowed_host_suffixes,
        host=host,
        port=listen,
        request_priority=request_priority,
        client_path=client_path,
        max_request_bytes=max_request_bytes,
    )
    await proxy.start()
    stopped = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # signal handlers exist only in the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
    if port_file:
        _write_port_file(Path(port_file), proxy.port)
    print(
        f"episode proxy on {proxy.url} -> {', '.join(proxy.upstreams)}, control on {control_socket}, "
        f"sessions in {sessions_dir}",
        flush=True,
    )
    try:
        await stopped.wait()
    finally:
        await proxy.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m mass_ops.runtime.session_proxy --listen PORT --sessions-dir DIR --control-socket PATH --key-env NAME
    --upstream URL [--upstream URL ...] [--allow-host-suffix .ns.svc ...] [--port-file F] [--request-priority N]`."""
    parser = argparse.ArgumentParser(
        prog="python -m mass_ops.runtime.session_proxy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--listen", type=int, required=True, help="port to bind (0 = ephemeral, see --port-file)")
    parser.add_argument("--upstream", action="append", required=True, help="model server base URL (repeatable)")
    parser.add_argument("--sessions-dir", required=True, help="one session log per attempt in this folder")
    parser.add_argument(
        "--control-socket", required=True, help="serve session control on this Unix socket (never on the TCP port)"
    )
    parser.add_argument("--key-env", required=True, help="the variable holding the upstream API key")
    parser.add_argument("--allow-host-suffix", action="append", default=[], help="hosts the key may reach (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument(
        "--request-priority", type=int, help="stamp this vLLM priority on every completion request (lower first)"
    )
    add_route_arguments(parser)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            run_proxy_main(
                serve_episode_proxy(
                    sessions_dir=args.sessions_dir,
                    control_socket=args.control_socket,
                    upstreams=args.upstream,
                    key_env=args.key_env,
                    allowed_host_suffixes=args.allow_host_suffix,
                    listen=args.listen,
                    host=args.host,
                    port_file=args.port_file,
                    request_priority=args.request_priority,
                    client_path=args.client_path,
                    max_request_bytes=args.max_request_bytes,
                )
            )
        except ProxyConfigError as exc:
            parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    main()
