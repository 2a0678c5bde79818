"""Cycle simulator (ISSUE #17.1): a paper-scale inner loop through the real stage code, three schedules compared.

Workload: RHI for 9 tasks × 12 versions (reference + v0..v11 episodes per task), teacher collection of 18 candidates
for the 8 training tasks, a ring tournament of 54 matches per training task. Every judge and optimizer call is a real
call of the stage code to the scripted OpenAI-compatible stand-in (`tests.policy_server`) whose capacity is C
requests at once; episodes are a stand-in runner behind the real `EpisodePool` that spends the episode's drawn length
on the server as back-to-back turns (at most `--turn` seconds each, every turn queueing for a slot again: an agent
talks to the server turn by turn, so a judge call queues behind a turn, not behind a whole episode), then publishes a
small workspace and its row. The server runs in its own process, as the model server is another machine in
production (in this process its request handling would take the interpreter lock from the stage code it serves); it
also plays an episode's turns, from one request per episode: a real agent is a process of its own too, and a turn
loop in this process would leave the slot idle between turns while it waits for the interpreter lock (~80 ms per
episode measured on 2 cores).

Episode lengths are heavy-tailed and seeded per unit (the same unit has the same length in every schedule):
log-normal with median `--median` seconds and shape `--sigma` (0.6: the 90th percentile is about 2.2× the median),
and with probability `--tail-share` an episode takes `--tail-factor` (10×) its drawn length — an agent that kept
going until its limits. Judge and optimizer calls take `--judge` and `--optimizer` seconds of a slot. The defaults
are a paper cycle (episodes ~20 min, judge calls ~1.5 min, proposals ~3 min) time-scaled by about 1/2400.

What time scaling does not shrink: the stage code's own work per unit (ledger and row writes, evidence bundles,
workspace tarballs: ~0.15 s per search step on 2 idle cores, more when 9 chains share them) is milliseconds against
minutes in production but a sizeable share of a scaled step; it is not in the bound, so wall/bound includes it, and a
larger scale (`--median 1 --judge 0.08 --optimizer 0.16`) shows the schedule with less of it. The ranking's bootstrap
intervals (CPU only, no server work: ~0.4 s per task since they are fitted for all resamples at once, 3.5–7 s
before; `benchmarks/ranking_bootstrap.py`) are left out by default (`--bootstrap-samples 0`; their cost is printed):
at this scale even 0.4 s stands for about a quarter of an hour of simulated time.

Schedules:
- reference: the reference release's sequential order — tasks one after another, each version in order, one episode
  or call at a time (capacity 1 everywhere), then collection, then ranking, one match at a time;
- today: the DAG's order before pipelining — all searches at once, a barrier, every collection in one batch, a
  barrier, every task's ranking at once;
- pipelined: `stages.inner_loop` — each task's collection as soon as its own search is done, its ranking as soon as
  its own collection is.

Printed per schedule: wall-clock; utilisation = busy slot-seconds of the server / (C × the time from the first
request to the last answer); wall / bound, where bound = max(longest dependency chain of a task, total server work / C)
computed from the drawn lengths (server time only). The chain assumes a task's longest collection candidate starts as
soon as its search ends, which a scheduler that does not know episode lengths in advance cannot promise when many
tasks collect at once: one 10× candidate that starts mid-phase leaves the server idle in the tail. Then the mean wait
for server slots per kind, the ratios pipelined/today and pipelined/reference, whether the goals (pipelined
utilisation ≥ 0.9, wall/bound ≤ 1.1 at C = 8) are met, and with `--timeline` the server's busy slots over the run
and each task's phase ends (pipelined).

The server takes waiting requests first come, first served, or with `--scheduling-policy priority` as vLLM's priority
scheduling does (lowest `priority` first; the stage code then sends `critical_path.server_priority`, and the stand-in
runner stamps each episode's as its proxy would). `--pool-capacity N` lets N episodes run at once against C server
slots, as in the DAG, where every task's collection instance has its own pool beside the search steps: the server
then queues the excess, which is where its order matters.

Per seed it also prints the ideal list schedule of the same draw (`schedule_model.py`: the bound's dependencies, no
overhead at all), once not knowing episode lengths (random candidate orders: median and spread) and once knowing them
(longest candidate first). The measured pipelined figures over the ideal's are what the platform's own work costs;
the ideal's over the bound are what not knowing lengths costs, which no scheduler of this kind can win back. The
pipelined run also prints the ideal in the order its pool actually started the candidates, so that the platform's
cost is measured without the luck of the order. `--model-draws N` runs only the model, on N draws and four candidate
orders, and prints how often the goal is within reach at all.

    .venv/bin/python benchmarks/cycle_sim.py [--capacity 8] [--median 0.5] [--schedules reference,today,pipelined]
        [--seeds 17[,1,2,3]] [--timeline] [--model-draws 300] [--scheduling-policy priority] [--pool-capacity 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import math
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aiohttp import web

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.schedule_model import Calls, IdealFigures, ModelRun, ideal  # noqa: E402
from benchmarks.schedule_model import schedule as ideal_schedule  # noqa: E402
from mass_ops.config import CycleConfig, read_config_source, validate_config  # noqa: E402
from mass_ops.context import CycleContext, open_cycle  # noqa: E402
from mass_ops.critical_path import episode_server_priority  # noqa: E402
from mass_ops.llm import RetryPolicy  # noqa: E402
from mass_ops.llm.calls import open_client  # noqa: E402
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest  # noqa: E402
from mass_ops.runtime.pool import EpisodePool  # noqa: E402
from mass_ops.search.driver import search_task, search_tasks  # noqa: E402
from mass_ops.stages.collect import collect_batch  # noqa: E402
from mass_ops.stages.inner_loop import run_inner_loop  # noqa: E402
from mass_ops.stages.rank import rank_tasks  # noqa: E402
from tests.inner_loop_fakes import FailurePlan, FakeExecutor, ScriptedPolicy  # noqa: E402
from tests.policy_server import (  # noqa: E402
    EventLoopThread,
    PolicyServer,
    PolicyServerConfig,
    RequestKind,
    classify_request,
)

MODEL = "sim-policy"
PAPER_TASKS = [51, 53, 56, 202, 205, 221, 302, 307, 324]
HOLD = "@hold "  # an episode's request: "@hold <seconds>"
SCHEDULES = ("reference", "today", "pipelined")


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Seeded episode lengths and call latencies (seconds of one server slot)."""

    median: float
    sigma: float
    tail_share: float
    tail_factor: float
    judge: float
    optimizer: float
    seed: int

    def episode(self, slug: str) -> float:
        draw = random.Random(int.from_bytes(hashlib.sha256(f"{self.seed}:{slug}".encode()).digest()[:8], "big"))
        length = draw.lognormvariate(math.log(self.median), self.sigma)
        return length * self.tail_factor if draw.random() < self.tail_share else length


class TimedServer(PolicyServer):
    """The stand-in with one capacity of C slots shared by episodes and calls, per-request hold times and busy-time
    accounting. (It wraps the stand-in's chat handler: the answers are the stand-in's, the timing is ours.)"""

    def __init__(self, capacity: int, lengths: Lengths, policy: ScriptedPolicy) -> None:
        super().__init__(PolicyServerConfig(models=(MODEL,)), policy)
        self.capacity = capacity
        self.lengths = lengths
        self._gate: asyncio.Semaphore | None = None
        self.reset()

    def reset(self) -> None:
        self.busy_s = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.work = {"episode": 0.0, "judge": 0.0, "optimizer": 0.0}
        self.counts = {"episode": 0, "judge": 0, "optimizer": 0}
        self.waited = {"episode": 0.0, "judge": 0.0, "optimizer": 0.0}  # seconds queued for a slot
        self.busy: list[tuple[float, float]] = []  # (start, end) of every held slot, for the busy-slot profile

    def figures(self) -> dict[str, Any]:
        """Busy slot-seconds, first request and last answer (this process's perf_counter), work and counts."""
        return {
            "busy_s": self.busy_s,
            "first": self.first,
            "last": self.last,
            "work": dict(self.work),
            "counts": dict(self.counts),
            "waited": dict(self.waited),
            "busy": list(self.busy),
        }

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()  # aiohttp keeps the body: the stand-in's handler reads it again
        text = str((body.get("messages") or [{}])[-1].get("content", ""))
        priority = body.get("priority", 0)  # vLLM's default when a request names none
        if text.startswith(HOLD):  # "@hold <seconds> <turns>": an episode, played turn by turn
            seconds, turns = text.removeprefix(HOLD).split()
            for _ in range(int(turns)):
                await self._hold("episode", float(seconds) / int(turns), priority)
            self.counts["episode"] += 1
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "done"}}]})
        kind = "optimizer" if classify_request(body) is RequestKind.OPTIMIZER else "judge"
        await self._hold(kind, self.lengths.optimizer if kind == "optimizer" else self.lengths.judge, priority)
        self.counts[kind] += 1
        return await super()._chat(request)

    async def _hold(self, kind: str, seconds: float, priority: int) -> None:
        """Wait for a slot (lowest priority first, then first come, first served), then keep it `seconds`."""
        if self._gate is None:
            self._gate = PrioritySlots(self.capacity)
        arrived = time.perf_counter()
        await self._gate.acquire(priority)
        started = time.perf_counter()
        self.waited[kind] += started - arrived
        self.first = started if self.first is None else self.first
        try:
            await asyncio.sleep(seconds)
        finally:
            self._gate.release()
            ended = time.perf_counter()
            self.busy_s += ended - started
            self.busy.append((started, ended))
            self.last = max(self.last, ended)
            self.work[kind] += seconds


class PrioritySlots:
    """C slots whose waiting requests are served lowest `priority` first, arrival order among equals: vLLM's waiting
    queue under `--scheduling-policy priority` (a request without the field has priority 0, so with no priorities
    sent this is first come, first served). Like vLLM at its `--max-num-seqs`, a running request is never preempted
    for a more urgent one."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.free and not self._waiting:
            self.free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), granted))
        await granted  # the slot is handed over by `release`, never freed in between

    def release(self) -> None:
        if self._waiting:
            heapq.heappop(self._waiting)[2].set_result(None)
        else:
            self.free += 1


def serve(capacity: int, lengths: Lengths, commands: Connection) -> None:
    """The timed stand-in in its own process (the model server is another machine in production, and in this
    process its request handling would take the interpreter lock from the stage code it serves). Answers
    `commands`: "reset" (between schedules), "figures" (a dict, times relative to `time.time()`), "stop"."""
    logging.basicConfig(level=logging.ERROR)
    policy = ScriptedPolicy()
    policy.judge_winner = lambda request: "B"  # the version always wins: every step arbitrates (fixed work)
    with EventLoopThread() as loop:
        server = TimedServer(capacity, lengths, policy)
        loop.run(server.start())
        commands.send(server.base_url)
        try:
            while (command := commands.recv()) != "stop":
                if command == "reset":
                    loop.run(_call(server.reset))
                    commands.send(None)
                elif command == "figures":
                    figures = loop.run(_call(server.figures))
                    # perf_counter is per process: hand over wall-clock times
                    offset = time.time() - time.perf_counter()
                    for name in ("first", "last"):
                        if figures[name] is not None:
                            figures[name] += offset
                    figures["busy"] = [(start + offset, end + offset) for start, end in figures["busy"]]
                    commands.send(figures)
        finally:
            loop.run(server.stop())


async def _call(function: Any) -> Any:
    return function()


class ServerProcess:
    """Starts `serve` in a child process; `base_url`, `reset()`, `figures()`, and `close()`."""

    def __init__(self, capacity: int, lengths: Lengths) -> None:
        context = multiprocessing.get_context("spawn")
        self._commands, child = context.Pipe()
        self._process = context.Process(target=serve, args=(capacity, lengths, child), name="sim-server", daemon=True)
        self._process.start()
        if not self._commands.poll(120):
            self._process.kill()
            raise SystemExit("cycle_sim: the server process did not start within 120 s")
        self.base_url: str = self._commands.recv()

    def _ask(self, command: str) -> Any:
        self._commands.send(command)
        return self._commands.recv()

    def reset(self) -> None:
        self._ask("reset")

    def figures(self) -> dict[str, Any]:
        return self._ask("figures")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._commands.send("stop")
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


class SimRunner:
    """`AttemptRunner` of the pool: holds a server slot for the unit's drawn length, then records the episode (a
    small workspace and its row, through the inner-loop tests' fake executor)."""

    def __init__(self, ctx: CycleContext, endpoint: str, lengths: Lengths, turn: float) -> None:
        self.endpoint = endpoint
        self.config = ctx.config
        self.lengths = lengths
        self.turn = turn
        self.recorder = FakeExecutor(ctx, workspace_files=small_workspace)
        self.candidate_order: list[tuple[int, int]] = []  # (task, candidate) in the order the pool started them

    async def preflight(self) -> None:
        return None

    async def run_attempt(
        self, request: EpisodeRequest, attempt: int, *, retry_of_id: int | None = None, on_agent_exit: Any = None
    ) -> EpisodeOutcome:
        if request.unit.candidate is not None:
            self.candidate_order.append((request.unit.task_id, request.unit.candidate))
        unit = request.unit
        # What the episode's proxy stamps on each of the agent's requests when the server schedules by priority.
        priority = episode_server_priority(self.config, unit.kind, unit.version)
        await asyncio.to_thread(self._hold, self.lengths.episode(unit.slug), priority)
        if on_agent_exit is not None:
            on_agent_exit()  # publishing does not load the server
        row = await asyncio.to_thread(self.recorder._execute, request, attempt, FailurePlan(), None)
        return self.recorder._outcome(request, row, reused=False)

    def _hold(self, seconds: float, priority: int | None) -> None:
        """The episode's server time: one request, played by the server as turns of at most `turn` seconds."""
        turns = max(1, math.ceil(seconds / self.turn - 1e-9))
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{HOLD}{seconds:.6f} {turns}"}],
        }
        if priority is not None:
            body["priority"] = priority
        post = urllib.request.Request(
            f"{self.endpoint}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=600) as answer:
            answer.read()


def small_workspace(request: EpisodeRequest, task_text: str) -> dict[str, bytes]:
    seed = request.unit.seed
    return {
        "research_report.md": f"# {request.condition}\n\n## Results\nSharpe {seed % 97 / 100:.2f}.\n".encode(),
        "results/metrics.json": json.dumps({"seed": seed, "sharpe": seed % 97 / 100}).encode(),
        "deliverables/index.json": b'[{"path": "research_report.md", "description": "report"}]',
    }


def sim_config(name: str, endpoint: str, store: Path, capacity: int, args: argparse.Namespace) -> CycleConfig:
    data = read_config_source("paper")
    tasks = PAPER_TASKS[: args.tasks]
    train = [t for t in tasks if t != 221] or tasks
    data["name"] = name
    data["models"]["served_name"] = MODEL
    data["inference"].update(endpoint=endpoint, max_concurrent_requests=capacity)
    data["inference"]["server"]["scheduling_policy"] = args.scheduling_policy
    data["tasks"].update(train_candidates=tasks, train=train, excluded=[t for t in tasks if t not in train])
    data["tasks"]["catalogue"] = "builtin"  # mass-ops' own tasks with the paper's settings
    data["evaluation"]["tasks"] = None
    data["search"]["iterations"] = args.iterations
    if args.candidates is not None:  # fewer candidates than the paper's: the training ranks shrink to fit
        train_ranks = min(data["collection"]["train_ranks"], args.candidates - 1)
        data["collection"].update(candidates=args.candidates, train_ranks=train_ranks, validation_rank=train_ranks + 1)
    if args.opponents is not None:
        data["ranking"]["opponents_per_episode"] = args.opponents
    data["ranking"]["bootstrap_samples"] = args.bootstrap_samples
    data["storage"] = {"metadata_url": f"sqlite:///{store / 'metadata.db'}", "artifact_url": str(store / "artifacts")}
    return validate_config(data)


def run_schedule(
    schedule: str, server: ServerProcess, lengths: Lengths, base: Path, args: argparse.Namespace
) -> dict[str, Any]:
    capacity = 1 if schedule == "reference" else args.capacity
    config = sim_config(f"sim-{schedule}", f"{server.base_url}/v1", base / schedule, capacity, args)
    ctx = open_cycle(config)
    client = open_client(config, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1))
    runner = SimRunner(ctx, f"{server.base_url}/v1", lengths, args.turn or args.median / 8)
    # Episodes in flight may exceed the server's capacity (`--pool-capacity`), as in the DAG, where every task's
    # collection instance runs its own pool beside the search steps: the server then queues the excess.
    pool_capacity = 1 if schedule == "reference" else args.pool_capacity or args.capacity
    pool = EpisodePool(ctx, runner=runner, capacity=pool_capacity)
    server.reset()
    phases: list[tuple[float, int, str, str]] = []  # (seconds since start, task, phase, started | finished)
    started = time.time()
    try:
        if schedule == "reference":
            for task in config.tasks.train_candidates:
                search_task(ctx, pool, task, client=client)
            collect_batch(ctx, pool)
            rank_tasks(ctx, client=client)
        elif schedule == "today":
            search_tasks(ctx, pool, client=client)
            collect_batch(ctx, pool)
            train = list(config.tasks.train)
            with ThreadPoolExecutor(max_workers=len(train)) as ranking:  # the DAG's mapped rank_task instances
                list(ranking.map(lambda task: rank_tasks(ctx, [task], client=client), train))
        else:
            run_inner_loop(ctx, pool, client=client, on_phase=lambda phase, task, state: phases.append(
                (time.time() - started, task, phase, state)
            ))  # fmt: skip
        wall = time.time() - started
    finally:
        pool.close()
        client.close()
    served = server.figures()
    active = served["last"] - (served["first"] or started)
    return {
        "wall_s": wall,
        "utilisation": served["busy_s"] / (args.capacity * active) if active > 0 else 0.0,
        "work_s": sum(served["work"].values()),
        "counts": served["counts"],
        "waited": served["waited"],
        "episodes": len(ctx.repo.episodes(ctx.cycle_id)),
        "phases": phases,
        "profile": busy_profile(served["busy"], started, started + wall),
        "candidate_order": runner.candidate_order,
    }


def busy_profile(busy: list[tuple[float, float]], start: float, end: float, bins: int = 20) -> list[float]:
    """Mean busy slots of the server in each of `bins` equal slices of [start, end]: where the schedule idles."""
    width = (end - start) / bins
    if width <= 0:
        return []
    slots = [0.0] * bins
    for held_from, held_to in busy:
        for index in range(max(0, int((held_from - start) / width)), min(bins, int((held_to - start) / width) + 1)):
            low, high = start + index * width, start + (index + 1) * width
            slots[index] += max(0.0, min(held_to, high) - max(held_from, low))
    return [held / width for held in slots]


def lower_bound(config: CycleConfig, lengths: Lengths, work_s: float, capacity: int) -> dict[str, float]:
    """max(longest chain of a task, server work / C). A task's chain: reference ∥ v0, the v0→v1 proposal; per
    later version its episode, a verdict, an arbitration and (but the last) a proposal; for a training task then
    its slowest candidate and its matches, C at a time."""
    judge, optimizer = lengths.judge, lengths.optimizer
    matches = tournament_matches(config)
    drawn = drawn_lengths(config, lengths)
    chains = []
    for search, collection in drawn.values():
        chain = max(search[0], search[1]) + optimizer
        chain += sum(search[2:]) + (config.search.iterations) * (2 * judge + optimizer) - optimizer
        if collection:
            chain += max(collection) + math.ceil(matches / capacity) * judge
        chains.append(chain)
    return {"chain": max(chains), "work": work_s / capacity, "bound": max(max(chains), work_s / capacity)}


def tournament_matches(config: CycleConfig) -> int:
    """Ranking matches per training task: each candidate meets `opponents_per_episode` others."""
    return math.ceil(config.collection.candidates * config.ranking.opponents_per_episode / 2)


def drawn_lengths(config: CycleConfig, lengths: Lengths) -> dict[int, tuple[list[float], list[float]]]:
    """Drawn lengths per task: search episodes (reference, v0, v1…) and collection candidates."""
    from mass_ops.layout import EpisodeUnit
    from mass_ops.seeds import collection_seed, reference_episode_seed, version_episode_seed

    out = {}
    for task in config.tasks.train_candidates:
        search = [
            lengths.episode(
                EpisodeUnit("x", task, "reference", reference_episode_seed(config.search.seed_base, task)).slug
            )
        ]
        for version in range(config.search.iterations + 1):
            seed = version_episode_seed(config.search.seed_base, task, version)
            search.append(lengths.episode(EpisodeUnit("x", task, "search", seed, version=version).slug))
        collection = []
        if task in config.tasks.train:
            for candidate in range(config.collection.candidates):
                seed = collection_seed(config.collection.seed_base, task, candidate)
                unit = EpisodeUnit("x", task, "collection", seed, candidate=candidate)
                collection.append(lengths.episode(unit.slug))
        out[task] = (search, collection)
    return out


def bootstrap_cost(config: CycleConfig) -> float:
    """Seconds one task's bootstrap intervals take here at the paper's 1000 resamples (its tournament's size)."""
    from mass_ops.ranking import MatchResult, bootstrap_intervals, tournament_pairs

    names = [f"c{i}" for i in range(config.collection.candidates)]
    pairs = tournament_pairs(names, config.ranking.opponents_per_episode, seed=1)
    draw = random.Random(1)
    matches = [MatchResult(a, b, draw.choice([a, b, None])) for a, b in pairs]
    started = time.perf_counter()
    bootstrap_intervals(names, matches, 1000, seed=1)
    return time.perf_counter() - started


def print_timeline(
    phases: list[tuple[float, int, str, str]], drawn: dict[int, tuple[list[float], list[float]]], lengths: Lengths
) -> None:
    """Per task of the pipelined order: when each phase ended, beside the server time its chain needs."""
    ended = {(task, phase): at for at, task, phase, state in phases if state == "finished"}
    print("pipelined timeline (s since start: phase ended | drawn server time of the phase on the chain):")
    for task, (search, collection) in drawn.items():
        cells = [f"search {ended.get((task, 'search'), float('nan')):6.2f} | {sum(search):5.2f}"]
        if collection:
            cells.append(f"collection {ended.get((task, 'collection'), float('nan')):6.2f} | {max(collection):5.2f}")
            cells.append(f"ranking {ended.get((task, 'ranking'), float('nan')):6.2f}")
        print(f"  task {task:>3}: " + "   ".join(cells))


def report(
    results: dict[str, dict[str, Any]], config: CycleConfig, lengths: Lengths, args: argparse.Namespace
) -> IdealFigures:
    """Print one seed's figures per schedule (module docstring), set each result's `wall_over_bound`, and return the
    ideal list schedule's figures on the same draw (`schedule_model`)."""
    print(
        f"C = {args.capacity}; episodes log-normal median {args.median} s, sigma {args.sigma}, {args.tail_share:.0%} "
        f"at {args.tail_factor:g}×; judge {args.judge} s, optimizer {args.optimizer} s; seed {lengths.seed}; "
        f"server scheduling {args.scheduling_policy}"
    )
    for schedule, result in results.items():
        bound = lower_bound(config, lengths, result["work_s"], args.capacity)
        result["wall_over_bound"] = result["wall_s"] / bound["bound"]
        print(
            f"{schedule:>10}: wall {result['wall_s']:7.2f} s  utilisation {result['utilisation']:.2f}  "
            f"wall/bound {result['wall_over_bound']:.2f}  (bound {bound['bound']:.2f} s = max(chain "
            f"{bound['chain']:.2f} s, work/C {bound['work']:.2f} s); {result['episodes']} episodes, "
            f"{result['counts']['judge']} judge and {result['counts']['optimizer']} optimizer calls)"
        )
    for schedule, result in results.items():
        waits = ", ".join(
            f"{kind} {result['waited'][kind] / max(1, result['counts'][kind]) * 1000:.0f} ms"
            for kind in result["waited"]
        )
        print(f"{schedule:>10}: mean wait for server slots per episode (all its turns) and per call: {waits}")
    if args.timeline:
        for schedule, result in results.items():
            cells = " ".join(f"{slots:.1f}" for slots in result["profile"])
            print(f"{schedule:>10}: busy slots per twentieth of the run: {cells}")
    if args.timeline and results.get("pipelined", {}).get("phases"):
        print_timeline(results["pipelined"]["phases"], drawn_lengths(config, lengths), lengths)
    if "pipelined" in results:
        pipelined = results["pipelined"]
        for other in ("today", "reference"):
            if other in results:
                print(f"pipelined / {other}: {pipelined['wall_s'] / results[other]['wall_s']:.2f}")
        print(
            f"goal (pipelined utilisation >= 0.9 and wall/bound <= 1.1 at C = {args.capacity}): "
            f"{'met' if goal_met(pipelined) else 'not met'} ({pipelined['utilisation']:.2f}, "
            f"{pipelined['wall_over_bound']:.2f})"
        )
        same = same_order_ideal(config, lengths, args.capacity, pipelined["candidate_order"])
        print(
            f"ideal list schedule in this run's candidate order: wall {same.wall:.2f} s, utilisation "
            f"{same.utilisation:.2f}; pipelined wall over it {pipelined['wall_s'] / same.wall:.2f} (the platform's own "
            f"work, the order's luck taken out)"
        )
    figures = ideal_figures(config, lengths, args.capacity)
    print(figures.line())
    return figures


def model_calls(config: CycleConfig, lengths: Lengths) -> Calls:
    return Calls(judge=lengths.judge, optimizer=lengths.optimizer, matches=tournament_matches(config))


def ideal_figures(config: CycleConfig, lengths: Lengths, capacity: int) -> IdealFigures:
    """`schedule_model.ideal` on this draw, held to the same bound as the measured schedules."""
    return ideal(
        drawn_lengths(config, lengths),
        model_calls(config, lengths),
        capacity,
        lambda work: lower_bound(config, lengths, work, capacity)["bound"],
        seed=lengths.seed,
    )


def same_order_ideal(config: CycleConfig, lengths: Lengths, capacity: int, started: list[tuple[int, int]]) -> ModelRun:
    """The ideal list schedule that starts waiting candidates in the order this run's pool started them: the
    measured wall over its wall is the platform's own cost, with the luck of the order taken out."""
    rank = {candidate: position for position, candidate in enumerate(started)}
    return ideal_schedule(
        drawn_lengths(config, lengths),
        model_calls(config, lengths),
        capacity,
        lambda task, index, _seconds: rank.get((task, index), math.inf),
    )


def model_study(config: CycleConfig, args: argparse.Namespace) -> None:
    """The ideal list schedule on `args.model_draws` draws (seeds 0…N-1) under four candidate orders: random; the
    pool's (the k-th candidate of every task before any task's next one); first released first; longest first (the
    one that knows lengths). Prints per order the mean, median and 90th percentile of wall/bound and on how many
    draws the goal holds."""
    orders: dict[str, Any] = {
        "random": lambda draw, _release: lambda *_: draw.random(),
        "the pool's": lambda _draw, _release: lambda task, index, _seconds: (index, task),
        "first released": lambda _draw, release: lambda *_: next(release),
        "longest first": lambda _draw, _release: lambda _task, _index, seconds: -seconds,
    }
    ratios: dict[str, list[float]] = {name: [] for name in orders}
    met = dict.fromkeys(orders, 0)
    for seed in range(args.model_draws):
        lengths = Lengths(args.median, args.sigma, args.tail_share, args.tail_factor, args.judge, args.optimizer, seed)
        drawn, calls = drawn_lengths(config, lengths), model_calls(config, lengths)
        for name, make in orders.items():
            run = ideal_schedule(drawn, calls, args.capacity, make(random.Random(seed), itertools.count()))
            ratio = run.wall / lower_bound(config, lengths, run.work, args.capacity)["bound"]
            ratios[name].append(ratio)
            met[name] += run.utilisation >= 0.9 and ratio <= 1.1
    print(
        f"ideal list schedule (no overhead) on {args.model_draws} draws, C = {args.capacity}, episodes log-normal "
        f"median {args.median} s, sigma {args.sigma}, {args.tail_share:.0%} at {args.tail_factor:g}×:"
    )
    for name, values in ratios.items():
        deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        print(
            f"  {name:>15} order: wall/bound mean {statistics.mean(values):.3f}, "
            f"median {statistics.median(values):.3f}, p90 {deciles[-1]:.3f}; "
            f"goal (utilisation >= 0.9 and wall/bound <= 1.1) on {met[name]} of {args.model_draws} draws"
        )


def goal_met(pipelined: dict[str, Any]) -> bool:
    return pipelined["utilisation"] >= 0.9 and pipelined["wall_over_bound"] <= 1.1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=8, help="requests the server processes at once (C)")
    parser.add_argument(
        "--pool-capacity", type=int, help="episodes in flight at once (default C; more: the server queues the excess)"
    )
    parser.add_argument("--tasks", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=11)
    parser.add_argument("--candidates", type=int, help="teacher candidates per training task (default: the paper's)")
    parser.add_argument("--opponents", type=int, help="ranking opponents per candidate, even (default: the paper's)")
    parser.add_argument("--median", type=float, default=0.5, help="median episode length, seconds")
    parser.add_argument("--sigma", type=float, default=0.6, help="log-normal shape of episode lengths")
    parser.add_argument("--tail-share", type=float, default=0.03, help="share of episodes that run tail-factor×")
    parser.add_argument("--tail-factor", type=float, default=10.0)
    parser.add_argument("--turn", type=float, help="longest agent turn, seconds (default: median / 8)")
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the server's order of waiting requests (inference.server.scheduling_policy)",
    )
    parser.add_argument("--judge", type=float, default=0.04, help="seconds per judge call")
    parser.add_argument("--optimizer", type=float, default=0.08, help="seconds per optimizer call")
    parser.add_argument(
        "--seeds", default="17", help="comma-separated seeds of the drawn lengths; each is a run of every schedule"
    )
    parser.add_argument("--profile", metavar="PREFIX", help="write cProfile stats of each schedule to PREFIX.<name>")
    parser.add_argument("--timeline", action="store_true", help="print each task's phase ends (pipelined)")
    parser.add_argument(
        "--model-draws",
        type=int,
        metavar="N",
        help="only the ideal list schedule (no server, no stage code) on N draws, per candidate order: how often the "
        "goal is within reach of a scheduler that knows or does not know lengths",
    )
    parser.add_argument(
        "--bootstrap-samples",
        type=int,
        default=0,
        help="ranking bootstrap resamples (CPU off the server; 0 here, see the module docstring)",
    )
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + str(SCHEDULES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        raise SystemExit(f"cycle_sim: --seeds must be comma-separated integers (got {args.seeds!r})") from None
    chosen = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCHEDULES))
    if not seeds:
        raise SystemExit("cycle_sim: --seeds names no seed")
    if unknown:
        raise SystemExit(f"cycle_sim: unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    if args.pool_capacity is not None and args.pool_capacity < 1:
        raise SystemExit(f"cycle_sim: --pool-capacity must be at least 1 (got {args.pool_capacity})")
    draws = [
        Lengths(args.median, args.sigma, args.tail_share, args.tail_factor, args.judge, args.optimizer, seed)
        for seed in seeds
    ]
    if args.model_draws is not None:
        if args.model_draws < 1:
            raise SystemExit(f"cycle_sim: --model-draws must be at least 1 (got {args.model_draws})")
        model_study(sim_config("sim-model", "http://127.0.0.1:9/v1", Path("."), args.capacity, args), args)
        return

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="mass-cycle-sim-", dir=shm if shm.is_dir() else None))
    tempfile.tempdir = str(base)
    runs: list[dict[str, dict[str, Any]]] = []
    try:
        # One server for every seed: its call latencies do not depend on the draw, episodes send their own lengths.
        server = ServerProcess(args.capacity, draws[0])
        try:
            for lengths in draws:
                results: dict[str, dict[str, Any]] = {}
                folder = base / f"seed-{lengths.seed}"
                for schedule in chosen:
                    if args.profile:  # the calling thread only: the reference order runs its stage code there
                        profiler = cProfile.Profile()
                        results[schedule] = profiler.runcall(run_schedule, schedule, server, lengths, folder, args)
                        profiler.dump_stats(f"{args.profile}.{schedule}")
                    else:
                        results[schedule] = run_schedule(schedule, server, lengths, folder, args)
                    seconds = results[schedule]["wall_s"]
                    print(f"seed {lengths.seed} {schedule}: {seconds:.1f} s", file=sys.stderr, flush=True)
                runs.append(results)
        finally:
            server.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    config = sim_config("sim-bound", "http://127.0.0.1:9/v1", base, args.capacity, args)
    ideals = [report(results, config, lengths, args) for lengths, results in zip(draws, runs, strict=True)]
    if args.bootstrap_samples < 2 and config.tasks.train:
        print(
            f"ranking bootstrap left out (--bootstrap-samples {args.bootstrap_samples}): "
            f"{bootstrap_cost(config):.2f} s of CPU per task for the paper's 1000 resamples, no server work"
        )
    if len(seeds) > 1 and "pipelined" in chosen:
        pipelined = [(lengths.seed, results["pipelined"]) for lengths, results in zip(draws, runs, strict=True)]
        cells = ", ".join(f"seed {seed} {r['utilisation']:.2f}/{r['wall_over_bound']:.2f}" for seed, r in pipelined)
        met = sum(goal_met(r) for _, r in pipelined)
        print(f"pipelined over {len(seeds)} seeds (utilisation/wall-bound): {cells}; goal met on {met} of {len(seeds)}")
        blind = ", ".join(
            f"seed {lengths.seed} {figures.blind_utilisation:.2f}/{figures.blind_over_bound[1]:.2f}"
            for lengths, figures in zip(draws, ideals, strict=True)
        )
        reach = sum(figures.blind_utilisation >= 0.9 and figures.blind_over_bound[1] <= 1.1 for figures in ideals)
        print(
            f"ideal list schedule not knowing lengths, medians (utilisation/wall-bound): {blind}; "
            f"within the goal on {reach} of {len(seeds)}"
        )


if __name__ == "__main__":
    main()
