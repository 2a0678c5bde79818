"""The logging proxy against real HTTP upstreams: an echo app written here and the policy stand-in server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mass_ops.runtime import record_writer
from mass_ops.runtime.episode_budget import EpisodeBudget
from mass_ops.runtime.proxy_access import ProxyConfigError
from mass_ops.runtime.proxy_server import LoggingProxy
from mass_ops.runtime.record_writer import RECORD_PROCESS_BYTES, RecordWriter
from tests.policy_server import Fault, FaultRule, PolicyServer, PolicyServerConfig
from tests.support.proxy import REPO_ROOT, SECRET, EchoUpstream, records_by_seq, served


def _with_echo(test: Callable[[EchoUpstream, LoggingProxy, aiohttp.ClientSession], Awaitable[None]], log: Path) -> None:
    async def scenario() -> None:
        upstream = EchoUpstream()
        async with (
            served(upstream.app()) as upstream_url,
            LoggingProxy(upstream_url, log) as proxy,
            aiohttp.ClientSession() as client,
        ):
            await test(upstream, proxy, client)

    asyncio.run(scenario())


def test_forwards_request_with_identity_encoding_and_logs_json(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    seen: dict[str, Any] = {}

    async def test(upstream: EchoUpstream, proxy: LoggingProxy, client: aiohttp.ClientSession) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with client.post(
            f"{proxy.url}/v1/completions?a=1&b=x%20y",
            json=body,
            headers={
                "Authorization": f"Bearer {SECRET}",
                "Accept-Encoding": "gzip, br",
                "Proxy-Authorization": "Basic c2VjcmV0",
                "X-Custom": "kept",
            },
        ) as response:
            assert response.status == 200
            seen.update(await response.json())
            seen["client_request_id"] = response.headers.get("X-Request-Id")
        seen["headers"] = upstream.seen_headers

    _with_echo(test, log)
    headers = seen["headers"]
    assert seen["method"] == "POST" and seen["path_qs"] == "/v1/completions?a=1&b=x%20y"
    assert headers["accept-encoding"] == "identity"
    assert headers["authorization"] == f"Bearer {SECRET}"  # forwarded upstream...
    assert headers["x-custom"] == "kept"
    assert "proxy-authorization" not in headers
    assert headers["content-length"] == str(seen["body_bytes"]) and "transfer-encoding" not in headers
    assert seen["client_request_id"] == "req-42"

    (record,) = records_by_seq(log)
    assert SECRET not in log.read_text(encoding="utf-8")  # ...but never logged, nor any other header value
    assert record["method"] == "POST" and record["path"] == "/v1/completions" and record["seq"] == 1
    assert record["request"] == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert record["request_bytes"] == seen["body_bytes"]
    assert record["status"] == 200 and record["stream"] is False
    assert record["response"]["path_qs"] == "/v1/completions?a=1&b=x%20y"
    assert record["response_headers"] == {"content-type": "application/json; charset=utf-8", "x-request-id": "req-42"}
    assert record["response_bytes"] > 0 and record["duration_s"] >= 0
    assert record["ts_start_iso"].startswith(time.strftime("%Y", time.gmtime(record["ts_start"])))
    assert "proxy_error" not in record and "client_disconnected" not in record


def test_non_json_generation_bodies_are_refused_and_logged_raw_and_large_json_bodies_pass(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    raw = b"x" * 1000
    large = {"model": "m", "prompt": "y" * (12 * 1024**2)}  # parsed by a body parser process, not on the loop

    async def test(upstream: EchoUpstream, proxy: LoggingProxy, client: aiohttp.ClientSession) -> None:
        async with client.post(f"{proxy.url}/v1/completions", data=raw) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "bad_generation_request"
        async with client.post(f"{proxy.url}/v1/completions", data=io.BytesIO(json.dumps(large).encode())) as r:
            assert (await r.json())["body_bytes"] == len(json.dumps(large, separators=(",", ":")))
        async with client.get(f"{proxy.url}/v1/models/plain") as response:
            assert await response.text() == "not json at all"
        assert upstream.hits == {"/v1/completions": 1}  # the refused body never reached it

    _with_echo(test, log)
    refused, passed, plain = records_by_seq(log)
    assert refused["request_bytes"] == len(raw) and refused["request_raw"] == raw.decode()
    assert refused["rejected"] == "bad_generation_request" and "request" not in refused
    assert passed["request"] == large and passed["status"] == 200
    assert plain["request"] is None and plain["response_raw"] == "not json at all" and "response" not in plain


def test_redirects_are_relayed_not_followed(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"

    async def test(upstream: EchoUpstream, proxy: LoggingProxy, client: aiohttp.ClientSession) -> None:
        async with client.get(f"{proxy.url}/v1/models/redirect", allow_redirects=False) as response:
            assert response.status == 302
            assert response.headers["Location"] == "/elsewhere"
        assert upstream.hits == {"/v1/models/redirect": 1}

    _with_echo(test, log)
    assert [r["status"] for r in records_by_seq(log)] == [302]


def test_sse_is_relayed_incrementally(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"

    async def test(upstream: EchoUpstream, proxy: LoggingProxy, client: aiohttp.ClientSession) -> None:
        async with client.get(f"{proxy.url}/v1/models/gated-stream") as response:
            # The upstream holds the rest of the stream until the gate opens; a buffering proxy would deadlock here.
            first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
            assert b'"first"' in first
            upstream.gate.set()
            rest = await response.content.read()
            assert rest.endswith(b"data: [DONE]\n\n")

    _with_echo(test, log)
    (record,) = records_by_seq(log)
    assert record["stream"] is True
    assert record["response"]["choices"][0]["message"]["content"] == "first second"
    assert record["response"]["done"] is True
    assert record["sse_raw"].count("data: ") == 3


def test_policy_stream_through_proxy_is_byte_identical_and_reassembled(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    body = {
        "model": "policy-stand-in",
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "You are Qwen Code, a CLI agent."},
            {"role": "user", "content": "I'm currently working in the directory: /work/ws\nDo the task."},
        ],
    }

    async def scenario() -> tuple[bytes, bytes]:
        async with (
            PolicyServer() as server,
            LoggingProxy(server.base_url, log) as proxy,
            aiohttp.ClientSession() as client,
        ):
            async with client.post(f"{server.base_url}/v1/chat/completions", json=body) as direct:
                direct_bytes = await direct.read()
            async with client.post(f"{proxy.url}/v1/chat/completions", json=body) as proxied:
                assert proxied.headers["Content-Type"].startswith("text/event-stream")
                return direct_bytes, await proxied.read()

    direct_bytes, proxied_bytes = asyncio.run(scenario())

    def normalise(raw: bytes) -> bytes:  # the two calls differ only in completion serial and creation time
        raw = re.sub(rb'"created": \d+', b'"created": 0', raw)
        return re.sub(rb"(chatcmpl-standin-|call_)\d{6}", rb"\g<1>N", raw)

    assert normalise(direct_bytes) == normalise(proxied_bytes)
    assert direct_bytes.count(b"data: ") == proxied_bytes.count(b"data: ") > 5
    (record,) = records_by_seq(log)
    assert record["sse_raw"] == proxied_bytes.decode()
    message = record["response"]["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "write_file"
    assert json.loads(call["function"]["arguments"])["file_path"] == "/work/ws/research_report.md"
    assert message["reasoning_content"] and message["content"]
    assert record["response"]["usage"]["prompt_tokens"] > 0
    assert record["request"]["seed"] == 3


def test_upstream_down_gives_502_and_class_name_only(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]

    async def scenario() -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {SECRET}"}
        async with (
            LoggingProxy(f"http://127.0.0.1:{dead_port}", log) as proxy,
            aiohttp.ClientSession() as client,
            client.get(f"{proxy.url}/v1/models", headers=headers) as response,
        ):
            return response.status, await response.json()

    status, payload = asyncio.run(scenario())
    assert status == 502 and payload["error"]["type"] == "proxy_error"
    (record,) = records_by_seq(log)
    assert record["status"] == 502
    assert record["proxy_error"] == "ClientConnectorError"
    assert str(dead_port) not in json.dumps({k: v for k, v in record.items() if k != "path"})
    assert SECRET not in log.read_text(encoding="utf-8")


def test_stream_cut_upstream_is_cut_for_the_client_and_recorded(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    config = PolicyServerConfig(faults=[FaultRule(Fault.STREAM_CUT, after_chunks=2)])
    body = {"model": "policy-stand-in", "stream": True, "messages": [{"role": "user", "content": "hello"}]}

    async def scenario() -> bytes:
        received = b""
        async with (
            PolicyServer(config) as server,
            LoggingProxy(server.base_url, log) as proxy,
            aiohttp.ClientSession() as client,
            client.post(f"{proxy.url}/v1/chat/completions", json=body) as r,
        ):
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in r.content.iter_any():
                    received += chunk
        return received

    received = asyncio.run(scenario())
    assert received.count(b"data: ") == 2 and b"[DONE]" not in received
    (record,) = records_by_seq(log)
    assert record["proxy_error"] == "ClientPayloadError"
    assert record["response"]["done"] is False and record["response"]["n_chunks"] == 2


def test_client_disconnect_mid_stream_is_recorded(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    config = PolicyServerConfig(chunk_delay_s=0.02, chunk_chars=2)
    body = {"model": "policy-stand-in", "stream": True, "messages": [{"role": "user", "content": "hello"}]}

    async def scenario() -> None:
        async with PolicyServer(config) as server, LoggingProxy(server.base_url, log) as proxy:
            async with aiohttp.ClientSession() as client:
                response = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
                await response.content.readuntil(b"\n\n")
                response.close()  # drop the connection with most of the stream still to come
            for _ in range(200):
                if log.exists() and log.stat().st_size:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
    (record,) = records_by_seq(log)
    assert record["client_disconnected"] is True
    assert record["response"]["done"] is False


def test_concurrent_records_are_whole_lines_with_unique_seq(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    body = {"model": "policy-stand-in", "stream": True, "messages": [{"role": "user", "content": "x" * 20000}]}

    async def scenario() -> None:
        async with (
            PolicyServer(PolicyServerConfig(chunk_chars=4)) as server,
            LoggingProxy(server.base_url, log) as proxy,
            aiohttp.ClientSession() as client,
        ):

            async def one() -> None:
                async with client.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
                    assert (await response.read()).endswith(b"data: [DONE]\n\n")

            await asyncio.gather(*(one() for _ in range(24)))

    asyncio.run(scenario())
    records = records_by_seq(log)  # json.loads on every line: a torn line would fail here
    assert sorted(r["seq"] for r in records) == list(range(1, 25))
    assert all(r["response"]["done"] for r in records)


def test_command_line_entry_point(tmp_path: Path) -> None:
    log, port_file = tmp_path / "api.jsonl", tmp_path / "proxy.port"

    async def scenario() -> None:
        async with PolicyServer(PolicyServerConfig(models=("tiny",))) as server:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mass_ops.runtime.proxy",
                "--listen",
                "0",
                "--upstream",
                server.base_url,
                "--log",
                str(log),
                "--port-file",
                str(port_file),
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
            )
            try:
                for _ in range(200):
                    if port_file.exists():
                        break
                    await asyncio.sleep(0.05)
                port = int(port_file.read_text())
                async with aiohttp.ClientSession() as client, client.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
            finally:
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), timeout=10) == 0

    asyncio.run(scenario())
    (record,) = records_by_seq(log)
    assert record["path"] == "/v1/models" and record["status"] == 200
    assert os.stat(log).st_mode & 0o077 == 0  # the log is private to its owner


# Every public name the proxy module had before it was split by concern: runner, handoff, benchmarks and the contract
# tests import them from `mass_ops.runtime.proxy`, which now re-exports them from their modules.
PROXY_NAMES = [
    "BEARER",
    "BUDGET_ERROR_CODE",
    "BUDGET_STATUS",
    "CHAT_ROUTE",
    "COMPLETIONS_ROUTE",
    "CONNECT_TIMEOUT_S",
    "CREDENTIAL_HEADERS",
    "DEFAULT_CLIENT_PATH",
    "DEFAULT_KEY_VALUE",
    "EpisodeBudget",
    "GENERATION_ROUTES",
    "GenerationRequest",
    "GenerationRequestError",
    "HANDLER_DRAIN_S",
    "HOP_BY_HOP_HEADERS",
    "LOGGED_RESPONSE_HEADERS",
    "LoggingProxy",
    "MAX_REQUEST_BYTES",
    "MIN_REDACTED_SECRET",
    "MODELS_ROUTE",
    "MODEL_ID",
    "PARSE_PROCESSES",
    "PARSE_PROCESS_BYTES",
    "PROMPT_BYTES_PER_TOKEN",
    "ProxyConfigError",
    "ProxySessionError",
    "RECORD_PROCESS_BYTES",
    "RECORD_WRITER_FLAG",
    "RECORD_WRITER_NICE",
    "REDACTION",
    "RELAY_READ_BUFFER",
    "RESPONSES_ROUTE",
    "TOKEN_BYTES",
    "WHOLE_BODY_BYTES",
    "add_route_arguments",
    "allowed_route",
    "main",
    "new_agent_token",
    "prepare_generation",
    "prepare_generation_off_loop",
    "run_proxy_main",
    "upstream_key_from_env",
    "usage_cost",
    "usage_tokens",
]


def test_the_proxy_module_still_exports_every_name_it_had() -> None:
    from mass_ops.runtime import proxy

    assert sorted(set(PROXY_NAMES) - set(proxy.__all__)) == []
    assert all(hasattr(proxy, name) for name in proxy.__all__)
    assert proxy.LoggingProxy is LoggingProxy and proxy.RecordWriter is RecordWriter  # the same objects, not copies


def test_the_record_writer_answers_on_its_old_command_line_too(tmp_path: Path) -> None:
    """`python -m mass_ops.runtime.proxy --record-writer` still runs the writer: end of input ends it cleanly."""
    for module, flags in (("mass_ops.runtime.record_writer", []), ("mass_ops.runtime.proxy", ["--record-writer"])):
        done = subprocess.run(
            [sys.executable, "-m", module, *flags], input=b"", capture_output=True, cwd=REPO_ROOT, timeout=60
        )
        assert (done.returncode, done.stdout) == (0, b""), (module, done.stderr[-2000:])


# --- the proxy holds the key; the agent holds a token (ISSUE #13.4) ------------------------------------------------

TOKEN = "tok-" + "x" * 40


def test_only_the_episode_token_passes_and_the_proxy_adds_the_key(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    answers: dict[str, Any] = {}

    async def scenario() -> None:
        upstream = EchoUpstream()
        async with (
            served(upstream.app()) as upstream_url,
            LoggingProxy(upstream_url, log, agent_token=TOKEN, upstream_api_key=SECRET) as proxy,
            aiohttp.ClientSession() as client,
        ):
            for name, headers in (
                ("none", {}),
                ("wrong", {"Authorization": "Bearer tok-" + "y" * 40}),
                ("the key itself", {"Authorization": f"Bearer {SECRET}"}),
                ("not bearer", {"Authorization": f"Basic {TOKEN}"}),
            ):
                async with client.post(f"{proxy.url}/v1/completions", json={"probe": name}, headers=headers) as r:
                    answers[name] = (r.status, await r.json())
            assert upstream.hits == {}  # nothing refused reached the upstream
            headers = {"Authorization": f"Bearer {TOKEN}", "X-Api-Key": "agent-side"}
            async with client.post(f"{proxy.url}/v1/completions", json={"probe": "ok"}, headers=headers) as response:
                answers["ok"] = (response.status, await response.json())
            answers["seen"] = dict(upstream.seen_headers)
            assert upstream.hits == {"/v1/completions": 1}

    asyncio.run(scenario())
    for name in ("none", "wrong", "the key itself", "not bearer"):
        status, body = answers[name]
        assert status == 401 and body["error"]["type"] == "authentication_error", name
    assert answers["ok"][0] == 200
    seen = answers["seen"]
    assert seen["authorization"] == f"Bearer {SECRET}"  # the proxy's key, not the agent's token
    assert "x-api-key" not in seen and TOKEN not in json.dumps(seen)

    records = records_by_seq(log)
    text = log.read_text(encoding="utf-8")
    assert TOKEN not in text and SECRET not in text and "y" * 40 not in text  # no header is ever logged
    refused = [record for record in records if "rejected" in record]
    assert [(r["status"], r["rejected"]) for r in refused] == [
        (401, "missing_token"),
        (401, "wrong_token"),
        (401, "wrong_token"),
        (401, "missing_token"),
    ]
    assert all(r["request"] is None and r["request_bytes"] > 0 for r in refused)  # the body is not kept either
    [accepted] = [record for record in records if "rejected" not in record]
    assert accepted["status"] == 200 and accepted["request"] == {"probe": "ok"}


def test_an_upstream_that_echoes_the_key_is_logged_redacted(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"

    async def echo_key(request: web.Request) -> web.Response:
        return web.json_response({"you_sent": request.headers.get("Authorization")})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/v1/models/whoami", echo_key)
        async with (
            served(app) as upstream_url,
            LoggingProxy(upstream_url, log, agent_token=TOKEN, upstream_api_key=SECRET) as proxy,
            aiohttp.ClientSession() as client,
            client.get(f"{proxy.url}/v1/models/whoami", headers={"Authorization": f"Bearer {TOKEN}"}) as response,
        ):
            assert response.status == 200

    asyncio.run(scenario())
    [record] = records_by_seq(log)
    assert record["response"] == {"you_sent": "Bearer [REDACTED]"} and SECRET not in log.read_text()


def test_a_key_without_a_token_is_refused() -> None:
    with pytest.raises(ProxyConfigError, match="needs an agent token"):
        LoggingProxy("http://127.0.0.1:1", "/nonexistent/log", upstream_api_key=SECRET)


# --- records off the event loop: order, the record writer process, its failure ------------------------------------


def _chunk(i: int, **extra: Any) -> bytes:
    chunk = {"id": "c-big", "model": "m", "created": 1, "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
    return f"data: {json.dumps(chunk | extra)}\n\n".encode()


class BigStreamUpstream:
    """Streams `events` chat chunks (large enough for the record writer), usage last; `hold` leaves it unfinished."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/v1/chat/completions", self._stream)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        events = int(request.query.get("events", "4000"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, events, 100):
            await response.write(b"".join(_chunk(i) for i in range(start, min(start + 100, events))))
        if request.query.get("hold"):
            await asyncio.wait_for(self.release.wait(), timeout=10)
            for start in range(events, events + 2000, 100):  # paced, so the proxy's writes meet the client's reset
                await asyncio.sleep(0.005)
                await response.write(b"".join(_chunk(i) for i in range(start, start + 100)))
        usage = {"prompt_tokens": 7, "completion_tokens": events, "total_tokens": events + 7}
        await response.write(_chunk(events, usage=usage) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _big_stream_records(
    log: Path, scenario: Callable[[str, aiohttp.ClientSession], Awaitable[None]], budget: EpisodeBudget | None = None
) -> None:
    async def run() -> None:
        async with (
            served(BigStreamUpstream().app()) as upstream_url,
            LoggingProxy(upstream_url, log, budget=budget) as proxy,
            aiohttp.ClientSession() as client,
        ):
            await scenario(proxy.url, client)

    asyncio.run(run())


def _file_order(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def test_records_are_written_in_the_order_their_exchanges_ended(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"

    async def scenario(url: str, client: aiohttp.ClientSession) -> None:
        # A ~2 MB stream's record takes far longer to build than the small request's that ends right after it.
        async with client.post(f"{url}/v1/chat/completions", params={"events": "20000"}, json={}) as response:
            raw = await response.read()
        assert raw.endswith(b"data: [DONE]\n\n") and len(raw) > 1 << 20
        async with client.get(f"{url}/v1/models") as response:
            await response.read()

    _big_stream_records(log, scenario)
    records = _file_order(log)
    assert [record["seq"] for record in records] == [1, 2]
    assert records[0]["response"]["done"] is True and records[0]["response"]["n_chunks"] == 20001


BIG_PROMPT = {"messages": [{"role": "user", "content": "x" * 1000}]}


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("ts_start", "ts_start_iso", "duration_s")}


def test_the_record_writer_process_writes_the_record_a_thread_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(url: str, client: aiohttp.ClientSession) -> None:
        async with client.post(f"{url}/v1/chat/completions", params={"events": "4000"}, json=BIG_PROMPT) as response:
            await response.read()

    started = []
    real_init = RecordWriter.__init__

    def counting_init(self: Any) -> None:
        started.append(self)
        real_init(self)

    threshold = RECORD_PROCESS_BYTES
    monkeypatch.setattr(RecordWriter, "__init__", counting_init)
    monkeypatch.setattr(RecordWriter, "_shared", None)
    _big_stream_records(tmp_path / "writer.jsonl", scenario)
    assert len(started) == 1  # the record really went through the writer process
    monkeypatch.setattr(record_writer, "RECORD_PROCESS_BYTES", 1 << 62)
    _big_stream_records(tmp_path / "thread.jsonl", scenario)
    assert len(started) == 1
    (by_writer,) = _file_order(tmp_path / "writer.jsonl")
    (by_thread,) = _file_order(tmp_path / "thread.jsonl")
    assert _comparable(by_writer) == _comparable(by_thread)
    assert len(by_writer["sse_raw"]) == by_writer["response_bytes"] > threshold
    assert by_writer["request"] == BIG_PROMPT
    for started_writer in started:
        started_writer.close()


def test_a_dead_record_writer_loses_no_record_and_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "api.jsonl"
    monkeypatch.setattr(RecordWriter, "_shared", None)
    dead = RecordWriter.shared()
    assert dead is not None
    dead._process.kill()
    dead._process.wait()

    async def scenario(url: str, client: aiohttp.ClientSession) -> None:
        for _ in range(2):
            async with client.post(f"{url}/v1/chat/completions", params={"events": "4000"}, json={}) as response:
                await response.read()

    _big_stream_records(log, scenario)
    records = _file_order(log)
    assert [record["seq"] for record in records] == [1, 2]
    assert all(record["response"]["done"] and record["response"]["n_chunks"] == 4001 for record in records)
    replacement = RecordWriter._shared
    assert dead.broken and replacement is not None and replacement is not dead and not replacement.broken
    replacement.close()


def test_a_client_gone_mid_stream_still_gets_a_whole_record_from_the_writer(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    upstream = BigStreamUpstream()

    async def run() -> None:
        async with (
            served(upstream.app()) as upstream_url,
            LoggingProxy(upstream_url, log) as proxy,
            aiohttp.ClientSession() as client,
        ):
            params = {"events": "4000", "hold": "1"}
            response = await client.post(f"{proxy.url}/v1/chat/completions", params=params, json={})
            received = 0
            while received <= RECORD_PROCESS_BYTES:
                received += len(await response.content.readany())
            response.close()  # gone with the stream unfinished
            upstream.release.set()  # the proxy's next writes find the client gone
            for _ in range(200):
                if log.exists() and log.stat().st_size:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(run())
    (record,) = _file_order(log)
    assert record["client_disconnected"] is True
    assert record["response"]["done"] is False and record["response"]["n_chunks"] >= 1000
    assert len(record["sse_raw"].encode()) == record["response_bytes"] > RECORD_PROCESS_BYTES


def test_a_record_from_the_writer_settles_the_budget_with_its_usage(tmp_path: Path) -> None:
    budget = EpisodeBudget(episode_tokens=1_000_000, default_max_tokens=16)

    async def scenario(url: str, client: aiohttp.ClientSession) -> None:
        async with client.post(f"{url}/v1/chat/completions", params={"events": "4000"}, data=b"{}") as response:
            await response.read()

    _big_stream_records(tmp_path / "api.jsonl", scenario, budget)
    assert (budget.spent, budget.in_flight) == (4007, 0)  # the usage of the stream's last chunk came back


def test_the_proxy_process_runs_on_uvloop_where_it_is_installed() -> None:
    """The proxy's command line serves on uvloop (a dependency on Linux): its relay spends less CPU per byte there."""
    pytest.importorskip("uvloop", reason="uvloop is a dependency on Linux; this platform has none")
    from mass_ops.runtime.proxy import run_proxy_main

    loops: list[str] = []

    async def main() -> None:
        loops.append(type(asyncio.get_running_loop()).__module__)

    run_proxy_main(main())
    assert loops and loops[0].startswith("uvloop")


# --- server priority (ISSUE #17.2) -----------------------------------------------------------------------------------


def test_the_episode_proxy_stamps_its_priority_on_completions_only(tmp_path: Path) -> None:
    log = tmp_path / "api.jsonl"
    chat = {"model": "policy-stand-in", "priority": -5, "messages": [{"role": "user", "content": "Do the task."}]}
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        upstream = EchoUpstream()
        async with (
            PolicyServer() as server,
            served(upstream.app()) as echo_url,
            aiohttp.ClientSession() as client,
        ):
            async with LoggingProxy(server.base_url, log, request_priority=4) as proxy:
                async with client.post(f"{proxy.url}/v1/chat/completions", json=chat) as response:
                    assert response.status == 200
                async with client.get(f"{proxy.url}/v1/models") as response:
                    assert response.status == 200
            seen["received"] = [request.get("priority") for request in server.requests]
            async with (
                LoggingProxy(echo_url, tmp_path / "echo.jsonl", request_priority=4) as proxy,
                client.post(f"{proxy.url}/v1/completions", json={"priority": -5}) as response,
            ):
                seen["echoed"] = (await response.json())["body_head"]

    asyncio.run(scenario())
    assert seen["received"] == [4], "the server sees the episode's priority, never the agent's"
    chat_record, models_record = records_by_seq(log)
    assert chat_record["request"] == {**chat, "priority": 4}, "the record holds the body as forwarded"
    assert chat_record["request_bytes"] == len(json.dumps({**chat, "priority": 4}, separators=(",", ":")))
    assert models_record["method"] == "GET" and models_record["request_bytes"] == 0
    assert json.loads(seen["echoed"]) == {"priority": 4}, "every generation route gets the episode's priority"


def test_a_body_nested_past_the_parser_s_depth_is_refused_and_recorded_not_dropped(tmp_path: Path) -> None:
    """An agent's request nested deeper than Python's JSON parser can follow (RecursionError, not ValueError) must
    not break the proxy: the proxy cannot read what it may spend, so it is refused (400, never forwarded, nothing
    held on the budget), and its record is kept, raw."""
    log = tmp_path / "api.jsonl"
    depth = 100_000
    body = b'{"priority": -5, "messages": ' + b"[" * depth + b"]" * depth + b"}"
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        upstream = EchoUpstream()
        budget = EpisodeBudget(episode_tokens=10**9, default_max_tokens=16)
        async with (
            served(upstream.app()) as upstream_url,
            LoggingProxy(upstream_url, log, budget=budget, request_priority=4) as proxy,
            aiohttp.ClientSession() as client,
            client.post(f"{proxy.url}/v1/chat/completions", data=body) as response,
        ):
            seen["status"] = response.status
            seen["echo"] = await response.json()
        seen["spent_need"] = budget.in_flight
        seen["hits"] = upstream.hits

    asyncio.run(scenario())
    assert seen["status"] == 400 and seen["echo"]["error"]["code"] == "bad_generation_request"
    assert seen["spent_need"] == 0 and seen["hits"] == {}
    (record,) = records_by_seq(log)
    assert record["request_raw"] == body.decode() and record["request_bytes"] == len(body)
