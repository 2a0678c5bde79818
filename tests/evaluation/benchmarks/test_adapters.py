"""The four new adapters on tiny instances in each benchmark's own format (fixtures written here): SWE-bench graded
by the official `swebench` package from test logs, Terminal-Bench tasks read from Harbor task directories and their
verifier reward parsed, DSBench answers matched, AstaBench scores read from inspect-ai eval logs; a benchmark whose
grader needs a container stops before any agent time when none is available."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mass_ops.evaluation.benchmarks.asta import AstaE2EHard, score_from_inspect_log
from mass_ops.evaluation.benchmarks.dsbench import DSBench, answers_match
from mass_ops.evaluation.benchmarks.grading import (
    RESULT_BEGIN,
    RESULT_END,
    ContainerEngineMissingError,
    GraderJob,
)
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError, task_seed
from mass_ops.evaluation.benchmarks.suite import run_benchmark_trial
from mass_ops.evaluation.benchmarks.swe import SWEBench, grade_log, grader_job
from mass_ops.evaluation.benchmarks.tb2 import TerminalBench2, load_tb2_tasks, parse_reward
from tests.evaluation.fakes import BenchmarkExecutor

EVAL_SCRIPT = "\n".join(
    [
        "#!/bin/bash",
        "set -uxo pipefail",
        "cd /testbed",
        ": '>>>>> Start Test Output'",
        "pytest -rA tests/test_calc.py",
        ": '>>>>> End Test Output'",
        "git checkout HEAD -- tests/test_calc.py",
    ]
)
SWE_INSTANCE = {
    "instance_id": "calc__calc-1",
    "repo": "calc/calc",
    "base_commit": "abc123",
    "problem_statement": "add() drops negative numbers",
    "version": "1.0",
    "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_negative"]),
    "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_positive"]),
    "image": "registry.local/swebench/calc-1:latest",
    "log_parser": "parse_log_pytest",
    "eval_type": "pass_and_fail",
    "eval_script": EVAL_SCRIPT,
}
PATCH = "--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-def add(a, b): return abs(a) + b\n+def add(a, b): return a + b\n"


def swe_log(negative: str, exit_code: int) -> str:
    body = "\n".join(
        [
            ">>>>> Applied Patch",
            "+ : '>>>>> Start Test Output'",
            "============ short test summary info ============",
            f"{negative} tests/test_calc.py::test_negative",
            "PASSED tests/test_calc.py::test_positive",
            "+ : '>>>>> End Test Output'",
            f">>>>> Test Exit Code: {exit_code}",
        ]
    )
    return f"{RESULT_BEGIN}\n{body}\n{RESULT_END}\n"


def test_swe_grading_uses_the_official_package():
    resolved, details = grade_log(SWE_INSTANCE, PATCH, swe_log("PASSED", 0))
    assert resolved == 1.0 and details["report"]["resolved"] is True
    assert details["report"]["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_calc.py::test_negative"]
    assert details["evaluator"].startswith("swebench ")
    unresolved, details = grade_log(SWE_INSTANCE, PATCH, swe_log("FAILED", 1))
    assert unresolved == 0.0 and details["report"]["patch_successfully_applied"] is True
    failed_apply = f"{RESULT_BEGIN}\n>>>>> Patch Apply Failed\n{RESULT_END}\n"
    assert grade_log(SWE_INSTANCE, PATCH, failed_apply)[1]["report"]["patch_successfully_applied"] is False
    empty, details = grade_log(SWE_INSTANCE, "", "")
    assert empty == 0.0 and details["report"]["patch_is_None"] is True


def test_swe_grader_job_runs_the_instance_image_with_patch_and_eval_script(tmp_path):
    job = grader_job(SWE_INSTANCE, PATCH)
    assert job.image == SWE_INSTANCE["image"]
    assert job.files["/tmp/mass_model.patch"] == PATCH.encode()
    assert b">>>>> Test Exit Code" in job.files["/tmp/mass_eval.sh"]  # swebench's own eval script rewrite
    (tmp_path / "SWE-bench_Verified.jsonl").write_text(json.dumps(SWE_INSTANCE) + "\n")
    [task] = SWEBench(tmp_path).tasks()
    assert task.name == "swe_calc__calc-1" and "add() drops negative numbers" in task.instruction
    assert task_seed("swe", 2, 0) == 3_100_000 + 4 * 10_000 + 2_000


def make_tb2_task(root: Path, name: str, reward_line: str = "echo 1 > /logs/verifier/reward.txt") -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "instruction.md").write_text(f"Create hello.txt for {name}.\n")
    (task / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 120.0\n'
        f'[agent]\ntimeout_sec = 600.0\n[environment]\ndocker_image = "registry.local/tb2/{name}:2.0"\n'
        "cpus = 2\nmemory_mb = 4096\n"
    )
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text(f"#!/bin/bash\ntest -f /app/hello.txt && {reward_line}\n")
    return task


class ScriptedRunner:
    """A container runner that returns `log_for(job)` and keeps the jobs it got."""

    def __init__(self, log_for):
        self.log_for = log_for
        self.jobs: list[GraderJob] = []

    def run(self, job: GraderJob) -> str:
        self.jobs.append(job)
        return self.log_for(job)


def test_tb2_reads_harbor_tasks_and_verifier_rewards(tmp_path, eval_env):
    make_tb2_task(tmp_path, "hello-world")
    make_tb2_task(tmp_path, "fix-git")
    [_fix, hello] = load_tb2_tasks(tmp_path)
    assert (hello.image, hello.agent_timeout_s, hello.verifier_timeout_s, hello.cpus, hello.memory) == (
        "registry.local/tb2/hello-world:2.0",
        600.0,
        120.0,
        2.0,
        "4096m",
    )
    adapter = TerminalBench2(tmp_path)
    tasks = adapter.tasks()
    assert [(t.name, t.index, t.time_limit_s) for t in tasks] == [
        ("tb2_fix-git", 0, 600.0),
        ("tb2_hello-world", 1, 600.0),
    ]
    assert parse_reward("0.5\n", "x") == 0.5 and parse_reward('{"reward": 1}', "x") == 1.0
    with pytest.raises(BenchmarkError, match="not a finite number"):
        parse_reward('{"reward": "yes"}', "x")
    runner = ScriptedRunner(
        lambda job: f"noise\n{RESULT_BEGIN}\n{'1' if 'hello' in job.instance else '0'}\n{RESULT_END}\n"
    )
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {"hello.txt": b"hi"})
    result = run_benchmark_trial(eval_env.ctx, adapter, executor, "L1", 0, runner=runner)
    assert [(s.task, s.score) for s in result.scores] == [("tb2_fix-git", 0.0), ("tb2_hello-world", 1.0)]
    assert runner.jobs[0].files["/tests/test.sh"].startswith(b"#!/bin/bash")
    assert result.metrics["attempted"] == 2 and result.metrics["scored"] == 2
    assert "Harbor task format" in result.metrics["evaluator"]
    seeds = [e.seed for e in eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id, kind="benchmark")]
    assert seeds == [3_100_000, 3_100_001]  # tb2 is benchmark index 0


def test_container_benchmark_stops_before_agent_time_without_an_engine(tmp_path, eval_env):
    make_tb2_task(tmp_path, "hello-world")
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {})
    with pytest.raises(ContainerEngineMissingError, match="no episode was started"):
        run_benchmark_trial(eval_env.ctx, TerminalBench2(tmp_path), executor, "L1", 0, runner=None)
    assert executor.executed == []
    assert eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id, kind="benchmark") == []


def write_dsbench(root: Path) -> None:
    (root / "data" / "00000001").mkdir(parents=True)
    rows = [{"id": "00000001", "name": "sales", "questions": ["question1", "question2"], "answers": ["42.0", "B"]}]
    (root / "data.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "data" / "00000001" / "question1.txt").write_text("What is the total?")
    (root / "data" / "00000001" / "question2.txt").write_text("Which option? A, B or C")
    (root / "data" / "00000001" / "sales.xlsx").write_bytes(b"PK")


def test_dsbench_questions_and_answer_matching(tmp_path, eval_env):
    write_dsbench(tmp_path)
    assert answers_match("42", "42.0") and answers_match("1,000", "1000.4") and answers_match("b.", "B")
    assert not answers_match("43", "42.0") and not answers_match("", "") and answers_match("50%", "0.5")
    adapter = DSBench(tmp_path)
    tasks = adapter.tasks()
    assert [t.name for t in tasks] == ["ds_00000001_question1", "ds_00000001_question2"]
    assert "sales.xlsx" in tasks[0].instruction
    answers = {"ds_00000001_question1": b"42\n", "ds_00000001_question2": b"C"}
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {"answer.txt": answers[str(r.unit.task_id)]})
    result = run_benchmark_trial(eval_env.ctx, adapter, executor, "L1", 1, runner=None)
    assert [s.score for s in result.scores] == [1.0, 0.0] and result.mean == 0.5
    assert [e.seed for e in eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id, kind="benchmark")] == [
        3_121_000,
        3_121_001,  # ds is benchmark index 2, trial 1
    ]


INSPECT_LOG = {
    "version": 2,
    "status": "success",
    "eval": {"task": "astabench/e2e_bench_hard", "packages": {"astabench": "0.5.4", "inspect_ai": "0.3.203"}},
    "samples": [
        {"id": "e2e-1", "epoch": 1, "scores": {"score_rubric": {"value": 0.25, "explanation": "partial"}}},
        {"id": "e2e-2", "epoch": 1, "scores": {"score_rubric": {"value": "C"}}},
    ],
}


def test_asta_scores_come_from_inspect_logs(tmp_path, eval_env):
    assert score_from_inspect_log(INSPECT_LOG, "e2e-1") == (0.25, "astabench 0.5.4, inspect_ai 0.3.203")
    with pytest.raises(BenchmarkError, match="not a finite number"):
        score_from_inspect_log(INSPECT_LOG, "e2e-2")
    with pytest.raises(BenchmarkError, match="no such sample"):
        score_from_inspect_log(INSPECT_LOG, "e2e-9")
    with pytest.raises(BenchmarkError, match="not 'success'"):
        score_from_inspect_log({**INSPECT_LOG, "status": "error"}, "e2e-1")
    (tmp_path / "e2e_bench_hard.jsonl").write_text(json.dumps({"id": "e2e-1", "input": "Study X end to end."}) + "\n")
    adapter = AstaE2EHard(tmp_path, image="registry.local/astabench:0.5.4", score_command="asta-score")
    runner = ScriptedRunner(lambda job: f"{RESULT_BEGIN}\n{json.dumps(INSPECT_LOG)}\n{RESULT_END}\n")
    executor = BenchmarkExecutor(eval_env.ctx, lambda r: {"report.md": b"# findings"})
    result = run_benchmark_trial(eval_env.ctx, adapter, executor, "L1", 0, runner=runner)
    assert [(s.task, s.score) for s in result.scores] == [("asta_e2e-1", 0.25)]
    assert runner.jobs[0].image == "registry.local/astabench:0.5.4" and "--sample-id e2e-1" in runner.jobs[0].script
