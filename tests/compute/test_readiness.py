"""Readiness = /health 200, the served name listed by /v1/models and a one-token smoke generation; probes send the
key as a bearer header."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mass_ops.compute.readiness import (
    health_url,
    listed_models,
    models_url,
    probe,
    probe_async,
    readiness_problem,
    server_root,
    smoke_problem,
    smoke_request,
    smoke_url,
)
from tests.compute.model_server_stub import serve_in_thread


def endpoint_of(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_urls_of_an_openai_endpoint():
    assert server_root("http://vllm.ns.svc:8001/v1/") == "http://vllm.ns.svc:8001"
    assert health_url("http://127.0.0.1:8011/v1") == "http://127.0.0.1:8011/health"
    assert models_url("http://127.0.0.1:8011/v1/") == "http://127.0.0.1:8011/v1/models"


@pytest.mark.parametrize(
    ("status", "payload", "expected"),
    [
        (None, None, "/health did not answer"),
        (503, None, "/health answered HTTP 503"),
        (200, {"data": [{"id": "other"}]}, "/v1/models lists ['other'] but not 'L1'"),
        (200, {"unexpected": True}, "/v1/models lists [] but not 'L1'"),
        (200, {"data": [{"id": "x"}, {"id": "L1"}]}, None),
    ],
)
def test_readiness_needs_health_and_the_served_name(status, payload, expected):
    assert readiness_problem(status, payload, "L1") == expected


def test_listed_models_ignores_malformed_entries():
    assert listed_models({"data": [{"id": "a"}, "junk", {"no_id": 1}, {"id": 2}]}) == ["a", "2"]


def test_probe_of_a_ready_server():
    server = serve_in_thread("Qwen/Qwen3.6-27B-FP8")
    try:
        report = probe(endpoint_of(server), "Qwen/Qwen3.6-27B-FP8")
        assert report.ready and report.problem is None
        wrong = probe(endpoint_of(server), "L1")
        assert not wrong.ready and "not 'L1'" in wrong.problem
    finally:
        server.shutdown()


def test_probe_of_a_loading_server_and_of_nothing():
    server = serve_in_thread("L1", healthy=False)
    try:
        assert probe(endpoint_of(server), "L1").problem == "/health answered HTTP 503"
    finally:
        server.shutdown()
    assert "unreachable" in probe(endpoint_of(server), "L1", timeout_s=1).problem


def test_probe_sends_the_key_from_the_named_variable(monkeypatch):
    server = serve_in_thread("L1", key="s3cret-key")
    try:
        monkeypatch.delenv("PROBE_KEY", raising=False)
        assert probe(endpoint_of(server), "L1", api_key_env="PROBE_KEY").problem == "/v1/models answered HTTP 401"
        monkeypatch.setenv("PROBE_KEY", "s3cret-key")
        assert probe(endpoint_of(server), "L1", api_key_env="PROBE_KEY").ready
        assert asyncio.run(probe_async(endpoint_of(server), "L1", api_key_env="PROBE_KEY")).ready
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("status", "payload", "expected"),
    [
        (200, {"choices": [{"index": 0, "message": {"content": "yes"}}]}, None),
        (200, {"choices": []}, "smoke generation answered without a choice"),
        (200, None, "smoke generation answered without a choice"),
        (500, {"error": {"message": "CUDA error"}}, "smoke generation answered HTTP 500: CUDA error"),
        (400, {"error": "bad template"}, "smoke generation answered HTTP 400: bad template"),
        (503, None, "smoke generation answered HTTP 503"),
    ],
)
def test_smoke_generation_needs_a_choice(status, payload, expected):
    assert smoke_problem(status, payload) == expected


def test_smoke_request_asks_one_greedy_token_of_the_served_name():
    body = smoke_request("L1")
    assert body["model"] == "L1" and body["max_tokens"] == 1 and body["temperature"] == 0.0
    assert body["stream"] is False and body["messages"][0]["role"] == "user"
    assert smoke_url("http://127.0.0.1:8011/v1/") == "http://127.0.0.1:8011/v1/chat/completions"


def test_a_server_that_lists_the_model_but_cannot_generate_is_not_ready():
    server = serve_in_thread("L1", broken_generation=True)
    try:
        expected = "smoke generation answered HTTP 500: CUDA error: no kernel image is available"
        assert probe(endpoint_of(server), "L1").problem == expected
        assert asyncio.run(probe_async(endpoint_of(server), "L1")).problem == expected
        # Liveness only (no generation) still passes: the two checks are distinct.
        assert probe(endpoint_of(server), "L1", smoke=False).ready
    finally:
        server.shutdown()


def test_the_smoke_generation_carries_the_key(monkeypatch):
    server = serve_in_thread("L1", key="s3cret-key")
    try:
        monkeypatch.setenv("PROBE_KEY", "s3cret-key")
        assert probe(endpoint_of(server), "L1", api_key_env="PROBE_KEY").ready
    finally:
        server.shutdown()


def _slow_generation_server(name: str, delay_s: float) -> ThreadingHTTPServer:
    """Healthy and listing `name`, but answering a generation only after `delay_s`."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"status": "ok"} if self.path == "/health" else {"data": [{"id": name}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(delay_s)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the probe stopped waiting
                self._send({"choices": [{"index": 0, "message": {"content": "yes"}}]})

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_both_probes_bound_the_smoke_generation_by_its_own_timeout():
    server = _slow_generation_server("L1", delay_s=1.0)
    try:
        for report in (
            probe(endpoint_of(server), "L1", timeout_s=5, smoke_timeout_s=0.2),
            asyncio.run(probe_async(endpoint_of(server), "L1", timeout_s=5, smoke_timeout_s=0.2)),
        ):
            assert report.problem == "smoke generation failed (ReadTimeout)"
        assert probe(endpoint_of(server), "L1", timeout_s=0.2, smoke_timeout_s=5).ready  # the status calls are quick
    finally:
        server.shutdown()


def test_both_probes_name_the_unreachable_health_endpoint():
    server = serve_in_thread("L1")
    server.shutdown()
    server.server_close()
    assert probe(endpoint_of(server), "L1", timeout_s=1).problem == "/health unreachable (ConnectError)"
    assert asyncio.run(probe_async(endpoint_of(server), "L1", timeout_s=1)).problem == (
        "/health unreachable (ConnectError)"
    )
