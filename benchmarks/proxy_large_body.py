"""Large request bodies vs everyone else: small-request latency through the proxy while big bodies are in flight.

Upstream (a small OpenAI-compatible server started by this script), proxy (`python -m mass_ops.runtime.proxy
--max-request-bytes LIMIT`), the client that times small chat completions, and a flooder that keeps sending one
large body after another each run in their own process. Three phases of sequential small requests (p50/p99):
no large body (the baseline); a body far over the limit in flight (100 MB: refused with 413 as its Content-Length
arrives, never read into memory); a body just under the limit in flight (read in chunks and parsed by the proxy's
body parser process, then forwarded). A JSON parse of the latter on the proxy's event loop would hold every other
request for its whole length (ISSUE #25.3: 4.3 s for 100 MB). Target: p99 < 50 ms in every phase.

    .venv/bin/python benchmarks/proxy_large_body.py [--limit-mb 32] [--over-mb 100] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.proxy_overhead import start_listening  # noqa: E402

TARGET_P99_MS = 50.0
SMALL = {"model": "bench", "max_tokens": 8, "messages": [{"role": "user", "content": "ping"}]}


async def _serve_upstream(port_file: Path) -> None:
    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        usage = {"prompt_tokens": len(body) // 4, "completion_tokens": 1, "total_tokens": len(body) // 4 + 1}
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage})

    app = web.Application(client_max_size=1 << 31)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port_file.write_text(str(runner.addresses[0][1]))
    await asyncio.Event().wait()


def _flood(url: str, size: int, ready: Path) -> None:
    """Send chat completions of `size` bytes one after another, forever (the parent kills this process)."""
    parts = urlsplit(url)
    body = b'{"model": "bench", "max_tokens": 8, "messages": [{"role": "user", "content": "'
    body += b"x" * max(0, size - len(body) - 4) + b'"}]}'
    sent = 0
    while True:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
        try:
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            status = connection.getresponse().status
        except OSError:
            status = 0  # a refused body's connection may be closed while it is still being sent
        finally:
            connection.close()
        sent += 1
        progress = ready.with_suffix(".tmp")
        progress.write_text(f"{sent} {status}\n")
        progress.replace(ready)  # atomic: the parent never reads a half-written line


async def _small_requests(url: str, count: int) -> tuple[list[float], set[int]]:
    """Seconds per small chat completion, one after another on a keep-alive connection, and the statuses seen."""
    samples, statuses = [], set()
    async with aiohttp.ClientSession() as client:
        for i in range(count + 10):
            started = time.perf_counter()
            async with client.post(f"{url}/v1/chat/completions", json=SMALL) as response:
                await response.read()
                statuses.add(response.status)
            if i >= 10:  # the first ones warm the connection and code paths
                samples.append(time.perf_counter() - started)
    return samples, statuses


@dataclass
class Phase:
    name: str
    samples: list[float]
    statuses: set[int]
    flood_sent: int = 0
    flood_status: str = ""

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.samples) * 1000

    @property
    def p99_ms(self) -> float:
        return statistics.quantiles(self.samples, n=100)[-1] * 1000


def run(limit: int, over: int, under: int, requests: int) -> list[Phase]:
    """The three phases against a proxy whose body limit is `limit` bytes."""
    with tempfile.TemporaryDirectory(prefix="proxy-large-body-") as tmp:
        work = Path(tmp)
        upstream, upstream_port = start_listening(
            [sys.executable, __file__, "--serve-upstream", str(work / "up")], work / "up"
        )
        proxy_argv = [sys.executable, "-m", "mass_ops.runtime.proxy", "--listen", "0", "--log", str(work / "api.jsonl")]
        proxy_argv += ["--upstream", f"http://127.0.0.1:{upstream_port}", "--port-file", str(work / "px")]
        proxy, proxy_port = start_listening([*proxy_argv, "--max-request-bytes", str(limit)], work / "px")
        url = f"http://127.0.0.1:{proxy_port}"
        phases = []
        try:
            phases.append(Phase("no large body", *asyncio.run(_small_requests(url, requests))))
            for name, size in (
                (f"{over / 1e6:.0f} MB body (over the limit)", over),
                (f"{under / 1e6:.1f} MB body (under the limit)", under),
            ):
                ready = work / f"flood-{size}"
                flooder = subprocess.Popen([sys.executable, __file__, "--flood", url, str(size), str(ready)])
                try:
                    while not ready.exists():  # one large body has gone through: the flood is under way
                        if flooder.poll() is not None:
                            raise RuntimeError("the flooder ended early")
                        time.sleep(0.01)
                    phase = Phase(name, *asyncio.run(_small_requests(url, requests)))
                    sent, status = ready.read_text().split()
                    phase.flood_sent, phase.flood_status = int(sent), status
                    phases.append(phase)
                finally:
                    flooder.kill()
                    flooder.wait(timeout=10)
        finally:
            for process in (proxy, upstream):
                process.terminate()
                process.wait(timeout=30)
    return phases


def report(phases: list[Phase], limit: int) -> str:
    base = phases[0]
    lines = [f"Small chat completions through the proxy (body limit {limit / 1e6:.1f} MB), sequential, keep-alive:"]
    for phase in phases:
        flood = f"; large bodies sent {phase.flood_sent}, last HTTP {phase.flood_status}" if phase.flood_sent else ""
        lines.append(
            f"  {phase.name:<34} p50 {phase.p50_ms:6.2f} ms  p99 {phase.p99_ms:6.2f} ms  "
            f"p99 ratio {phase.p99_ms / base.p99_ms:5.2f}  statuses {sorted(phase.statuses)}{flood}"
        )
    worst = max(phase.p99_ms for phase in phases)
    ok = worst < TARGET_P99_MS and all(phase.statuses == {200} for phase in phases)
    lines.append(
        f"verdict: worst p99 {worst:.2f} ms (target < {TARGET_P99_MS:.0f} ms) {'OK' if ok else 'ABOVE TARGET'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit-mb", type=float, default=32.0, help="the proxy's request body limit")
    parser.add_argument("--over-mb", type=float, default=100.0, help="size of the body over the limit")
    parser.add_argument("--requests", type=int, default=400, help="small requests per phase")
    parser.add_argument("--serve-upstream", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--flood", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_upstream:
        asyncio.run(_serve_upstream(args.serve_upstream))
        return
    if args.flood:
        _flood(args.flood[0], int(args.flood[1]), Path(args.flood[2]))
        return
    limit = int(args.limit_mb * 1024**2)
    phases = run(limit, int(args.over_mb * 1024**2), limit - 64 * 1024, args.requests)
    print(report(phases, limit))


if __name__ == "__main__":
    main()
