"""The ideal list schedule of a simulated cycle: what any scheduler of C slots could reach with zero overhead.

`cycle_sim.py` measures the real stage code against a bound that knows every episode's length in advance (its chain
assumes a task's longest collection candidate starts the moment the task's search ends). This module answers the
question in between: on the same drawn lengths and the same dependencies as that bound, what do wall-clock and
utilisation come to for a scheduler with no stage overhead at all, (a) that does not know lengths in advance (it
starts waiting collection candidates in an arbitrary order: many random orders, summarised), and (b) that does
(longest candidate first)? The gap measured/ideal is the platform's overhead; the gap ideal/bound is the price of not
knowing which episode will run long.

The model (non-preemptive, C slots, a slot per episode or call from start to end):
- per task, search: reference ∥ v0, then a proposal; per later version its episode, two judge calls one after the
  other (the verdict, then the arbitration) and, but the last, a proposal;
- per training task, once its search is done: its collection candidates, and once all are done: its ranking
  matches (one judge call each);
- when a slot frees it goes to the waiting search work of the earliest version, then to ranking calls, then to
  collection candidates (in the order of (a) or (b)).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Drawn lengths per task: (search episodes: reference, v0, v1, …; collection candidates, empty for a search-only task).
Drawn = Mapping[int, tuple[Sequence[float], Sequence[float]]]
# How waiting collection candidates are ordered: (task, candidate index, length) -> a sort key, smallest first (keys of
# one run must compare with each other: all numbers, or all tuples).
CandidateOrder = Callable[[int, int, float], Any]


@dataclass(frozen=True)
class Calls:
    """Server seconds per judge and per optimizer call, and ranking matches per training task."""

    judge: float
    optimizer: float
    matches: int


@dataclass(frozen=True)
class ModelRun:
    """One schedule of the model: its wall-clock, total server work and utilisation (work / (C × wall))."""

    wall: float
    work: float
    utilisation: float


def schedule(
    drawn: Drawn,
    calls: Calls,
    capacity: int,
    order: CandidateOrder,
    on_phase: Callable[[int, str, float], None] | None = None,
) -> ModelRun:
    """Run the model once (see the module docstring) and return its wall-clock and utilisation; `on_phase(task,
    phase, at)` hears when each task's search, collection and ranking end."""
    if capacity < 1:
        raise ValueError(f"capacity must be ≥ 1 (got {capacity})")
    ready: list[tuple[tuple[Any, ...], int, float, Callable[[], None]]] = []  # (priority, tie, seconds, on done)
    running: list[tuple[float, int, Callable[[], None]]] = []  # (ends at, tie, on done)
    tie = itertools.count()
    now = 0.0
    work = 0.0

    def submit(priority: tuple[Any, ...], seconds: float, done: Callable[[], None]) -> None:
        heapq.heappush(ready, (priority, next(tie), seconds, done))

    def after(count: int, then: Callable[[], None]) -> Callable[[], None]:
        """A callback that runs `then` on its `count`-th call: the join of `count` parallel items."""
        left = [count]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                then()

        return one_done

    def start_task(task: int, search: Sequence[float], collection: Sequence[float]) -> None:
        versions = len(search) - 2  # v1 … v_last after the reference and v0

        def version(number: int) -> None:  # the episode of v<number>, then its verdict and arbitration
            urgency = (0.0, -float(versions - number))
            submit(urgency, search[number + 1], lambda: submit(urgency, calls.judge, lambda: verdict(number)))

        def verdict(number: int) -> None:
            urgency = (0.0, -float(versions - number))
            submit(urgency, calls.judge, lambda: propose(number) if number < versions else collect())

        def propose(number: int) -> None:  # the proposal of v<number + 1>
            submit((0.0, -float(versions - number)), calls.optimizer, lambda: version(number + 1))

        def ended(phase: str) -> None:
            if on_phase is not None:
                on_phase(task, phase, now)

        def collect() -> None:
            ended("search")
            if not collection:
                return
            joined = after(len(collection), collected)
            for index, seconds in enumerate(collection):
                submit((2.0, order(task, index, seconds)), seconds, joined)

        def collected() -> None:
            ended("collection")
            rank()

        def rank() -> None:
            if calls.matches == 0:
                ended("ranking")
                return
            finished = after(calls.matches, lambda: ended("ranking"))
            for _ in range(calls.matches):
                submit((1.0,), calls.judge, finished)

        both = after(2, lambda: propose(0) if versions > 0 else collect())  # no later version: v0 is retained
        submit((0.0, -float(versions + 1)), search[0], both)  # the reference
        submit((0.0, -float(versions + 1)), search[1], both)  # v0

    for task, (search, collection) in drawn.items():
        start_task(task, search, collection)
    while ready or running:
        while ready and len(running) < capacity:
            _, _, seconds, done = heapq.heappop(ready)
            work += seconds
            heapq.heappush(running, (now + seconds, next(tie), done))
        now, _, done = heapq.heappop(running)
        done()
    return ModelRun(wall=now, work=work, utilisation=work / (capacity * now) if now > 0 else 0.0)


@dataclass(frozen=True)
class IdealFigures:
    """The model's figures on one draw: wall/bound and utilisation without knowing lengths (median and the 10th and
    90th percentiles over random candidate orders) and knowing them (longest candidate first)."""

    orders: int
    blind_over_bound: tuple[float, float, float]  # p10, median, p90
    blind_utilisation: float  # median
    knowing_over_bound: float
    knowing_utilisation: float

    def line(self) -> str:
        low, median, high = self.blind_over_bound
        return (
            f"ideal list schedule (no overhead): not knowing lengths, over {self.orders} random candidate orders: "
            f"utilisation {self.blind_utilisation:.2f}, wall/bound {median:.2f} (p10 {low:.2f}, p90 {high:.2f}); "
            f"longest candidate first: utilisation {self.knowing_utilisation:.2f}, "
            f"wall/bound {self.knowing_over_bound:.2f}"
        )


def ideal(
    drawn: Drawn, calls: Calls, capacity: int, bound: Callable[[float], float], orders: int = 200, seed: int = 0
) -> IdealFigures:
    """The model on one draw: `orders` random candidate orders, and longest first. `bound(work)` is the lower bound
    of a run with that much server work (the caller's, so model and measurement are held to the same bound)."""
    draw = random.Random(seed)
    blind = [schedule(drawn, calls, capacity, lambda *_: draw.random()) for _ in range(orders)]
    ratios = sorted(run.wall / bound(run.work) for run in blind)
    knowing = schedule(drawn, calls, capacity, lambda _task, _index, seconds: -seconds)
    deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    return IdealFigures(
        orders=orders,
        blind_over_bound=(deciles[0], statistics.median(ratios), deciles[-1]),
        blind_utilisation=statistics.median(run.utilisation for run in blind),
        knowing_over_bound=knowing.wall / bound(knowing.work),
        knowing_utilisation=knowing.utilisation,
    )
