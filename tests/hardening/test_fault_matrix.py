"""The fault matrix, small: SIGKILL the cheap writing stages at seeded random points, rerun them, and require that no
unit was lost or duplicated; and show that the counters do catch a stage that is not idempotent.

The full matrix (every stage, more kills, train and export on the tiny CPU model) is `benchmarks/fault_matrix.py`.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mass_ops.llm import CallRecord
from mass_ops.llm.calls import CallLedger, CallUnit
from tests.hardening.kill_matrix import (
    SPECS,
    Answer,
    Inventory,
    compare,
    count_repeats,
    format_lines,
    open_matrix,
)


def inventory(*keys: str, staging: int = 0) -> Inventory:
    return Inventory(Counter(keys), staging)


def test_compare_counts_missing_keys_as_lost_and_extra_keys_as_duplicated() -> None:
    reference = inventory("episodes:c/search-t51-v0-s1/a1", "llm_calls:task51/rhi/v0/a1", "artifact:cycles/c/x.json")
    trial = inventory(
        "episodes:c/search-t51-v0-s1/a1",
        "episodes:c/search-t51-v0-s1/a1",  # the same unit recorded twice
        "llm_calls:task51/rhi/v0/a2",  # a second attempt where the reference needed one: a1 lost, a2 duplicated
        "artifact:cycles/c/orphan.json",  # written by no reference run
        "artifact:cycles/c/training/resume_log.jsonl",  # a resumed run's record of its resume: expected
    )
    damage = compare(reference, trial)
    assert damage.lost == ["artifact:cycles/c/x.json", "llm_calls:task51/rhi/v0/a1"]
    assert damage.duplicated == [
        "artifact:cycles/c/orphan.json",
        "episodes:c/search-t51-v0-s1/a1",
        "llm_calls:task51/rhi/v0/a2",
    ]
    assert compare(reference, reference) == compare(trial, trial)
    assert compare(reference, reference).lost == compare(reference, reference).duplicated == []


def test_repeats_count_calls_asked_more_often_than_in_the_reference_and_when_they_were_answered() -> None:
    reference = [Answer(0.0, 0.0, "a"), Answer(0.0, 1.0, "b"), Answer(0.0, 2.0, "b")]
    trial = [
        Answer(0.0, 10.0, "a"),  # answered before the kill at 15 ...
        Answer(0.0, 20.0, "a"),  # ... and asked again by the rerun: answered but never recorded
        Answer(0.0, 16.0, "b"),  # in flight at the kill (answered after it) ...
        Answer(0.0, 21.0, "b"),
        Answer(0.0, 22.0, "b"),  # ... and asked once more than the reference did
        Answer(0.0, 23.0, "c"),  # a call the reference never made
    ]
    repeats = count_repeats(reference, trial, kill_at=15.0)
    assert (repeats.total, repeats.answered_before_kill, repeats.unmatched) == (2, 1, 1)


class SideBySideArtifacts:
    """An artifact store whose puts each wait until a second put has started: writes made one after the other never
    get past the first (BrokenBarrierError after the timeout)."""

    def __init__(self) -> None:
        self.both_started = threading.Barrier(2, timeout=10)
        self.written: list[str] = []

    def put_json(self, key: str, document: Any) -> SimpleNamespace:
        self.both_started.wait()
        self.written.append(key)
        return SimpleNamespace(uri=f"memory://{key}", sha256="0" * 64)


def test_the_ledger_writes_an_answers_prompt_and_result_side_by_side_then_its_row() -> None:
    # The fault matrix's finding: a kill between the answer and its row repeats a paid call, and the two document
    # puts (about 12 ms each here) were most of that window. Side by side, the window is one put and the row.
    artifacts = SideBySideArtifacts()
    rows: list[tuple[str, list[str]]] = []

    def record_llm_call(cycle_id: int, unit_key: str, **fields: Any) -> SimpleNamespace:
        rows.append((unit_key, sorted(artifacts.written)))
        return SimpleNamespace(id=1, unit_key=unit_key, **fields)

    ledger = CallLedger(SimpleNamespace(record_llm_call=record_llm_call), artifacts, 1, "c")  # type: ignore[arg-type]
    record = CallRecord(
        purpose="judge", backend="vllm", base_url="http://stand-in/v1", model="m", seed=7, status="ok", attempts=1,
        latency_s=0.1, usage={}, cost_usd=None, request={"messages": []},
        response={"choices": [{"message": {"content": '{"winner": "A"}'}}]},
    )  # fmt: skip
    with ledger.attempt(CallUnit("task51/rhi/v0_vs_no_harness", "judge", 51), number=1) as attempt:
        ledger(record)
        attempt.parsed = {"winner": "A"}
    prefix = "cycles/c/calls/task51/rhi/v0_vs_no_harness/a1"
    assert rows == [("task51/rhi/v0_vs_no_harness/a1", [f"{prefix}/prompt.json", f"{prefix}/result.json"])]


def test_the_matrix_flags_a_stage_that_records_its_units_again_on_a_rerun(tmp_path: Path) -> None:
    # `broken` records every unit as a new attempt on each run and publishes under a per-process key: killed after
    # most of its units, then rerun, it must show duplicated units (and the reference's orphaned keys as lost).
    with open_matrix(tmp_path) as matrix:
        _, _, work_s = matrix.reference(SPECS["broken"])
        killed, damage, _, _ = matrix.trial(SPECS["broken"], kill_after_s=work_s * 0.8)
    assert killed.killed
    assert any(key.startswith("llm_calls:broken/") and key.endswith("/a2") for key in damage.duplicated)
    assert any(key.startswith("artifact:") for key in damage.duplicated)


@pytest.mark.slow(seconds=35)
def test_killed_and_rerun_stages_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    with open_matrix(tmp_path, seed=13) as matrix:
        lines = [matrix.stage(name, kills=1) for name in ("search", "collect", "rank", "rollout", "evaluate")]
    table = "\n".join(format_lines(lines))
    assert sum(line.reruns for line in lines) == 5, table
    assert [(line.stage, line.lost, line.duplicated) for line in lines] == [(line.stage, 0, 0) for line in lines], table
