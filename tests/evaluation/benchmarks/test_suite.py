"""A benchmark trial interrupted mid-trial resumes without re-running or re-grading finished instances."""

from __future__ import annotations

import pytest

from mass_ops.evaluation.benchmarks.dsbench import DSBench
from mass_ops.evaluation.benchmarks.scoring import recorded_trials
from mass_ops.evaluation.benchmarks.suite import run_benchmark_trial
from tests.evaluation.benchmarks.test_adapters import write_dsbench
from tests.evaluation.fakes import BenchmarkExecutor


class Interrupted(Exception):
    """Stands in for the worker dying mid-trial."""


class CountingDSBench(DSBench):
    """DSBench that counts gradings and can die while grading one task."""

    graded: list[str]
    die_on: str | None

    def grade(self, task, workspace, runner):
        if task.name == self.die_on:
            raise Interrupted(task.name)
        self.graded.append(task.name)
        return super().grade(task, workspace, runner)


def test_interrupted_trial_resumes_without_rerunning_finished_instances(tmp_path, eval_env):
    write_dsbench(tmp_path)
    adapter = CountingDSBench(tmp_path)
    object.__setattr__(adapter, "graded", [])
    object.__setattr__(adapter, "die_on", "ds_00000001_question2")
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {"answer.txt": b"42"})
    with pytest.raises(Interrupted):
        run_benchmark_trial(eval_env.ctx, adapter, executor, "L1", 0, runner=None)
    assert adapter.graded == ["ds_00000001_question1"]
    assert recorded_trials(eval_env.ctx) == []  # nothing half-recorded for the trial
    first_run = list(executor.executed)
    assert len(first_run) == 2  # question2's episode ran; its grading died

    object.__setattr__(adapter, "die_on", None)
    resumed = BenchmarkExecutor(eval_env.ctx, lambda r: {"answer.txt": b"42"})
    result = run_benchmark_trial(eval_env.ctx, adapter, resumed, "L1", 0, runner=None)
    assert adapter.graded == ["ds_00000001_question1", "ds_00000001_question2"]  # question1 not graded again
    assert resumed.executed == []  # question1 skipped by its recorded score, question2's episode reused
    assert [s.score for s in result.scores] == [1.0, 0.0]
    assert [r.trial for r in recorded_trials(eval_env.ctx)] == [0]
