"""The inner loop per task, pipelined (ISSUE #17.2): each task's search → collection → ranking chain runs as soon as
its own previous phase is done, all chains concurrently through one executor; only selection waits for every task.

Today's stage order puts barriers between the phases (collection waits for the slowest task's 12-version search,
ranking for every collection), so the model server idles while the last chains finish. Here a task whose search
retained a workflow starts its teacher candidates at once, and ranks them as soon as they are done. The executor
(`EpisodePool`) prefers the episodes on the longest remaining chain, so one task's collection does not delay another
task's search, which is the critical path.

Every phase is the stage code of its family (`search_task`, `collect_batch`, `rank_tasks`), so units stay keyed and
resumable: rerunning after a failure redoes only what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.errors import InfrastructureError
from mass_ops.llm import LLMClient
from mass_ops.runtime.episode import EpisodeExecutor
from mass_ops.search.driver import search_task, search_task_ids
from mass_ops.stages.collect import collect_task
from mass_ops.stages.rank import rank_tasks

logger = logging.getLogger(__name__)

# (phase, task id, "started" | "finished"): for progress displays and the tests of the pipelined order.
PhaseEvent = Callable[[str, int, str], None]


@dataclass(frozen=True)
class TaskChainResult:
    """What one task's chain did: its search, and for a training task its collection and ranking."""

    task_id: int
    retained_version: int | None
    collection: str | None = None  # the collection decision (collect, let_through, skip); None: not a training task
    collected: int = 0
    ranked: int = 0
    best: str | None = None
    error: str | None = None

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


class InnerLoopFailedError(InfrastructureError):
    """Some tasks' chains failed; `results` holds every task's result (failed ones carry `error`)."""

    def __init__(self, results: list[TaskChainResult]) -> None:
        self.results = results
        failed = [r for r in results if r.error]
        lines = [f"task {r.task_id}: {r.error}" for r in failed]
        super().__init__(f"inner loop failed for {len(failed)} of {len(results)} tasks: " + "; ".join(lines))


def _chain(
    ctx: CycleContext,
    executor: EpisodeExecutor,
    task_id: int,
    client: LLMClient | None,
    on_phase: PhaseEvent | None,
) -> TaskChainResult:
    def phase(name: str, state: str) -> None:
        if on_phase is not None:
            on_phase(name, task_id, state)

    phase("search", "started")
    searched = search_task(ctx, executor, task_id, client=client)
    phase("search", "finished")
    if task_id not in ctx.config.tasks.train:  # searched only (e.g. an excluded train candidate)
        return TaskChainResult(task_id, searched.retained_version)
    phase("collection", "started")
    collected = collect_task(ctx, executor, task_id)  # raises while some candidates failed on infrastructure
    phase("collection", "finished")
    if collected.decision == "skip":
        return TaskChainResult(task_id, searched.retained_version, collected.decision)
    phase("ranking", "started")
    (ranked,) = rank_tasks(ctx, [task_id], client=client)
    phase("ranking", "finished")
    return TaskChainResult(
        task_id,
        searched.retained_version,
        collected.decision,
        collected=collected.succeeded,
        ranked=ranked.candidates,
        best=ranked.ranked[0].name if ranked.ranked else None,
    )


def run_inner_loop(
    ctx: CycleContext,
    executor: EpisodeExecutor,
    task_ids: Sequence[int] | None = None,
    *,
    client: LLMClient | None = None,
    on_phase: PhaseEvent | None = None,
) -> list[TaskChainResult]:
    """Every task's search → collection → ranking chain at once (one thread per task, each chain in order), all
    episodes through `executor`; results in task order. A failing chain does not stop the others; when any failed,
    `InnerLoopFailedError` carries every result. Selection is not part of it: it needs every task ranked."""
    chosen = search_task_ids(ctx.config, task_ids)
    results: list[TaskChainResult] = []
    with ThreadPoolExecutor(max_workers=max(1, len(chosen)), thread_name_prefix="inner-loop") as pool:
        futures = {task: pool.submit(_chain, ctx, executor, task, client, on_phase) for task in chosen}
        for task, future in futures.items():
            try:
                results.append(future.result())
            except Exception as exc:  # one task's failure is reported with the others' results
                logger.error("inner loop of task %s failed: %s", task, exc)
                results.append(TaskChainResult(task, None, error=f"{type(exc).__name__}: {exc}"))
    if any(result.error for result in results):
        raise InnerLoopFailedError(results)
    return results
