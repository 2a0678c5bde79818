"""The sandbox's way out for downloads: an HTTP forward proxy that reaches public internet addresses only (#25.7).

With `runtime.sandbox_egress: public` the runner starts one `EgressProxy` per attempt on a Unix socket that the
sandbox's bridge serves inside at `127.0.0.1:EGRESS_PORT_IN_SANDBOX` (named by the agent's `HTTPS_PROXY` & co.).
Contract: forwards `CONNECT host:port` tunnels and absolute-URI `GET`/`HEAD`/`POST http://…` to the configured ports
only; resolves each name itself and connects to the address it checked; refuses (403, one line, logged) any address
that is not globally routable or is one of this host's own; bounds every exchange by timeouts and tunnels per
attempt; counts the bytes each way (`EgressCounts`). Policy and rationale: docs/security.md (`mass_ops.compute.egress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# An async resolver: (host, port) -> the addresses to try, in order. Injected by tests; the default asks the system.
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
# The address policy: the reason an address is refused, or None when it may be reached.
AddressPolicy = Callable[[IPAddress], str | None]

EGRESS_SOCKET_NAME = "egress.sock"
DEFAULT_PORTS = (443, 80)
FORWARDED_METHODS = frozenset({"GET", "HEAD", "POST"})
MAX_HEAD_BYTES = 16 * 1024
CHUNK = 1 << 16
FLOOD_FACTOR = 4  # connections beyond max_tunnels that still get an answer (503); past that, closed unanswered
MAX_LOGGED_REFUSALS = 20  # per attempt: a flood of refused requests must not flood the runner's log
# Headers meant for this proxy or for one hop only: never sent on to the origin.
HOP_HEADERS = frozenset({"proxy-connection", "proxy-authorization", "connection", "keep-alive", "te", "upgrade"})
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9_-]{1,63})*\.?$")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")


# --- policy --------------------------------------------------------------------------------------------------------


def host_addresses() -> frozenset[IPAddress]:
    """This host's own interface addresses (Linux: the kernel's local routes and IPv6 address table), plus what its
    name resolves to. A public address of the host's would pass `is_global` and reach its 0.0.0.0 services."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        # /proc/net/fib_trie lists each local IPv4 address as a line with the address, then "/32 host LOCAL".
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for previous, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(previous.split()[-1]))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            with contextlib.suppress(ValueError, IndexError):
                found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
    return frozenset(found)


def refusal(address: IPAddress, own: Collection[IPAddress] = ()) -> str | None:
    """Why the egress proxy must not connect to `address`, or None for a public internet address (module docstring).
    `own` holds this host's addresses (`host_addresses`)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            why = refusal(embedded, own)
            return f"an IPv6 form of {embedded}, which is {why}" if why else None
        if address in _NAT64_LOCAL:
            return "local-use NAT64 space"
    checks = (
        (address.is_unspecified, "unspecified"),
        (address.is_loopback, "loopback"),
        (address.is_link_local, "link-local (cloud metadata lives here)"),
        (address.is_multicast, "multicast"),
        (address.is_private, "private or special-purpose"),
        (isinstance(address, ipaddress.IPv4Address) and address in _SHARED, "shared CGNAT space"),
        (address.is_reserved, "reserved"),
        (not address.is_global, "not globally routable"),
        (address in own, "an address of this host"),
    )
    return next((why for failed, why in checks if failed), None)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, 6to4, NAT64), if any. Teredo (2001::/32) needs none: it is
    special-purpose space, refused as such."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def public_policy(own: Collection[IPAddress] | None = None) -> AddressPolicy:
    """The default policy: `refusal` against this host's addresses (read now: an attempt's proxy reads them once)."""
    addresses = host_addresses() if own is None else frozenset(own)
    return lambda address: refusal(address, addresses)


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """The system resolver's addresses for `host`, in its order, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[IPAddress] = []
    for info in infos:
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if address not in found:
                found.append(address)
    return found


# --- the proxy -----------------------------------------------------------------------------------------------------


@dataclass
class EgressCounts:
    """What an attempt's egress proxy did: tunnels and forwards opened, requests refused, bytes each way."""

    connections: int = 0
    refused: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "connections": self.connections,
            "refused": self.refused,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
        }


class _Refused(Exception):
    """A request the proxy answers with `status` and a one-line reason (and counts as refused)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed", 502: "Bad Gateway"}
_STATUS_TEXT |= {503: "Service Unavailable", 504: "Gateway Timeout"}


class EgressProxy:
    """One attempt's forward proxy to public addresses (module docstring). `start` it on a Unix socket, `stop` it
    when the agent has ended; `counts` then holds the attempt's totals."""

    def __init__(
        self,
        *,
        ports: Iterable[int] = DEFAULT_PORTS,
        resolve: Resolver = resolve_host,
        policy: AddressPolicy | None = None,
        max_tunnels: int = 64,
        head_timeout_s: float = 30.0,
        connect_timeout_s: float = 15.0,
        idle_timeout_s: float = 300.0,
    ) -> None:
        self.ports = frozenset(ports)
        self.resolve = resolve
        self._policy = policy
        self.max_tunnels = max_tunnels
        self.head_timeout_s = head_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.counts = EgressCounts()
        self._open = 0
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def open_connections(self) -> int:
        """Connections from the sandbox this proxy holds now (answered, waiting for a head, or tunnelling)."""
        return self._open

    async def start(self, unix_socket: Path) -> None:
        """Listen on `unix_socket` (its folder is the attempt's private one)."""
        if self._policy is None:
            self._policy = public_policy(await asyncio.to_thread(host_addresses))
        self._server = await asyncio.start_unix_server(self._accept, path=str(unix_socket), limit=MAX_HEAD_BYTES)

    async def stop(self) -> None:
        """Stop listening and end every open exchange (the agent has ended: nothing of it stays connected)."""
        if self._server is not None:
            self._server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.counts.refused > MAX_LOGGED_REFUSALS:
            logger.warning("episode egress: %d requests refused in all", self.counts.refused)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._open += 1
        try:
            if self._open > FLOOD_FACTOR * self.max_tunnels:
                self.counts.refused += 1  # a flood of connections: each would hold one of this process's descriptors
                return
            await self._exchange(reader, writer)
        except _Refused as refused:
            self._refuse(writer, refused)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # the agent or the origin went away: nothing to answer
        except asyncio.CancelledError:
            pass  # `stop`: the attempt is over (the task ends here, as asyncio's server expects of its handlers)
        finally:
            self._open -= 1
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _refuse(self, writer: asyncio.StreamWriter, refused: _Refused) -> None:
        self.counts.refused += 1
        if self.counts.refused <= MAX_LOGGED_REFUSALS:
            logger.warning("episode egress: refused (%d) %s", refused.status, refused.reason)
        body = f"mass-ops egress proxy: {refused.reason}\n".encode()
        head = (
            f"HTTP/1.1 {refused.status} {_STATUS_TEXT.get(refused.status, 'Error')}\r\n"
            f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            writer.write(head.encode() + body)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout_s)
        except asyncio.LimitOverrunError:
            raise _Refused(400, f"request head over {MAX_HEAD_BYTES} bytes") from None
        except TimeoutError:
            raise _Refused(400, f"no request head within {self.head_timeout_s:g} s") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(400, f"not an HTTP/1.x request line: {lines[0][:100]!a}")
        method, target, _version = parts
        if self._open > self.max_tunnels:
            raise _Refused(503, f"more than {self.max_tunnels} connections open at once")
        if method == "CONNECT":
            host, port = _authority(target)
            upstream = await self._connect(method, host, port)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await self._relay(reader, writer, upstream)
            return
        if method not in FORWARDED_METHODS:
            raise _Refused(405, f"method {method[:20]!a} (only CONNECT, GET, HEAD and POST)")
        try:
            url = urlsplit(target)
        except ValueError:  # e.g. an unclosed IPv6 bracket
            raise _Refused(400, f"malformed URL {target[:100]!a}") from None
        if url.scheme != "http" or not url.hostname:
            raise _Refused(400, f"{method} needs an absolute http:// URL, not {target[:100]!a}")
        try:
            port = url.port or 80
        except ValueError:
            raise _Refused(400, f"bad port in {target[:100]!a}") from None
        host = url.hostname
        upstream = await self._connect(method, host, port)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = [line for line in lines[1:] if line and line.split(":", 1)[0].strip().lower() not in HOP_HEADERS]
        if not any(line.split(":", 1)[0].strip().lower() == "host" for line in headers):
            headers.insert(0, f"Host: {url.netloc.rpartition('@')[2]}")
        sent = "\r\n".join([f"{method} {path} HTTP/1.1", *headers, "Connection: close", "", ""]).encode("latin-1")
        upstream[1].write(sent)
        self.counts.bytes_up += len(sent)
        await self._relay(reader, writer, upstream)

    async def _connect(self, method: str, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Check `host:port` against the ports and the policy and connect to the first allowed address it resolves
        to (that address, never the name: no second lookup). Raises `_Refused`."""
        shown = f"{method} {_show(host)}:{port}"
        if port not in self.ports:
            raise _Refused(403, f"{shown}: port {port} is not in runtime.sandbox_egress_ports")
        literal = _ip_literal(host)
        if literal is None and not _HOSTNAME.match(host):
            raise _Refused(400, f"{shown}: not a host name")
        try:
            candidates = (
                [literal] if literal else await asyncio.wait_for(self.resolve(host, port), self.connect_timeout_s)
            )
        except (OSError, TimeoutError) as exc:
            raise _Refused(502, f"{shown}: cannot resolve ({type(exc).__name__})") from None
        assert self._policy is not None
        allowed: list[IPAddress] = []
        reasons: list[str] = []
        for address in candidates:
            why = self._policy(address)
            if why:
                reasons.append(f"{address} is {why}")
            else:
                allowed.append(address)
        if not allowed:
            raise _Refused(403, f"{shown}: {'; '.join(reasons) or 'no address'}")
        last: BaseException | None = None
        for address in allowed:
            try:
                upstream = await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, limit=CHUNK), self.connect_timeout_s
                )
            except (OSError, TimeoutError) as exc:
                last = exc
                continue
            self.counts.connections += 1
            return upstream
        raise _Refused(502, f"{shown}: cannot connect ({type(last).__name__})")

    async def _relay(
        self,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        """Copy both ways until the origin's side has ended (the agent may half-close first: its request is whole,
        the answer still comes), or nothing moved either way for `idle_timeout_s`."""
        upstream_reader, upstream_writer = upstream
        last = [time.monotonic()]
        up = asyncio.ensure_future(self._pump(client_reader, upstream_writer, last, up=True))
        watchdog = asyncio.ensure_future(self._watch(last, (client_writer, upstream_writer)))
        try:
            await self._pump(upstream_reader, client_writer, last, up=False)
        finally:
            for task in (up, watchdog):
                task.cancel()
            await asyncio.gather(up, watchdog, return_exceptions=True)
            upstream_writer.close()

    async def _watch(self, last: list[float], writers: tuple[asyncio.StreamWriter, ...]) -> None:
        """Close both sides once nothing has moved either way for `idle_timeout_s` (the pumps then see the end)."""
        while (idle := time.monotonic() - last[0]) < self.idle_timeout_s:
            await asyncio.sleep(self.idle_timeout_s - idle)
        for writer in writers:
            writer.close()

    async def _pump(
        self, source: asyncio.StreamReader, target: asyncio.StreamWriter, last: list[float], *, up: bool
    ) -> None:
        try:
            while data := await source.read(CHUNK):
                last[0] = time.monotonic()
                if up:
                    self.counts.bytes_up += len(data)
                else:
                    self.counts.bytes_down += len(data)
                target.write(data)
                await target.drain()
            if target.can_write_eof():
                target.write_eof()
        except OSError:
            target.close()


def _authority(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` of a CONNECT request; raises `_Refused` (400)."""
    host, sep, port = target.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5) or not host:
        raise _Refused(400, f"CONNECT needs host:port, not {target[:100]!a}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _show(host: str) -> str:
    """The host as it may appear in a log line: printable ASCII, bounded."""
    return ascii(host[:100])[1:-1]
