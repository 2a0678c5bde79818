"""Search + collection concurrency: mass-ops against the sequential order of the reference driver.

Workload (paper-shaped by default): RHI for 9 tasks with 11 iterations (reference + v0..v11 episodes per task, a
baseline verdict per version, an arbitration per version after v0, a proposal per step but the last), then teacher
collection for the 8 training tasks × 18 candidates. Every LLM call goes to the scripted policy stand-in
(`tests.policy_server`, its own process) with a capacity of 8 concurrent completions and a fixed latency per
completion. The judge always prefers the version over the reference, so both runs do exactly the same work (every
step needs an arbitration: the upper end of the paper's workload).

Episodes come from the fake executor of the inner-loop tests (a stand-in for qwen-code): each episode makes
`--episode-turns` sequential chat requests to the same server — so episodes and judge calls share its capacity,
as on a real vLLM endpoint — and then publishes a three-file workspace and its row. Stores and scratch folders
live in /dev/shm when it exists.

- sequential baseline: tasks one after another, each task's steps in order, one episode at a time (the reference
  driver's order). It is the same mass-ops code (`search_task` per task, then `collect`) with an executor of capacity
  1, so every per-call cost saved speeds up both runs; its step 1 still judges v0 and v1 side by side, which only
  flatters the baseline.
- mass-ops: all tasks' chains at once (threads), episodes concurrent within the capacity, collection in one batch.

Prints both wall-clocks, the speedup (target ≥ 5×) and mass-ops' wall-clock over the critical-path lower bound
(the longer of the slowest task chain and total server time / capacity, for search and for collection). The bound
counts server time only: the stage code's own work per step (ledger and row writes, evidence; ~0.1–0.3 s on 2 busy
cores) is a large share of a step at the default latency (wall/bound 1.40 there), a small one at `--latency 0.16`
(1.06; the sequential baseline then takes about 3 minutes).

    .venv/bin/python benchmarks/search_concurrency.py [--tasks 9] [--iterations 11] [--candidates 18]
        [--latency 0.04] [--episode-turns 3] [--capacity 8]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mass_ops.config import CycleConfig, read_config_source, validate_config  # noqa: E402
from mass_ops.context import open_cycle  # noqa: E402
from mass_ops.llm import RetryPolicy  # noqa: E402
from mass_ops.llm.calls import open_client  # noqa: E402
from mass_ops.search import search_task, search_tasks  # noqa: E402
from mass_ops.stages.collect import collect_batch  # noqa: E402
from tests.inner_loop_fakes import FakeExecutor  # noqa: E402

MODEL = "bench-policy"
PAPER_TASKS = [51, 53, 56, 202, 205, 221, 302, 307, 324]
ORCHESTRATOR_SYSTEM = "You are Qwen Code, an interactive CLI agent. Work in the current directory."


def start_server(capacity: int, latency: float, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = work / "port"
    command = [
        sys.executable, "-m", "tests.policy_server", "--port", "0", "--port-file", str(port_file), "--model", MODEL,
        "--capacity", str(capacity), "--latency", str(latency), "--judge-winner", "B",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"policy server did not start: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{int(port_file.read_text())}"


def metadata_url(name: str, store: Path, args: argparse.Namespace) -> str:
    """A fresh database per run: a SQLite file (embedded default) or a new database on the Postgres server."""
    if args.metadata == "sqlite":
        return f"sqlite:///{store / 'metadata.db'}"
    import sqlalchemy as sa

    database = bench_database(name)
    admin = sa.create_engine(args.postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}"')
        connection.exec_driver_sql(f'CREATE DATABASE "{database}"')
    admin.dispose()
    return args.postgres_admin_url.rsplit("/", 1)[0] + f"/{database}"


def bench_database(name: str) -> str:
    return f"mass_bench_{name.replace('-', '_')}_{os.getpid()}"


def drop_databases(names: list[str], args: argparse.Namespace) -> None:
    """Drop the Postgres databases of this run's cycles (SQLite files go with the scratch folder)."""
    if args.metadata != "postgres":
        return
    import sqlalchemy as sa

    admin = sa.create_engine(args.postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        for name in names:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{bench_database(name)}"')
    admin.dispose()


def bench_config(name: str, endpoint: str, store: Path, args: argparse.Namespace) -> CycleConfig:
    data = read_config_source("paper")
    tasks = PAPER_TASKS[: args.tasks]
    train = [t for t in tasks if t != 221] or tasks
    data["name"] = name
    data["models"]["served_name"] = MODEL
    data["inference"].update(endpoint=f"{endpoint}/v1", max_concurrent_requests=args.capacity)
    data["tasks"].update(train_candidates=tasks, train=train, excluded=[t for t in tasks if t not in train])
    data["tasks"]["catalogue"] = "builtin"  # the paper preset leaves the choice to the user; the benchmark uses ours
    data["evaluation"]["tasks"] = None  # the rollout pool is not part of this benchmark
    data["search"]["iterations"] = args.iterations
    ranks = min(15, args.candidates - 1)  # keeps the config valid for small --candidates
    data["collection"].update(candidates=args.candidates, train_ranks=ranks, validation_rank=ranks + 1)
    data["storage"] = {"metadata_url": metadata_url(name, store, args), "artifact_url": str(store / "artifacts")}
    return validate_config(data)


class EpisodeTurns:
    """Makes each fake episode talk to the server like an agent: `turns` sequential chat completions.

    Plain `http.client` with one keep-alive connection per thread: the client's own CPU must not be what limits
    concurrency in a benchmark of scheduling.
    """

    def __init__(self, endpoint: str, turns: int) -> None:
        parts = urlsplit(endpoint)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.turns = turns
        self.requests = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = http.client.HTTPConnection(self.host, self.port, timeout=120)
        return connection

    def __call__(self, request: Any) -> None:
        for turn in range(self.turns):
            body = json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": ORCHESTRATOR_SYSTEM},
                        {"role": "user", "content": f"{request.unit.slug} turn {turn}"},
                    ],
                }
            )
            connection = self._connection()
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"policy server answered {response.status} to an episode turn")
        with self._lock:
            self.requests += self.turns


def compact_workspace(request: Any, task_text: str) -> dict[str, bytes]:
    """A three-file workspace: enough evidence for the judge, little tar/gzip work for the stand-in executor."""
    seed = request.unit.seed
    return {
        "research_report.md": f"# {request.condition}\n\n## Results\nSharpe {seed % 97 / 100:.2f}.\n".encode(),
        "results/metrics.json": json.dumps({"seed": seed, "sharpe": seed % 97 / 100}).encode(),
        "deliverables/index.json": b'[{"path": "research_report.md", "description": "report"}]',
    }


def run(config: CycleConfig, endpoint: str, args: argparse.Namespace, *, sequential: bool) -> dict[str, Any]:
    ctx = open_cycle(config)
    turns = EpisodeTurns(endpoint, args.episode_turns)
    executor = FakeExecutor(
        ctx, capacity=1 if sequential else args.capacity, on_episode=turns, workspace_files=compact_workspace
    )
    client = open_client(config, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1))
    try:
        cpu = time.process_time()
        started = time.perf_counter()
        if sequential:
            for task in config.tasks.train_candidates:
                search_task(ctx, executor, task, client=client)
        else:
            search_tasks(ctx, executor, client=client)
        searched = time.perf_counter()
        results = collect_batch(ctx, executor)
        finished = time.perf_counter()
    finally:
        client.close()
    calls = len(ctx.repo.llm_calls(ctx.cycle_id))
    arbitrations = len(ctx.repo.comparisons(ctx.cycle_id, "champion"))
    ctx.repo.store.dispose()  # so the run's database can be dropped
    return {
        "search_s": searched - started,
        "collect_s": finished - searched,
        "wall_s": finished - started,
        "cpu_s": time.process_time() - cpu,
        "episodes": len(executor.executed),
        "calls": calls,
        "arbitrations": arbitrations,
        "collected": sum(r.succeeded for r in results),
    }


def lower_bound(config: CycleConfig, args: argparse.Namespace) -> dict[str, float]:
    """Critical-path lower bound of the workload with unit latencies only (no overheads)."""
    call, episode = args.latency, args.latency * args.episode_turns
    versions = config.search.iterations + 1
    tasks = len(config.tasks.train_candidates)
    # One chain: step 0 = reference ∥ v0, then the v0→v1 proposal; step k ≥ 1 = episode, verdict (v0 ∥ v1 at k = 1),
    # arbitration, proposal (none at the last step).
    chain = episode + call + config.search.iterations * (episode + 3 * call) - call
    search_work = tasks * (versions + 1) * episode + tasks * (versions + 2 * config.search.iterations) * call
    search_bound = max(chain, search_work / args.capacity)
    episodes = len(config.tasks.train) * config.collection.candidates
    collect_bound = math.ceil(episodes / args.capacity) * episode
    return {"search": search_bound, "collect": collect_bound, "total": search_bound + collect_bound}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=9, help="RHI tasks (the paper's 9 train candidates)")
    parser.add_argument("--iterations", type=int, default=11)
    parser.add_argument("--candidates", type=int, default=18)
    parser.add_argument("--latency", type=float, default=0.04, help="seconds per completion (scaled down)")
    parser.add_argument("--episode-turns", type=int, default=3, help="completions per episode")
    parser.add_argument("--capacity", type=int, default=8, help="completions the server processes at once")
    parser.add_argument("--metadata", choices=["sqlite", "postgres"], default="sqlite", help="metadata database")
    parser.add_argument("--postgres-admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="mass-bench-", dir=shm if shm.is_dir() else None))
    tempfile.tempdir = str(base)  # scratch folders (workspaces, evidence) in memory too, like the stores
    server, endpoint = start_server(args.capacity, args.latency, base)
    try:
        concurrent_config = bench_config("bench-concurrent", endpoint, base / "concurrent", args)
        sequential_config = bench_config("bench-sequential", endpoint, base / "sequential", args)
        concurrent = run(concurrent_config, endpoint, args, sequential=False)
        sequential = run(sequential_config, endpoint, args, sequential=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
        drop_databases(["bench-concurrent", "bench-sequential"], args)
    bound = lower_bound(concurrent_config, args)
    for name, result in (("mass-ops", concurrent), ("sequential", sequential)):
        if (result["episodes"], result["calls"]) != (concurrent["episodes"], concurrent["calls"]):
            raise SystemExit(f"the two runs did different work: {json.dumps([concurrent, sequential])}")
        print(
            f"{name:>10}: {result['wall_s']:7.2f} s  (search {result['search_s']:.2f} s, collection "
            f"{result['collect_s']:.2f} s; {result['episodes']} episodes, {result['calls']} judge/optimizer calls, "
            f"{result['arbitrations']} arbitrations, {result['collected']} teacher episodes; "
            f"{result['cpu_s']:.1f} s CPU in this process)"
        )
    speedup = sequential["wall_s"] / concurrent["wall_s"]
    print(f"speedup of mass-ops over the reference order: {speedup:.2f}x (target >= 5x)")
    print(
        f"critical-path lower bound: {bound['total']:.2f} s (search {bound['search']:.2f} s, collection "
        f"{bound['collect']:.2f} s); mass-ops wall / bound = {concurrent['wall_s'] / bound['total']:.2f}"
    )


if __name__ == "__main__":
    main()
