"""The sandbox's egress proxy (mass_ops.compute.egress): its address policy, and the proxy driven over its Unix socket
the way the sandbox's tools use it. This machine has no internet: a fake public name maps to a test server on
127.0.0.2 by an injected resolver, and only that one address is let through by a policy override; everything else
meets the default policy. The attacks through the real runner and sandbox are in tests/runtime/test_local_sandbox.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mass_ops.compute.egress import FLOOD_FACTOR, EgressProxy, IPAddress, host_addresses, public_policy, refusal

TEST_ADDRESS = ipaddress.ip_address("127.0.0.2")  # the stand-in for a public origin: let through by the test only
PUBLIC_NAME = "downloads.example"

REFUSED = [
    "127.0.0.1",
    "127.1.2.3",
    "10.1.2.3",
    "172.16.5.4",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # CGNAT
    "0.0.0.0",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.2.1",
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "ff02::1",
    "ff0e::1",
    "::ffff:127.0.0.1",
    "::ffff:169.254.169.254",
    "::ffff:10.0.0.1",
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b::e000:1",  # NAT64 of 224.0.0.1
    "64:ff9b:1::1",
    "2001:db8::1",
    "2001::1",  # Teredo
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "151.101.0.223", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", REFUSED)
def test_the_default_policy_refuses_every_address_that_is_not_public(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ALLOWED)
def test_the_default_policy_lets_public_addresses_through(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is None


def test_the_host_s_own_addresses_are_refused_even_when_public() -> None:
    """A host with a public interface address runs its 0.0.0.0 services there: `is_global` alone would pass it."""
    public_of_ours = ipaddress.ip_address("198.41.0.4")
    assert refusal(public_of_ours) is None
    assert refusal(public_of_ours, {public_of_ours}) == "an address of this host"
    assert public_policy({public_of_ours})(public_of_ours) is not None


def test_host_addresses_holds_the_interfaces_addresses() -> None:
    found = host_addresses()
    assert ipaddress.ip_address("127.0.0.1") in found
    for address in _interface_addresses():  # an independent view: the kernel's answer to an ioctl per interface
        assert address in found, address


def _interface_addresses() -> set[IPAddress]:
    """Each non-loopback IPv4 interface address, as the kernel reports it to an ioctl (independent of fib_trie)."""
    import fcntl
    import socket
    import struct

    found: set[IPAddress] = set()
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        for _index, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                found.add(ipaddress.ip_address(socket.inet_ntoa(packed[20:24])))
    return found


# --- the proxy ----------------------------------------------------------------------------------------------------


class Origin:
    """A plain HTTP server on 127.0.0.2 that records each request head and answers `hello <path>`."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
            except asyncio.IncompleteReadError:
                return  # a tunnel closed before it carried a request
            self.heads.append(head)
            if head.startswith("ECHO"):  # inside a tunnel: echo lines until the client ends
                while line := await reader.readline():
                    writer.write(line.upper())
                return
            body = f"hello {head.split(' ')[1]}\n".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        finally:
            writer.close()

    async def __aenter__(self) -> Origin:
        self._server = await asyncio.start_server(self._serve, str(TEST_ADDRESS), 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()


async def fake_resolve(host: str, port: int) -> list[IPAddress]:
    """The injected resolver: the public name is the test origin; `loopback.example` is what a rebinding attacker
    would answer; `mixed.example` answers a private address first, then the origin."""
    names = {
        PUBLIC_NAME: ["127.0.0.2"],
        "loopback.example": ["127.0.0.1"],
        "metadata.example": ["169.254.169.254"],
        "mixed.example": ["10.0.0.1", "127.0.0.2"],
    }
    if host not in names:
        raise OSError(f"unknown name {host}")
    return [ipaddress.ip_address(a) for a in names[host]]


def origin_policy(address: IPAddress) -> str | None:
    """The default policy, with the one test origin let through."""
    return None if address == TEST_ADDRESS else refusal(address, host_addresses())


@contextlib.asynccontextmanager
async def running(tmp_path: Path, origin: Origin, **options: Any) -> AsyncIterator[tuple[EgressProxy, Path]]:
    options.setdefault("ports", [443, 80, origin.port])
    proxy = EgressProxy(resolve=fake_resolve, policy=origin_policy, **options)
    path = tmp_path / "egress.sock"
    await proxy.start(path)
    try:
        yield proxy, path
    finally:
        await proxy.stop()


async def exchange(path: Path, request: bytes) -> bytes:
    """Send `request` on a new connection to the proxy, end the sending side, read the whole answer."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(request)
    writer.write_eof()
    answer = await reader.read()
    writer.close()
    return answer


async def tunnel(path: Path, target: str) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """CONNECT `target`; returns the proxy's answer head and the open connection."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    return head, reader, writer


def test_connect_and_plain_get_reach_an_allowed_origin_and_are_counted(tmp_path: Path) -> None:
    async def scenario() -> tuple[bytes, bytes, bytes, list[str], dict[str, int]]:
        async with Origin() as origin, running(tmp_path, origin) as (proxy, path):
            head, reader, writer = await tunnel(path, f"{PUBLIC_NAME}:{origin.port}")
            writer.write(b"ECHO / HTTP/1.1\r\n\r\nthrough the tunnel\n")
            echoed = await reader.readline()
            writer.close()
            got = await exchange(
                path,
                f"GET http://{PUBLIC_NAME}:{origin.port}/simple/pkg/?q=1 HTTP/1.1\r\nHost: {PUBLIC_NAME}\r\n"
                "Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n\r\n".encode(),
            )
            mixed = await exchange(path, f"GET http://mixed.example:{origin.port}/m HTTP/1.1\r\n\r\n".encode())
        return head, echoed, got + mixed, origin.heads, proxy.counts.as_dict()

    head, echoed, got, heads, counts = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 200 ") and echoed == b"THROUGH THE TUNNEL\n"
    assert b"hello /simple/pkg/?q=1" in got and b"hello /m" in got
    # Forwarded in origin form, without what was meant for the proxy, and one request per connection.
    forwarded = heads[1]
    assert forwarded.startswith("GET /simple/pkg/?q=1 HTTP/1.1\r\n")
    assert "Proxy-" not in forwarded and "Connection: close" in forwarded and f"Host: {PUBLIC_NAME}" in forwarded
    assert "Host: mixed.example" in heads[2]  # a missing Host is added; the private address was skipped
    assert counts["connections"] == 3 and counts["refused"] == 0
    assert counts["bytes_up"] > 0 and counts["bytes_down"] >= len(b"THROUGH THE TUNNEL\n")


def test_every_way_to_a_host_service_is_refused_and_counted(tmp_path: Path) -> None:
    """Loopback (as an address, an IPv6 literal, a mapped form, a name), private, metadata, a port not in the list,
    a plain GET to the model server's loopback port: each gets 403, and nothing on loopback is ever connected."""

    async def scenario() -> tuple[dict[str, bytes], dict[str, int], list[int]]:
        accepted: list[int] = []

        async def host_service(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            writer.close()

        service = await asyncio.start_server(host_service, "127.0.0.1", 0)
        port = service.sockets[0].getsockname()[1]
        async with Origin() as origin, running(tmp_path, origin, ports=[80, 5432, port, origin.port]) as (proxy, path):
            attempts = {
                "loopback": f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n",
                "postgres": "CONNECT 127.0.0.1:5432 HTTP/1.1\r\n\r\n",
                "ipv6_loopback": f"CONNECT [::1]:{port} HTTP/1.1\r\n\r\n",
                "mapped": f"CONNECT [::ffff:127.0.0.1]:{port} HTTP/1.1\r\n\r\n",
                "name_to_loopback": f"CONNECT loopback.example:{port} HTTP/1.1\r\n\r\n",
                "metadata": "CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n",
                "metadata_get": "GET http://metadata.example/latest/meta-data/ HTTP/1.1\r\n\r\n",
                "private": "CONNECT 10.0.0.1:443 HTTP/1.1\r\n\r\n",
                "model_server": f"GET http://127.0.0.1:{port}/v1/models HTTP/1.1\r\n\r\n",
                "other_port": f"CONNECT {PUBLIC_NAME}:8443 HTTP/1.1\r\n\r\n",
            }
            answers = {name: await exchange(path, text.encode()) for name, text in attempts.items()}
        service.close()
        return answers, proxy.counts.as_dict(), accepted

    answers, counts, accepted = asyncio.run(scenario())
    assert {name: answer.split(b"\r\n")[0] for name, answer in answers.items()} == dict.fromkeys(
        answers, b"HTTP/1.1 403 Forbidden"
    )
    assert b"port 8443 is not in runtime.sandbox_egress_ports" in answers["other_port"]
    assert b"127.0.0.1 is loopback" in answers["name_to_loopback"]
    assert accepted == [] and counts == {"connections": 0, "refused": len(answers), "bytes_up": 0, "bytes_down": 0}


def test_malformed_and_unsupported_requests_get_one_line(tmp_path: Path) -> None:
    async def scenario() -> dict[str, bytes]:
        async with Origin() as origin, running(tmp_path, origin) as (_proxy, path):
            return {
                "garbage": await exchange(path, b"\x16\x03\x01 hello\r\n\r\n"),
                "method": await exchange(path, f"PUT http://{PUBLIC_NAME}/ HTTP/1.1\r\n\r\n".encode()),
                "relative": await exchange(path, b"GET /etc/passwd HTTP/1.1\r\n\r\n"),
                "bad_url": await exchange(path, b"GET http://[::1/ HTTP/1.1\r\n\r\n"),
                "no_port": await exchange(path, f"CONNECT {PUBLIC_NAME} HTTP/1.1\r\n\r\n".encode()),
                "huge_port": await exchange(path, f"CONNECT {PUBLIC_NAME}:{'9' * 5000} HTTP/1.1\r\n\r\n".encode()),
                "bad_name": await exchange(path, b"CONNECT a/b@c:443 HTTP/1.1\r\n\r\n"),
                "head_too_big": await exchange(path, b"GET http://x/ HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"),
            }

    answers = asyncio.run(scenario())
    status = {name: answer.split(b" ")[1] if answer else b"" for name, answer in answers.items()}
    assert status == {
        "garbage": b"400",
        "method": b"405",
        "relative": b"400",
        "bad_url": b"400",
        "no_port": b"400",
        "huge_port": b"400",
        "bad_name": b"400",
        "head_too_big": b"400",
    }
    assert all(answer.count(b"\n", answer.index(b"\r\n\r\n") + 4) == 1 for answer in answers.values())


def test_tunnels_are_capped_and_idle_ones_end(tmp_path: Path) -> None:
    """One tunnel at a time here: a second connection gets 503 while the first is open; the first, left silent,
    ends after the idle timeout; then a new one opens again."""

    async def scenario() -> tuple[bytes, bytes, bytes, bytes]:
        async with Origin() as origin, running(tmp_path, origin, max_tunnels=1, idle_timeout_s=0.3) as (_proxy, path):
            first, reader, writer = await tunnel(path, f"{PUBLIC_NAME}:{origin.port}")
            writer.write(b"ECHO / HTTP/1.1\r\n\r\n")  # the origin now waits for lines: the tunnel goes idle
            second = await exchange(path, f"CONNECT {PUBLIC_NAME}:{origin.port} HTTP/1.1\r\n\r\n".encode())
            ended = await asyncio.wait_for(reader.read(), 60)  # readiness: the proxy ends the idle tunnel
            writer.close()
            third, _reader, again = await tunnel(path, f"{PUBLIC_NAME}:{origin.port}")
            again.close()
            return first, second, ended, third

    first, second, ended, third = asyncio.run(scenario())
    assert first.startswith(b"HTTP/1.1 200 ") and second.startswith(b"HTTP/1.1 503 ")
    assert ended == b"" and third.startswith(b"HTTP/1.1 200 ")


def test_stop_ends_open_tunnels(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int, bytes]:
        async with Origin() as origin:
            proxy = EgressProxy(resolve=fake_resolve, policy=origin_policy, ports=[origin.port])
            await proxy.start(tmp_path / "egress.sock")
            _head, reader, writer = await tunnel(tmp_path / "egress.sock", f"{PUBLIC_NAME}:{origin.port}")
            writer.write(b"ECHO / HTTP/1.1\r\n\r\n")
            before = proxy.open_connections
            await asyncio.wait_for(proxy.stop(), 60)
            after = proxy.open_connections  # stop has returned: nothing of the attempt is still connected
            left = await asyncio.wait_for(reader.read(), 60)
            writer.close()
            return before, after, left

    assert asyncio.run(scenario()) == (1, 0, b"")


def test_a_flood_of_connections_is_closed_unanswered(tmp_path: Path) -> None:
    """Past FLOOD_FACTOR x max_tunnels open connections (each one of the runner's descriptors), a new one is closed
    at once, before it may even send its head, and counted as refused."""

    async def scenario() -> tuple[bytes, int]:
        async with Origin() as origin, running(tmp_path, origin, max_tunnels=1) as (proxy, path):
            held = [await asyncio.open_unix_connection(str(path)) for _ in range(FLOOD_FACTOR)]
            while proxy.open_connections < FLOOD_FACTOR:  # readiness: the proxy has accepted them all
                await asyncio.sleep(0.01)
            request = f"GET http://{PUBLIC_NAME}:{origin.port}/ HTTP/1.1\r\n\r\n".encode()
            try:
                answer = await asyncio.wait_for(exchange(path, request), 60)
            except ConnectionResetError:
                answer = b""  # closed with the request unread: the kernel resets it
            for _reader, writer in held:
                writer.close()
            return answer, proxy.counts.refused

    assert asyncio.run(scenario()) == (b"", 1)
