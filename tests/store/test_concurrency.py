"""Concurrent writers: several processes record the same units at once → exactly one row each, no error surfaces."""

from __future__ import annotations

import multiprocessing
import random
import traceback
from typing import Any

import pytest
import sqlalchemy as sa

from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import Comparison, Cycle, Dataset, Episode, LLMCall, TrainingWindow

PROCESSES = 4
UNITS = 50
WINDOWS = 200


def _window(position: int) -> dict[str, Any]:
    return {
        "position": position,
        "task_id": "51",
        "role": "worker",
        "is_main": False,
        "window_index": 0,
        "n_windows": 1,
        "n_tokens": 100,
        "n_loss_tokens": 10,
    }


def _record_units(url: str, worker: int, barrier: Any, results: Any) -> None:
    """One writer process: wait for the others, then record the shared units (in its own order)."""
    try:
        repo = MetadataRepository(MetadataStore(url))
        order = list(range(UNITS))
        if worker % 2:
            random.Random(worker).shuffle(order)
        barrier.wait(timeout=120)
        cycle = repo.ensure_cycle("race", {"preset": "demo"}, "f" * 64)
        ids: dict[int, tuple[int, int, int]] = {}
        for unit in order:
            episode = repo.record_episode(
                cycle.id, task_id=51, kind="collection", candidate=unit, seed=715100 + unit, status="succeeded"
            )
            call = repo.record_llm_call(cycle.id, f"t51/ranking/m{unit}", purpose="self_judge", model="L0", seed=unit)
            comparison = repo.record_comparison(
                cycle.id,
                51,
                "ranking",
                f"m{unit}",
                side_a="candidate-a",
                side_b="candidate-b",
                episode_a_id=episode.id,
                judge_model="L0",
                verdict="A",
                llm_call_id=call.id,
            )
            ids[unit] = (episode.id, call.id, comparison.id)
        dataset = repo.record_dataset(
            cycle.id, "train", "file:///d", episodes=1, windows=WINDOWS, loss_tokens=10 * WINDOWS, total_tokens=1
        )
        positions = range(WINDOWS) if worker % 2 == 0 else reversed(range(WINDOWS))
        repo.record_windows(dataset.id, [_window(p) for p in positions])
        repo.store.dispose()
        results.put((worker, "ok", ids))
    except BaseException:
        results.put((worker, "error", traceback.format_exc()))


@pytest.mark.slow
def test_concurrent_writers_record_each_unit_once(metadata_url: str):
    # Imported here, not at module top: every spawned writer re-imports this module, and Alembic is heavy.
    from mass_ops.store import migrations

    migrations.upgrade(metadata_url)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [
        context.Process(target=_record_units, args=(metadata_url, worker, barrier, results))
        for worker in range(PROCESSES)
    ]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=240) for _ in workers]
    for process in workers:
        process.join(timeout=60)

    errors = [detail for _, status, detail in outcomes if status != "ok"]
    assert errors == []
    assert [process.exitcode for process in workers] == [0] * PROCESSES
    # Every writer got the same row back for every unit.
    first = outcomes[0][2]
    assert all(ids == first for _, _, ids in outcomes)

    store = MetadataStore(metadata_url)
    with store.read() as session:

        def count(model: type) -> int:
            return session.scalar(sa.select(sa.func.count()).select_from(model))

        assert count(Cycle) == 1
        assert count(Episode) == count(LLMCall) == count(Comparison) == UNITS
        assert count(Dataset) == 1
        assert count(TrainingWindow) == WINDOWS
        distinct_keys = session.scalar(sa.select(sa.func.count(sa.distinct(Episode.unit_key))))
        assert distinct_keys == UNITS
    store.dispose()


def test_threads_of_one_process_write_to_sqlite_at_once_without_locking_errors(tmp_path):
    """Threads share one store: the in-process writer queue hands the database lock over, so none waits out the
    busy timeout or fails with "database is locked", and every unit is recorded once."""
    from concurrent.futures import ThreadPoolExecutor

    from mass_ops.store import migrations

    url = f"sqlite:///{tmp_path / 'threads.db'}"
    migrations.upgrade(url)
    repo = MetadataRepository(MetadataStore(url))
    cycle = repo.ensure_cycle("threads", {"preset": "demo"}, "e" * 64)

    def record(worker: int) -> list[int]:
        ids = []
        for unit in range(UNITS):
            # Every worker records the same units: one row each, whoever comes first.
            ids.append(
                repo.record_episode(
                    cycle.id, task_id=51, kind="collection", candidate=unit, seed=715100 + unit, status="succeeded"
                ).id
            )
        return ids

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(record, range(8)))
    assert all(ids == results[0] for ids in results), "every thread sees the one row of each unit"
    assert len(repo.episodes(cycle.id)) == UNITS
