"""Episode scheduling: speedup of the EpisodePool over sequential execution against a server of fixed capacity.

Setup: the policy stand-in server (tests/policy_server) with a fixed latency per completion and a capacity of C
concurrent completions (excess requests queue); a cycle on SQLite + a local artifact folder; N episodes.
Baseline: the same N episodes one after another (each to its committed row before the next starts), as the
reference release runs them. Measured: the pool with
capacity C. Printed: sequential time, pool time, speedup, efficiency = speedup / min(C, N) (goal ≥ 0.95), the
server's peak concurrency and the episodes' outcome counts.

What runs is the production path except the agent: the real `EpisodePool` (capacity, fairness, retries) and the real
`EpisodeRunner` for every episode — preflight `GET /models`, QWEN_HOME and settings.json, a logging proxy per episode,
the agent in its own process group under the wall-clock limit, classification, key redaction, gzip, publication of
all seven artifacts and the SQLite row. The agent process is the light stand-in (`tests/runtime/stand_in_agent.py`:
K streamed chat completions through the proxy, qwen-code's stream-json events) instead of qwen-code: a real
qwen-code spends seconds of CPU starting Node, so 32 of them on a 2-core machine would measure the CPU, not the
scheduling. `--agent qwen-code` runs the real thing (for machines with cores to spare; use fewer episodes).

    .venv/bin/python benchmarks/episode_concurrency.py [--episodes 32] [--capacity 8] [--latency 1.0] [--requests 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mass_ops.config import CycleConfig, read_config_source, validate_config  # noqa: E402
from mass_ops.context import CycleContext, open_cycle  # noqa: E402
from mass_ops.layout import EpisodeUnit, bare_condition  # noqa: E402
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest  # noqa: E402
from mass_ops.runtime.pool import EpisodePool  # noqa: E402
from mass_ops.runtime.qwen_install import QwenInstall, ensure_qwen_code  # noqa: E402
from mass_ops.runtime.runner import EpisodeRunner  # noqa: E402

MODEL = "bench-policy"
KEY_VAR = "MASS_BENCH_API_KEY"
STAND_IN_AGENT = REPO_ROOT / "tests" / "runtime" / "stand_in_agent.py"
TASKS = (51, 202)


def _config(root: Path, endpoint: str, capacity: int) -> CycleConfig:
    data = read_config_source("demo")
    data["name"] = f"bench-{root.name}"
    data["models"]["served_name"] = MODEL
    data["inference"].update(
        {
            "endpoint": endpoint,
            "api_key_env": KEY_VAR,
            "episode_max_output_tokens": 2048,
            "max_concurrent_requests": capacity,
        }
    )
    data["storage"] = {"metadata_url": f"sqlite:///{root / 'metadata.db'}", "artifact_url": str(root / "artifacts")}
    return validate_config(data)


def _batch(ctx: CycleContext, episodes: int, requests: int) -> list[EpisodeRequest]:
    prompt = f"Benchmark episode.\n@agent requests={requests}"
    return [
        EpisodeRequest(
            unit=EpisodeUnit(ctx.cycle_name, TASKS[i % len(TASKS)], "reference", 1000 + i),
            condition=bare_condition(TASKS[i % len(TASKS)]),
            prompt=prompt,
        )
        for i in range(episodes)
    ]


def _run(
    root: Path, endpoint: str, install: QwenInstall, capacity: int | None, episodes: int, requests: int
) -> tuple[float, list[EpisodeOutcome]]:
    """Run the episodes on a fresh cycle: one after another (capacity None) or through a pool of `capacity`."""
    ctx = open_cycle(_config(root, endpoint, capacity or 1))
    batch = _batch(ctx, episodes, requests)
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), KEY_VAR: "sk-bench-not-a-real-key-0000"}
    options = {"install": install, "environ": environ, "scratch_dir": root / "scratch"}
    started = time.perf_counter()
    if capacity is None:
        # The reference's way: each episode runs to its end (row committed) before the next one starts.
        runner = EpisodeRunner(ctx, **options)

        async def one_by_one() -> list[EpisodeOutcome]:
            return [await runner.run_attempt(request, 1) for request in batch]

        outcomes = asyncio.run(one_by_one())
    else:
        with EpisodePool(ctx, retry_backoff_s=0, **options) as pool:
            outcomes = pool.run(batch)
    return time.perf_counter() - started, outcomes


@contextlib.contextmanager
def _policy_server(root: Path, latency: float, capacity: int) -> Iterator[str]:
    """The stand-in model server in its own process (as a model server is), on an ephemeral port; yields its URL."""
    port_file = root / "server.port"
    command = [sys.executable, "-m", "tests.policy_server", "--port", "0", "--port-file", str(port_file)]
    command += ["--model", MODEL, "--latency", str(latency), "--capacity", str(capacity)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the policy stand-in server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{int(port_file.read_text())}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _peak(base_url: str) -> int:
    with urllib.request.urlopen(f"{base_url}/stats", timeout=10) as response:
        return int(json.load(response)["peak_active"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=8, help="server capacity C = pool capacity")
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per completion at the server")
    parser.add_argument("--requests", type=int, default=2, help="completions per episode")
    parser.add_argument("--agent", choices=["stand-in", "qwen-code"], default="stand-in")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    install = (
        ensure_qwen_code()
        if args.agent == "qwen-code"
        else QwenInstall(node_bin=Path(sys.executable), qwen_entry=STAND_IN_AGENT, version="stand-in")
    )
    results: dict[str, tuple[float, list[EpisodeOutcome], int]] = {}
    with tempfile.TemporaryDirectory(prefix="mass-bench-episodes-") as scratch:
        for name, capacity in (("sequential", None), ("pool", args.capacity)):
            root = Path(scratch) / name
            root.mkdir()
            with _policy_server(root, args.latency, args.capacity) as base_url:
                elapsed, outcomes = _run(root, f"{base_url}/v1", install, capacity, args.episodes, args.requests)
                results[name] = (elapsed, outcomes, _peak(base_url))

    (sequential, seq_outcomes, seq_peak), (pooled, pool_outcomes, pool_peak) = results["sequential"], results["pool"]
    ideal = min(args.capacity, args.episodes)
    speedup = sequential / pooled
    efficiency = speedup / ideal
    verdict = "met" if efficiency >= 0.95 else "NOT met"
    # Where the gap to the ideal comes from: slots left idle by the scheduler, or episodes running slower side by
    # side (CPU contention of the agent processes on this machine).
    in_slot = sum(
        o.status_record["durations"]["setup_s"] + o.status_record["durations"]["agent_s"] for o in pool_outcomes
    )
    utilisation = in_slot / (args.capacity * pooled)
    print(
        f"episodes={args.episodes} capacity={args.capacity} latency={args.latency}s "
        f"requests/episode={args.requests} agent={args.agent} cpus={os.cpu_count()}"
    )
    for label, elapsed, outcomes, peak in (
        ("sequential (one by one)", sequential, seq_outcomes, seq_peak),
        (f"pool (capacity {args.capacity})", pooled, pool_outcomes, pool_peak),
    ):
        counts = dict(collections.Counter(o.status for o in outcomes))
        print(
            f"{label:<24} {elapsed:7.2f} s  mean agent time {_mean(outcomes, 'agent_s'):.2f} s  setup "
            f"{_mean(outcomes, 'setup_s') * 1000:.0f} ms  server peak {peak}  {counts}"
        )
    print(f"speedup: {speedup:.2f}x (ideal {ideal}x); pool slot utilisation {utilisation:.2f}")
    print(f"efficiency = speedup / min(C, episodes) = {efficiency:.2f} (goal, ISSUE #17: >= 0.95: {verdict})")


def _mean(outcomes: list[EpisodeOutcome], phase: str) -> float:
    """Mean seconds of `phase` (setup_s: attempt folder, proxy and settings before the agent; agent_s) per episode."""
    return sum(o.status_record["durations"][phase] for o in outcomes) / len(outcomes)


if __name__ == "__main__":
    main()
