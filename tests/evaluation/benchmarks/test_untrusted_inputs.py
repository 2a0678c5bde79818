"""Benchmark data and what the agent left for the graders are read within bounds: a line nested past the parser's
stack is one clear BenchmarkError, a huge answer is read only up to its cap, a workspace bomb is graded as no
submission instead of unpacking."""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from mass_ops.evaluation.benchmarks.asta import TASK_FILE, load_asta_samples
from mass_ops.evaluation.benchmarks.dsbench import DATA_FILE, DSBench, load_ds_questions
from mass_ops.evaluation.benchmarks.sab import SHEET_NAMES, load_sab_instances
from mass_ops.evaluation.benchmarks.scoring import (
    JSON_LINE_MAX_BYTES,
    SUBMISSION_MAX_BYTES,
    BenchmarkError,
    workspace_text,
)
from mass_ops.evaluation.benchmarks.suite import run_benchmark_trial
from mass_ops.evaluation.benchmarks.swe import DATASET_FILE, load_swe_instances
from mass_ops.evaluation.benchmarks.tb2 import parse_reward
from tests.evaluation.benchmarks.test_adapters import write_dsbench
from tests.evaluation.fakes import BenchmarkExecutor, EvalEnv
from tests.fixtures.archives import zero_bomb

DEEP = "[" * 100_000 + "]" * 100_000  # far past the parser's stack: a bare RecursionError before

LOADERS: list[tuple[str, Callable[[Path], object]]] = [
    (DATA_FILE, load_ds_questions),
    (TASK_FILE, load_asta_samples),
    (SHEET_NAMES[0], load_sab_instances),
    (DATASET_FILE, load_swe_instances),
]


@pytest.mark.parametrize(("name", "load"), LOADERS, ids=["ds", "asta", "sab", "swe"])
def test_a_deeply_nested_line_is_one_clear_error_naming_the_line(tmp_path: Path, name: str, load: Callable) -> None:
    (tmp_path / name).write_text("\n" + DEEP + "\n")  # a blank line first: the count must still be right
    with pytest.raises(BenchmarkError) as refused:
        load(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / name}:2: JSON nested deeper than") and "\n" not in message


def test_a_line_over_its_cap_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / DATASET_FILE
    with path.open("wb") as out:
        out.write(b'{"instance_id": "')
        out.truncate(JSON_LINE_MAX_BYTES * 4)  # one 64 MB line of NULs, sparse on disk
    with pytest.raises(BenchmarkError, match=rf"{DATASET_FILE}:1: a line over the [\d,]+-byte limit"):
        load_swe_instances(tmp_path)


def test_a_verifier_reward_nested_past_the_stack_is_one_line() -> None:
    with pytest.raises(BenchmarkError, match=r"^task t: reward '\[\[\[.*' is neither a number nor JSON$"):
        parse_reward(DEEP, "task t")
    assert parse_reward('{"reward": 0.5}', "task t") == 0.5


def test_a_500mb_answer_is_read_only_up_to_its_cap(tmp_path: Path) -> None:
    answer = tmp_path / "answer.txt"
    with answer.open("wb") as out:
        out.write(b"42\n")
        out.truncate(500_000_000)
    tracemalloc.start()
    try:
        text = workspace_text(answer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert text.startswith("42\n") and len(text) == SUBMISSION_MAX_BYTES
    assert peak < 3 * SUBMISSION_MAX_BYTES, f"peak {peak:,} bytes"
    assert workspace_text(tmp_path / "absent") == "" and workspace_text(None) == ""


def test_a_workspace_bomb_is_graded_as_no_submission(
    tmp_path: Path, eval_env: EvalEnv, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "ds"
    data.mkdir()
    write_dsbench(data)
    ctx = eval_env.ctx
    answers = {"ds_00000001_question1": b"42\n", "ds_00000001_question2": b"B"}
    executor = BenchmarkExecutor(ctx, lambda r: {"answer.txt": answers[str(r.unit.task_id)]})
    real_one = executor._one

    def bomb_the_second(request):  # type: ignore[no-untyped-def]
        outcome = real_one(request)
        if str(request.unit.task_id).endswith("question2"):
            key = ctx.artifacts.key_of(outcome.artifacts["workspace"])
            ctx.artifacts.put_file(key, zero_bomb(tmp_path / "bomb.tar.gz", 3 << 30))
        return outcome

    executor._one = bomb_the_second  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="mass_ops.evaluation.benchmarks.scoring")
    result = run_benchmark_trial(ctx, DSBench(data), executor, "L1", 1, runner=None)
    assert [s.score for s in result.scores] == [1.0, 0.0]
    (line,) = [r.getMessage() for r in caplog.records if "graded without its workspace" in r.getMessage()]
    assert "ds_00000001_question2" in line and "bytes unpacked" in line and "\n" not in line
