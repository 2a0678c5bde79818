"""The pipelined inner loop (ISSUE #17.2) on a tiny cycle: each task's collection starts when its own search is
done and its ranking when its own collection is, not when every task's is; a repair reruns only the failed unit."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest

from mass_ops.llm.calls import CallLedger
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.seeds import collection_seed
from mass_ops.stages.inner_loop import InnerLoopFailedError, run_inner_loop
from tests.inner_loop_fakes import FailurePlan, FakeExecutor, InnerLoopEnv, inner_loop_fixture  # noqa: F401

FAST, SLOW = 51, 202
SLOW_SEARCH_EPISODE_S = 0.5


class PhaseLog:
    """The chains' phase events in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()

    def __call__(self, phase: str, task_id: int, state: str) -> None:
        with self._lock:
            self.events.append((phase, task_id, state))

    def at(self, phase: str, task_id: int, state: str) -> int:
        return self.events.index((phase, task_id, state))


def slow_search_of(task_id: int) -> Any:
    """An `on_episode` hook: the search episodes of `task_id` take a while; everything else is instant."""

    def hook(request: EpisodeRequest) -> None:
        if request.unit.task_id == task_id and request.unit.kind in ("search", "reference"):
            time.sleep(SLOW_SEARCH_EPISODE_S)

    return hook


def test_a_fast_task_collects_and_ranks_before_a_slow_task_s_search_ends(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(
        tasks=(FAST, SLOW),
        iterations=1,
        candidates=3,
        train_ranks=1,
        require_beats_reference=False,
        executor_options={"capacity": 4, "on_episode": slow_search_of(SLOW)},
    )
    log = PhaseLog()
    results = run_inner_loop(opened.ctx, opened.executor, client=opened.client, on_phase=log)

    assert [(r.task_id, r.collected, r.ranked) for r in results] == [(FAST, 3, 3), (SLOW, 3, 3)]
    slow_search_done = log.at("search", SLOW, "finished")
    assert log.at("collection", FAST, "finished") < slow_search_done, log.events
    assert log.at("ranking", FAST, "finished") < slow_search_done, log.events
    assert log.at("collection", SLOW, "started") > slow_search_done  # each chain stays in order


def test_a_failed_collection_unit_is_repaired_by_rerunning_only_that_unit(inner_loop: InnerLoopEnv) -> None:
    overrides: dict[str, Any] = {
        "tasks": (FAST, SLOW),
        "iterations": 1,
        "candidates": 4,
        "train_ranks": 2,
        "require_beats_reference": False,
    }
    config = inner_loop.config(**overrides)
    failing = f"collection-t{FAST}-c1-s{collection_seed(config.collection.seed_base, FAST, 1)}"
    first = inner_loop.open(
        executor_options={"capacity": 4, "max_attempts": 1, "failures": {failing: FailurePlan(infra_attempts=1)}},
        **overrides,
    )
    with pytest.raises(InnerLoopFailedError, match=f"task {FAST}: CollectionIncompleteError") as caught:
        run_inner_loop(first.ctx, first.executor, client=first.client)
    slow = next(r for r in caught.value.results if r.task_id == SLOW)
    assert (slow.collected, slow.ranked) == (4, 4), "the other task's chain ran to its end"
    assert not first.ctx.repo.rankings(first.ctx.cycle_id, FAST), "an incomplete collection is not ranked"

    repair = FakeExecutor(first.ctx, capacity=4)
    results = run_inner_loop(first.ctx, repair, client=first.client)

    assert [(r.task_id, r.collected, r.ranked) for r in results] == [(FAST, 4, 4), (SLOW, 4, 4)]
    assert len(repair.executed) == 1 and failing in repair.executed[0], repair.executed


def test_a_failing_chain_does_not_stop_the_others(inner_loop: InnerLoopEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = inner_loop.open(
        tasks=(FAST, SLOW), iterations=1, candidates=3, train_ranks=1, require_beats_reference=False
    )
    from mass_ops.stages import inner_loop as module

    real = module.collect_task

    def broken(ctx: Any, executor: Any, task_id: int) -> Any:
        if task_id == SLOW:
            raise RuntimeError("injected collection failure")
        return real(ctx, executor, task_id)

    monkeypatch.setattr(module, "collect_task", broken)
    with pytest.raises(InnerLoopFailedError, match=f"task {SLOW}: RuntimeError: injected") as caught:
        run_inner_loop(opened.ctx, opened.executor, client=opened.client)
    fast = next(r for r in caught.value.results if r.task_id == FAST)
    assert (fast.collected, fast.ranked, fast.error) == (3, 3, None)


def expected_server_priority(unit_key: str, iterations: int) -> int:
    """What `critical_path.server_priority` gives a call, read back from its unit key: a search call at version k
    gets k (the baseline verdict of v_k, the arbitration of challenger v_k, the proposal v_k -> v_k+1); ranking comes
    after the last version, with collection."""
    ledger, key = unit_key.split("/")[1:3]
    if ledger == "ranking":
        return iterations + 1
    pattern = {"rhi": r"v(\d+)_vs_no_harness", "champion": r"champion_v\d+_vs_v(\d+)", "optimizer": r"v(\d+)_to_v"}
    found = re.fullmatch(pattern[ledger] + ".*", key)
    assert found, unit_key
    return int(found.group(1))


def test_with_priority_scheduling_every_in_loop_call_carries_its_place_on_the_chain(inner_loop: InnerLoopEnv) -> None:
    """ISSUE #17.2: a vLLM server that schedules by priority serves the longest remaining chain first, so each judge
    and optimizer request says how early in its task's chain it stands."""
    iterations = 2
    inner_loop.policy.judge_winner = lambda request: "B"  # each version beats the reference: every step arbitrates
    opened = inner_loop.open(
        tasks=(FAST,),
        iterations=iterations,
        candidates=3,
        train_ranks=1,
        require_beats_reference=False,
        scheduling_policy="priority",
    )
    run_inner_loop(opened.ctx, opened.executor, client=opened.client)

    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    sent = {}
    for row in opened.ctx.repo.llm_calls(opened.ctx.cycle_id):
        request = opened.ctx.artifacts.get_json(ledger.prompt_key(row.unit_key))["request"]
        sent[row.unit_key] = request["extra_body"]["priority"]
    assert {key.split("/")[1] for key in sent} == {"rhi", "champion", "optimizer", "ranking"}, sorted(sent)
    assert sent == {key: expected_server_priority(key, iterations) for key in sent}
    received = sorted({body["priority"] for body in inner_loop.server.requests})
    assert received == [0, 1, 2, iterations + 1], "the server received what the ledger recorded"
