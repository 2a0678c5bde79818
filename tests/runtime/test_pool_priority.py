"""The episode pool's scheduler serves the longest remaining chain first (ISSUE #17.2): a task's search episode is
granted before another task's queued collection, an early version before a late one — in the scheduler and through
the pool's `run()` called from several threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.runtime.pool import EpisodePool, FairScheduler, PoolEvent
from tests.support.runtime import open_episode_cycle, request


def test_a_waiting_search_episode_overtakes_another_task_s_queued_collection() -> None:
    async def scenario() -> list[str]:
        scheduler = FairScheduler(2)
        order: list[str] = []
        await scheduler.acquire(51, 13)  # task 51's reference episode runs…
        await scheduler.acquire(202, 1)  # …beside a collection episode of task 202

        async def episode(task: int, priority: int, name: str) -> None:
            await scheduler.acquire(task, priority)
            order.append(name)
            await asyncio.sleep(0.001)
            scheduler.release(task)

        # Task 202's other candidates queue first; then task 51's v0 episode arrives. By running counts alone task
        # 202 (0 running once its slot frees) would go before task 51 (1 running): the chain decides instead.
        waiting = [asyncio.ensure_future(episode(202, 1, f"collect-{i}")) for i in range(3)]
        await asyncio.sleep(0)
        waiting.append(asyncio.ensure_future(episode(51, 13, "search-v0")))
        await asyncio.sleep(0)
        scheduler.release(202)
        await asyncio.sleep(0)
        scheduler.release(51)
        await asyncio.gather(*waiting)
        return order

    assert asyncio.run(scenario())[0] == "search-v0"


class GatedRunner:
    """An `AttemptRunner` whose gated units run until the test opens their gate; the others end at once. Records the
    order in which units start (the order the pool granted their slots)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.changed = threading.Condition()

    async def preflight(self) -> None:
        return None

    async def run_attempt(
        self, request: EpisodeRequest, attempt: int, *, retry_of_id: int | None = None, **_: Any
    ) -> EpisodeOutcome:
        slug = request.unit.slug
        with self.changed:
            self.started.append(slug)
            self.changed.notify_all()
        gate = self.gates.get(slug)
        if gate is not None:
            await asyncio.to_thread(gate.wait, 30)
        return EpisodeOutcome(request, 0, attempt, "succeeded", {"status": "succeeded"})

    def wait_until(self, condition: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout=30)


def test_a_search_chain_is_not_starved_by_another_task_s_collection_in_the_pool(tmp_path: Path) -> None:
    """Through `EpisodePool.run` from three threads, as the pipelined inner loop calls it: task 51's search episode
    v5 and task 202's collection wait for a slot; the freed slot goes to the search episode, although task 202 has
    started fewer episodes (fairness alone would pick task 202's candidate, ISSUE #17.2)."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", capacity=2, max_infra_attempts=1)
    runner = GatedRunner()
    queued: list[str] = []
    changed = threading.Condition()

    def on_event(event: PoolEvent) -> None:
        if event.kind == "queued":
            with changed:
                queued.append(event.unit.slug)
                changed.notify_all()

    def search(version: int) -> EpisodeRequest:
        return request(ctx, f"v{version}", task=51, kind="search", seed=version, version=version)

    def collection(task: int, candidate: int) -> EpisodeRequest:
        return request(ctx, "teacher", task=task, kind="collection", seed=candidate, candidate=candidate)

    busy = [collection(300, c) for c in range(3)]  # a third task's collection holds both slots
    waiting = [collection(202, c) for c in range(3)]
    for unit in busy + waiting + [search(5)]:
        runner.gates[unit.unit.slug] = threading.Event()
    with EpisodePool(ctx, runner=runner, on_event=on_event) as pool, ThreadPoolExecutor(3) as threads:
        try:
            pool.run([search(v) for v in range(5)])  # task 51's chain so far: v0..v4 (5 episodes started)
            holding = threads.submit(pool.run, busy)
            runner.wait_until(lambda: len(runner.started) == 5 + 2)
            collecting = threads.submit(pool.run, waiting)
            with changed:
                assert changed.wait_for(lambda: sum(s.startswith("collection-t202") for s in queued) == 3, 30)
            searching = threads.submit(pool.run, [search(5)])
            with changed:
                assert changed.wait_for(lambda: search(5).unit.slug in queued, 30)
            runner.gates[busy[0].unit.slug].set()  # one slot frees
            runner.wait_until(lambda: len(runner.started) == 5 + 3)
            assert runner.started[-1] == search(5).unit.slug
        finally:
            for gate in runner.gates.values():
                gate.set()
        for batch in (holding, collecting, searching):
            assert all(outcome.status == "succeeded" for outcome in batch.result(30))
