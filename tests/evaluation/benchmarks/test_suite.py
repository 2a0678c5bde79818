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


def test_each_episode_runs_under_its_tasks_official_time_limit_which_is_recorded(tmp_path, eval_env):
    import contextlib
    import dataclasses

    from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END
    from mass_ops.evaluation.benchmarks.tb2 import TerminalBench2
    from tests.evaluation.benchmarks.test_adapters import make_tb2_task

    make_tb2_task(tmp_path, "hello-world")  # task.toml: [agent] timeout_sec = 600.0
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {"hello.txt": b"hi"})
    limits: list[int | None] = []

    @contextlib.contextmanager
    def executor_for(ctx):
        limits.append(ctx.config.runtime.episode_wall_clock_s)  # what the runtime stops the agent at
        yield executor

    class Runner:
        def run(self, job):
            return f"{RESULT_BEGIN}\n1\n{RESULT_END}"

    runtime = eval_env.ctx.config.runtime
    for configured, expected in ((None, (600, "benchmark")), (7200, (600, "benchmark")), (300, (300, "config"))):
        config = eval_env.ctx.config.model_copy(
            update={"runtime": runtime.model_copy(update={"episode_wall_clock_s": configured})}
        )
        ctx = dataclasses.replace(eval_env.ctx, config=config)
        trial = {None: 0, 7200: 1, 300: 2}[configured]
        result = run_benchmark_trial(ctx, TerminalBench2(tmp_path), executor_for, "L1", trial, runner=Runner())
        assert limits[-1] == expected[0]
        [score] = result.scores
        assert (score.details["time_limit_s"], score.details["time_limit_source"]) == expected


def test_a_grading_split_around_a_grader_job_records_once_and_only_for_the_same_job(tmp_path, eval_env):
    from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END, grader_bundle
    from mass_ops.evaluation.benchmarks.scoring import BenchmarkError
    from mass_ops.evaluation.benchmarks.suite import (
        PendingGrading,
        finish_instance,
        fixed_executor,
        instance_key,
        pending_key,
        prepare_instance,
        record_benchmark_trial,
    )
    from mass_ops.evaluation.benchmarks.tb2 import TerminalBench2
    from tests.evaluation.benchmarks.test_adapters import make_tb2_task

    ctx = eval_env.ctx
    make_tb2_task(tmp_path, "hello-world")
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()
    executor = BenchmarkExecutor(ctx, lambda r: {"hello.txt": b"hi", "bin/run.sh": b"echo"})
    pending = prepare_instance(ctx, adapter, fixed_executor(executor), "L1", 0, task)
    assert isinstance(pending, PendingGrading) and pending.job.image == "registry.local/tb2/hello-world:2.0"
    # The bundle the grader Job fetches is stored under the URI and SHA-256 the Job is given.
    assert ctx.artifacts.get_bytes(ctx.artifacts.key_of(pending.bundle_uri)) == grader_bundle(pending.job)
    assert not ctx.artifacts.exists(instance_key(ctx, "tb2", "L1", 0, task.name))
    # Preparing again (a retry) reuses the episode and yields the same job.
    again = prepare_instance(ctx, adapter, fixed_executor(executor), "L1", 0, task)
    assert again.job_sha256 == pending.job_sha256 and len(executor.executed) == 1

    scored = finish_instance(ctx, adapter, "L1", 0, task, f"verifier output\n{RESULT_BEGIN}\n0.5\n{RESULT_END}")
    assert scored.score == 0.5 and scored.details["evaluator"].startswith("terminal-bench 2.0")
    assert scored.details["time_limit_s"] == 600 and scored.details["grader_log"].endswith("tb2_hello-world.log")
    # A second result for the same instance changes nothing: recorded once.
    assert finish_instance(ctx, adapter, "L1", 0, task, f"{RESULT_BEGIN}\n1\n{RESULT_END}").score == 0.5
    result = record_benchmark_trial(ctx, adapter, "L1", 0, evaluator=adapter.evaluator(), limit=None)
    assert [s.score for s in result.scores] == [0.5]

    # A pending grading whose job no longer matches (its inputs changed) is refused, not graded.
    changed = ctx.artifacts.get_json(pending_key(ctx, "tb2", "L1", 0, task.name))
    ctx.artifacts.put_json(pending_key(ctx, "tb2", "L1", 1, task.name), {**changed, "job_sha256": "0" * 64})
    with pytest.raises(BenchmarkError, match="asks for another job"):
        finish_instance(ctx, adapter, "L1", 1, task, f"{RESULT_BEGIN}\n1\n{RESULT_END}")
