"""A pod's session proxy: sessions opened and closed on its control socket only, each with its token, log and counts;
the agent's TCP listener relays model requests and has no control route."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.proxy_server import ProxySessionError
from mass_ops.runtime.session_proxy import (
    SessionProxy,
    close_proxy_session,
    open_proxy_session,
)
from tests.policy_server import PolicyServer, PolicyServerConfig
from tests.support.proxy import REPO_ROOT, SECRET, EchoUpstream, records_by_seq, served

CHAT = {"model": "policy-stand-in", "messages": [{"role": "user", "content": "Do the task."}]}


def _proxy(tmp: Path, upstream: str, **options: Any) -> SessionProxy:
    return SessionProxy(
        tmp / "sessions", control_socket=tmp / "control.sock", upstreams=[upstream], upstream_api_key=SECRET, **options
    )


def test_session_proxy_gives_each_attempt_a_token_and_a_log_and_sends_the_key_nowhere_else(tmp_path: Path) -> None:
    sessions, control = tmp_path / "sessions", tmp_path / "control.sock"
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        upstream = EchoUpstream()
        async with served(upstream.app()) as upstream_url:
            proxy = _proxy(tmp_path, upstream_url, allowed_host_suffixes=[".ns.svc"])
            async with proxy, aiohttp.ClientSession() as client:
                first = await open_proxy_session(control, sessions)
                second = await open_proxy_session(control, sessions, upstream=upstream_url + "/")
                assert first.token != second.token and first.log_path != second.log_path
                assert first.proxy_url == proxy.url
                for session, probe in ((first, "a"), (second, "b"), (second, "c")):
                    headers = {"Authorization": f"Bearer {session.token}"}
                    body = {"probe": probe, "messages": []}
                    async with client.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers) as r:
                        assert r.status == 200
                    assert upstream.seen_headers["authorization"] == f"Bearer {SECRET}"
                closed = [await close_proxy_session(control, s) for s in (first, second)]
                seen["counts"] = [(c.records, c.usage.requests) for c in closed]
                # A closed session's token is dead; the key never goes to a host outside the allow-list.
                headers = {"Authorization": f"Bearer {first.token}"}
                async with client.post(f"{proxy.url}/v1/chat/completions", json={}, headers=headers) as r:
                    seen["after_close"] = r.status
                for foreign in ("http://attacker.example", "http://evil-ns.svc", "ftp://x.ns.svc"):
                    with pytest.raises(ProxySessionError, match="HTTP 403"):
                        await open_proxy_session(control, sessions, upstream=foreign)
                allowed = await open_proxy_session(control, sessions, upstream="http://vllm-l1.ns.svc:8000")
                await close_proxy_session(control, allowed, discard=True)
                assert not allowed.log_path.exists()
                seen["logs"] = [first.log_path, second.log_path]
            seen["hits"] = dict(upstream.hits)

    asyncio.run(scenario())
    assert seen["counts"] == [(1, 1), (2, 2)] and seen["after_close"] == 401
    assert seen["hits"] == {"/v1/chat/completions": 3}
    first_log, second_log = seen["logs"]
    assert [r["request"]["probe"] for r in records_by_seq(first_log)] == ["a"]
    assert [r["request"]["probe"] for r in records_by_seq(second_log)] == ["b", "c"]
    [refused] = records_by_seq(sessions / "rejected.jsonl")
    assert refused["status"] == 401 and refused["rejected"] == "wrong_token"
    for path in sessions.iterdir():
        assert SECRET not in path.read_text()


def test_the_agent_s_listener_has_no_control_route_and_forwards_none_of_its_paths(tmp_path: Path) -> None:
    """ISSUE #25.4: what the sandbox reaches (the TCP listener) cannot open, close, discard or inspect a session, nor
    point one at another host, with or without a session's token; nothing of it reaches the upstream."""
    control = tmp_path / "control.sock"
    attempts = [
        ("POST", "/_mass_proxy/sessions", {"upstream": "http://attacker.example"}),
        ("POST", "/_mass_proxy/sessions", {}),
        ("POST", "/_mass_proxy/sessions/{session}/close", {"discard": True}),
        ("GET", "/_mass_proxy/health", None),
    ]

    async def scenario() -> dict[str, Any]:
        upstream = EchoUpstream()
        async with served(upstream.app()) as upstream_url:
            proxy = _proxy(tmp_path, upstream_url)
            async with proxy, aiohttp.ClientSession() as client:
                session = await open_proxy_session(control, tmp_path / "sessions")
                statuses = []
                for headers in ({}, {"Authorization": f"Bearer {session.token}"}):
                    for method, path, body in attempts:
                        url = proxy.url + path.format(session=session.name)
                        async with client.request(method, url, json=body, headers=headers) as r:
                            statuses.append(r.status)
                async with (
                    aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(control))) as local,
                    local.get("http://proxy/_mass_proxy/health") as r,
                ):
                    health = await r.json()
                closed = await close_proxy_session(control, session)
            return {"statuses": statuses, "health": health, "records": closed.records, "hits": upstream.hits}

    seen = asyncio.run(scenario())
    assert seen["statuses"] == [404] * 8
    assert seen["health"] == {"status": "ok", "sessions": 1}, "the session the agent tried to close is still open"
    assert seen["records"] == 0 and seen["hits"] == {}
    # No other session was opened (one log besides the rejections), and nothing was logged anywhere.
    logs = {path.name: path.read_text() for path in (tmp_path / "sessions").iterdir()}
    assert len(logs) == 2 and "rejected.jsonl" in logs and set(logs.values()) == {""}


def test_the_close_answer_carries_the_proxy_s_own_counts_whatever_the_log_file_says(tmp_path: Path) -> None:
    """ISSUE #25.6: the counts come from the proxy's memory, settled exchange by exchange: a log file truncated and
    fed fabricated records while the session ran changes none of them."""
    control = tmp_path / "control.sock"
    fake = {"path": "/v1/chat/completions", "status": 200, "response": {"usage": {"prompt_tokens": 10**9}}}

    async def scenario() -> tuple[Any, list[dict[str, Any]]]:
        seen_usage = []
        async with PolicyServer() as server:
            proxy = _proxy(tmp_path, server.base_url)
            async with proxy, aiohttp.ClientSession() as client:
                session = await open_proxy_session(control, tmp_path / "sessions")
                headers = {"Authorization": f"Bearer {session.token}"}
                for round_ in range(3):
                    async with client.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as r:
                        seen_usage.append((await r.json())["usage"])
                    if round_ == 1:  # truncated, then fed a record no server answered
                        session.log_path.write_text(json.dumps(fake) + "\n")
                async with client.get(f"{proxy.url}/v1/models", headers=headers) as r:
                    assert r.status == 200
                closed = await close_proxy_session(control, session)
        return closed, seen_usage

    closed, seen_usage = asyncio.run(scenario())
    truth = UsageTotals.from_records([{"path": "/v1/chat/completions", "response": {"usage": u}} for u in seen_usage])
    assert closed.records == 4 and closed.usage == truth and truth.requests == 3 and truth.prompt_tokens > 0


def test_session_proxy_command_line_reads_the_key_from_its_own_environment(tmp_path: Path) -> None:
    sessions, port_file, control = tmp_path / "sessions", tmp_path / "proxy.port", tmp_path / "control.sock"
    argv = [sys.executable, "-m", "mass_ops.runtime.session_proxy", "--listen", "0", "--sessions-dir", str(sessions)]
    argv += ["--control-socket", str(control)]

    # Missing --key-env, or a key with whitespace: one line, exit 2, nothing served.
    bad = subprocess.run([*argv, "--upstream", "http://127.0.0.1:9"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert bad.returncode == 2 and "--key-env" in bad.stderr
    spaced = subprocess.run(
        [*argv, "--upstream", "http://127.0.0.1:9", "--key-env", "K"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "K": "sk-a b"},
    )
    assert spaced.returncode == 2 and spaced.stderr.strip().count("\n") == 0 and "sk-a" not in spaced.stderr

    async def scenario() -> None:
        async with PolicyServer(PolicyServerConfig(models=("tiny",))) as server:
            process = await asyncio.create_subprocess_exec(
                *argv,
                "--upstream",
                server.base_url,
                "--key-env",
                "MASS_PROXY_TEST_KEY",
                "--port-file",
                str(port_file),
                "--request-priority",  # as the episode pod's proxy container gets it (compute.kubernetes)
                "7",
                cwd=REPO_ROOT,
                env={**os.environ, "MASS_PROXY_TEST_KEY": SECRET},
                stdout=subprocess.DEVNULL,
            )
            try:
                for _ in range(200):  # the port file comes once both listeners are up
                    if port_file.exists():
                        break
                    await asyncio.sleep(0.05)
                url = f"http://127.0.0.1:{int(port_file.read_text())}"
                async with aiohttp.ClientSession() as client:
                    async with client.get(f"{url}/v1/models") as r:
                        assert r.status == 401
                    async with client.get(f"{url}/_mass_proxy/health") as r:
                        assert r.status == 404
                    session = await open_proxy_session(control, sessions)
                    chat = {"model": "tiny", "priority": -1, "messages": [{"role": "user", "content": "Do the task."}]}
                    headers = {"Authorization": f"Bearer {session.token}"}
                    async with client.post(f"{url}/v1/chat/completions", json=chat, headers=headers) as r:
                        assert r.status == 200
                    await close_proxy_session(control, session)
                received.extend(request.get("priority") for request in server.requests)
            finally:
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), timeout=10) == 0

    received: list[Any] = []
    asyncio.run(scenario())
    assert records_by_seq(sessions / "rejected.jsonl")[0]["rejected"] == "missing_token"
    assert received == [7], "the command line's priority replaced the agent's"


def test_a_pod_s_session_proxy_stamps_the_pod_s_priority_on_every_session(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"

    async def scenario() -> tuple[list[Any], int]:
        async with PolicyServer() as server:
            proxy = _proxy(tmp_path, server.base_url, request_priority=12)
            async with proxy, aiohttp.ClientSession() as client:
                for _ in range(2):
                    session = await open_proxy_session(control, tmp_path / "sessions")
                    headers = {"Authorization": f"Bearer {session.token}"}
                    async with client.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as r:
                        assert r.status == 200
                    await close_proxy_session(control, session)
                # The sandbox cannot open a session of its own priority: control is not on its listener.
                async with client.post(f"{proxy.url}/_mass_proxy/sessions", json={"priority": -100}) as r:
                    refused = r.status
            return [request.get("priority") for request in server.requests], refused

    assert asyncio.run(scenario()) == ([12, 12], 404)
