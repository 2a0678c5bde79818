"""Per-episode cost of the local agent sandbox (issue #25.7): the same attempt with and without bubblewrap.

Setup: the policy stand-in server in this process (no added latency), a cycle on SQLite + a local artifact folder,
the light stand-in agent (tests/runtime/stand_in_agent.py) making R streamed completions through the episode proxy.
Baseline: the attempt unsandboxed (`runtime.sandbox: none`, `runtime.allow_unsandboxed_agent: true`: the agent is a
plain child process and its proxy listens on host TCP). Measured: the attempt in its bwrap sandbox — namespaces and
mounts, the bridge's Python start-up inside, the extra relay hop to the proxy's Unix socket. Runs alternate between
the two after one warm-up attempt of each. Printed per mode: the median agent time (process start to exit) and the
median whole attempt (folder, proxy, agent, publication, row); then the added milliseconds per episode and the ratio.

    .venv/bin/python benchmarks/sandbox_start.py [--runs 5] [--requests 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mass_ops.compute.sandbox import bwrap_support  # noqa: E402
from mass_ops.config import read_config_source, validate_config  # noqa: E402
from mass_ops.context import CycleContext, open_cycle  # noqa: E402
from mass_ops.layout import EpisodeUnit, bare_condition  # noqa: E402
from mass_ops.runtime.episode import EpisodeRequest  # noqa: E402
from mass_ops.runtime.qwen_install import QwenInstall  # noqa: E402
from mass_ops.runtime.runner import EpisodeRunner  # noqa: E402
from tests.policy_server import EventLoopThread, PolicyServer, PolicyServerConfig  # noqa: E402

MODEL = "bench-policy"
KEY_VAR = "MASS_BENCH_API_KEY"
STAND_IN_AGENT = REPO_ROOT / "tests" / "runtime" / "stand_in_agent.py"
MODES = {
    "unsandboxed": {"sandbox": "none", "allow_unsandboxed_agent": True},
    "bwrap sandbox": {"sandbox": "bwrap"},
}


def _context(root: Path, endpoint: str, runtime: dict[str, object]) -> CycleContext:
    data = read_config_source("demo")
    data["name"] = f"bench-sandbox-{root.name}"
    data["models"]["served_name"] = MODEL
    data["inference"].update({"endpoint": endpoint, "api_key_env": KEY_VAR, "episode_max_output_tokens": 256})
    data["runtime"] = {**data.get("runtime", {}), **runtime}
    data["storage"] = {"metadata_url": f"sqlite:///{root / 'metadata.db'}", "artifact_url": str(root / "artifacts")}
    return open_cycle(validate_config(data))


def _attempt(runner: EpisodeRunner, ctx: CycleContext, seed: int, requests: int) -> tuple[float, float]:
    """(agent seconds, whole attempt seconds) of one attempt of a fresh unit."""
    request = EpisodeRequest(
        unit=EpisodeUnit(ctx.cycle_name, 51, "reference", seed),
        condition=bare_condition(51),
        prompt=f"Benchmark episode.\n@agent requests={requests}",
    )
    started = time.perf_counter()
    outcome = asyncio.run(runner.run_attempt(request, 1))
    elapsed = time.perf_counter() - started
    if outcome.status != "succeeded":
        raise SystemExit(f"sandbox_start: an attempt ended {outcome.status}: {outcome.status_record['failure']}")
    return outcome.status_record["durations"]["agent_s"], elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="measured attempts per mode")
    parser.add_argument("--requests", type=int, default=1, help="completions per episode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    support = bwrap_support()
    if not support.available:
        raise SystemExit(f"sandbox_start: no sandbox to measure: {support.reason}")

    install = QwenInstall(node_bin=Path(sys.executable), qwen_entry=STAND_IN_AGENT, version="stand-in")
    environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", KEY_VAR: "sk-bench-not-a-real-key-0000"}
    timings: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="mass-bench-sandbox-") as scratch, EventLoopThread() as loop:
        server = PolicyServer(PolicyServerConfig(models=(MODEL,)))
        loop.run(server.start())
        try:
            runners = {}
            for index, (mode, runtime) in enumerate(MODES.items()):
                root = Path(scratch) / f"mode{index}"
                root.mkdir()
                ctx = _context(root, f"{server.base_url}/v1", runtime)
                runner = EpisodeRunner(ctx, install=install, environ=environ, scratch_dir=root / "scratch")
                _attempt(runner, ctx, 0, args.requests)  # warm-up: imports, caches, the first SQLite writes
                runners[mode] = (runner, ctx)
            for run in range(1, args.runs + 1):
                for mode, (runner, ctx) in runners.items():
                    timings[mode].append(_attempt(runner, ctx, run, args.requests))
        finally:
            loop.run(server.stop())

    medians = {
        mode: (statistics.median(a for a, _ in runs), statistics.median(t for _, t in runs))
        for mode, runs in timings.items()
    }
    print(f"runs per mode={args.runs} requests/episode={args.requests} bwrap={support.bwrap}")
    for mode, (agent_s, total_s) in medians.items():
        print(f"{mode:<14} median agent {agent_s * 1000:7.1f} ms  median attempt {total_s * 1000:7.1f} ms")
    (base_agent, base_total), (box_agent, box_total) = medians["unsandboxed"], medians["bwrap sandbox"]
    print(
        f"sandbox adds {(box_agent - base_agent) * 1000:.1f} ms per episode to the agent "
        f"(ratio {box_agent / base_agent:.2f}x) and {(box_total - base_total) * 1000:.1f} ms to the whole attempt "
        f"(ratio {box_total / base_total:.2f}x)"
    )


if __name__ == "__main__":
    main()
