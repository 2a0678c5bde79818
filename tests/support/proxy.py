"""Helpers of the logging-proxy tests (tests/runtime/test_proxy*.py, test_session_proxy.py): reading a proxy log,
serving an aiohttp app on an ephemeral port, an echoing upstream, and a hostile agent's episode run through the real
runner and proxy against a metered upstream."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.budget_overshoot import MeteredUpstream
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from mass_ops.store.budgets import task_scope
from tests.runtime.hostile_agent import hostile_findings
from tests.support.runtime import TASK, hostile_prompt, open_episode_cycle, request, runner_environ

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-never-log-this-0123456789"  # an upstream key: no log, header or record may ever hold it


def records_by_seq(log: Path) -> list[dict[str, Any]]:
    """Log records in request order (they are appended when each exchange's record is ready, not by `seq`)."""
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return sorted(records, key=lambda record: record["seq"])


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """Serve `app` on an ephemeral local port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class EchoUpstream:
    """An upstream that reports what it received, redirects, streams behind a gate, and counts hits per path (on
    routes the proxy lets through: generation routes echo, `GET /v1/models/<name>` does the rest)."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.seen_headers: dict[str, str] = {}  # kept test-side: echoing a key back would put it in the log body
        self.gate = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/v1/completions", self._echo)
        app.router.add_post("/v1/chat/completions", self._echo)
        app.router.add_get("/v1/models/redirect", self._redirect)
        app.router.add_get("/elsewhere", self._echo)
        app.router.add_get("/v1/models/gated-stream", self._gated_stream)
        app.router.add_get("/v1/models/plain", self._plain)
        return app

    def _count(self, request: web.Request) -> None:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1

    async def _echo(self, request: web.Request) -> web.Response:
        self._count(request)
        body = await request.read()
        self.seen_headers = {k.lower(): v for k, v in request.headers.items()}
        return web.json_response(
            {
                "method": request.method,
                "path_qs": request.path_qs,
                "body_bytes": len(body),
                "body_head": body[:64].decode("utf-8", errors="replace"),
            },
            headers={"X-Request-Id": "req-42", "X-Upstream-Secret": SECRET},
        )

    async def _redirect(self, request: web.Request) -> web.Response:
        self._count(request)
        raise web.HTTPFound("/elsewhere")

    async def _plain(self, request: web.Request) -> web.Response:
        return web.Response(text="not json at all", content_type="text/plain")

    async def _gated_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first = {"id": "c1", "model": "m", "created": 1, "choices": [{"index": 0, "delta": {"content": "first"}}]}
        await response.write(f"data: {json.dumps(first)}\n\n".encode())
        await asyncio.wait_for(self.gate.wait(), timeout=10)  # released only after the client saw "first"
        last = {"id": "c1", "choices": [{"index": 0, "delta": {"content": " second"}, "finish_reason": "stop"}]}
        await response.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


@dataclass(frozen=True)
class HostileEpisode:
    """What one hostile agent's episode left: its report, what reached the upstream, and the platform's records."""

    findings: dict[str, Any]  # the one report the attack script made
    seen: list[tuple[str, str]]  # (method, path) of every request that reached the upstream
    served: int  # tokens the upstream generated
    task_tokens: int  # tokens the cycle's budget ledger counted for the task
    records: list[dict[str, Any]]  # the published API log


def run_hostile_episode(
    tmp_path: Path,
    install: QwenInstall,
    attack: str,
    *,
    server_default_tokens: int,
    endpoint_path: str = "/v1",
    **cycle_options: Any,
) -> HostileEpisode:
    """Run `attack` as the agent of one episode (real runner and proxy) against a `MeteredUpstream` serving under
    `endpoint_path`; `cycle_options` go to `open_episode_cycle` (budgets, inference, runtime limits)."""

    async def scenario() -> tuple[list[dict[str, Any]], list[tuple[str, str]], int, int, list[dict[str, Any]]]:
        async with MeteredUpstream(server_default_tokens=server_default_tokens, prefix=endpoint_path) as upstream:
            ctx = open_episode_cycle(tmp_path, upstream.url + endpoint_path, served_name="metered", **cycle_options)
            runner = EpisodeRunner(ctx, install=install, environ=runner_environ(), scratch_dir=tmp_path / "scratch")
            outcome = await runner.run_attempt(request(ctx, hostile_prompt(attack)), 1)
            unit = outcome.request.unit
            prefix = f"cycles/{unit.cycle}/episodes/{unit.slug}/a1"
            stream = ctx.artifacts.get_bytes(f"{prefix}/stream.jsonl").decode()
            log = gzip.decompress(ctx.artifacts.get_bytes(f"{prefix}/api_requests.jsonl.gz")).decode()
            spend = ctx.repo.budget_spend(ctx.cycle_id)
            counted = spend[task_scope(TASK)].tokens if task_scope(TASK) in spend else 0
            records = [json.loads(line) for line in log.splitlines()]
            return hostile_findings(stream), list(upstream.seen), upstream.served, counted, records

    findings, seen, served_tokens, counted, records = asyncio.run(scenario())
    assert len(findings) == 1 and "error" not in findings[0], findings
    return HostileEpisode(findings[0], seen, served_tokens, counted, records)
