"""The episode pool's scheduler serves the longest remaining chain first (ISSUE #17.2): a task's search episode is
granted before another task's queued collection, an early version before a late one."""

from __future__ import annotations

import asyncio

from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.pool import FairScheduler, chain_priority


def unit(kind: str, *, version: int | None = None, candidate: int | None = None) -> EpisodeUnit:
    return EpisodeUnit("c", 51, kind, 7, version=version, candidate=candidate)  # type: ignore[arg-type]


def test_chain_priority_orders_search_versions_before_collection_before_the_rest() -> None:
    iterations = 11
    ranks = [
        chain_priority(unit("reference"), iterations),
        chain_priority(unit("search", version=0), iterations),
        chain_priority(unit("search", version=5), iterations),
        chain_priority(unit("search", version=11), iterations),
        chain_priority(unit("collection", candidate=3), iterations),
        chain_priority(unit("rollout"), iterations),
    ]
    assert ranks == [13, 13, 8, 2, 1, 0]


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
