"""Benchmark adapters on tiny fixture datasets: ScienceAgentBench (official evaluator when installed — here its
stand-in under fixtures/sab_harness — else a clear "not installed" error) and the MLR-Bench subset (two rubric
judges required, missing or short paper scores 0), mean ± sample SD over trials (MASS_SPEC §10, §11)."""

from __future__ import annotations

import json
import statistics

import pytest

from mass_ops.evaluation.benchmarks import (
    BenchmarkError,
    EvaluatorNotInstalledError,
    SABEvaluator,
    TaskScore,
    TrialResult,
    load_mlr_tasks,
    load_overall_rubric,
    load_sab_instances,
    mean_sd,
    mlr_tasks,
    record_trial,
    recorded_trials,
    run_trial,
    sab_tasks,
    score_mlr_trial,
    score_sab_trial,
    summarize_mlr,
    summarize_trials,
)
from mass_ops.evaluation.benchmarks.mlr import MIN_PAPER_BYTES, MLR_SUBSET, parse_review
from mass_ops.evaluation.benchmarks.sab import EVALUATOR_ENV, collect_predictions
from mass_ops.evaluation.external import open_external_judge
from mass_ops.llm import RetryPolicy
from mass_ops.seeds import benchmark_seed
from tests.evaluation.fakes import FIXTURES, AnthropicStandIn, BenchmarkExecutor
from tests.policy_server import ChatRequest, PolicyReply, ResearchTeamPolicy

SAB_ROOT = FIXTURES / "sab"
MLR_ROOT = FIXTURES / "mlr"
MLR_NAMES = ("neurips2024_opt", "iclr2023_dg", "iclr2024_gem")


# -- ScienceAgentBench -------------------------------------------------------------------------------------------------


def sab_workspace(request) -> dict[str, bytes]:
    """sab_1: a program writing the expected output (through /workspace paths); sab_2: a program that writes
    something else; sab_3: no program at all."""
    task = str(request.unit.task_id)
    if task == "sab_1":
        code = "import json\njson.dump({'rmse': 0.4}, open('/workspace/pred_results/solubility_rmse.json', 'w'))\n"
        return {"pred_programs/pred_solubility_rmse.py": code.encode()}
    if task == "sab_2":
        return {"pred_programs/pred_point_counts.py": b"print('counts')\n"}
    return {"notes.txt": b"gave up"}


def test_sab_fixture_loads_in_instance_order():
    instances = load_sab_instances(SAB_ROOT)
    assert [i.name for i in instances] == ["sab_1", "sab_2", "sab_3"]
    tasks = sab_tasks(instances)
    assert [(t.benchmark, t.name, t.index) for t in tasks] == [
        ("sab", "sab_1", 0),
        ("sab", "sab_2", 1),
        ("sab", "sab_3", 2),
    ]
    assert "pred_programs/pred_gc_content.py" in tasks[2].instruction and "pred_results/" in tasks[2].instruction
    assert "Domain knowledge" not in tasks[0].instruction
    assert "logS" in sab_tasks(instances, use_knowledge=True)[0].instruction


def test_sab_trial_runs_and_scores_through_the_evaluator(eval_env, tmp_path):
    ctx = eval_env.ctx
    instances = load_sab_instances(SAB_ROOT)
    executor = BenchmarkExecutor(ctx, sab_workspace, tokens_for=lambda r: 2000 + 1000 * int(r.unit.task_id[-1]))
    outcomes = run_trial(ctx, executor, sab_tasks(instances), "L1", 0)
    episodes = ctx.repo.episodes(ctx.cycle_id, kind="benchmark")
    assert [(e.task_id, e.seed, e.generation, e.condition) for e in episodes] == [
        (f"sab_{i + 1}", benchmark_seed("sab", 0, i), "L1", "sab_L1_t0") for i in range(3)
    ]
    assert episodes[0].seed == 3_110_000
    evaluator = SABEvaluator.locate(FIXTURES / "sab_harness")
    result = score_sab_trial(ctx, instances, outcomes, SAB_ROOT, generation="L1", trial=0, evaluator=evaluator)
    assert [(s.task, s.score) for s in result.scores] == [("sab_1", 1.0), ("sab_2", 0.0), ("sab_3", 0.0)]
    assert [s.details["valid_program"] for s in result.scores] == [1.0, 1.0, 0.0]
    assert result.metrics["SR"] == pytest.approx(1 / 3) and result.metrics["VER"] == pytest.approx(2 / 3)
    assert result.metrics["programs_found"] == 2 and result.mean == pytest.approx(1 / 3)
    # Recorded once; the same scores again are accepted, other scores refused.
    assert record_trial(ctx, result) == result
    assert record_trial(ctx, result) == result
    changed = TrialResult("sab", "L1", 0, result.scores[:2], result.metrics)
    with pytest.raises(BenchmarkError, match="already recorded with other scores"):
        record_trial(ctx, changed)
    assert recorded_trials(ctx, "sab") == [result]
    # A second trial reuses nothing of the first and shares seeds with other generations only.
    run_trial(ctx, executor, sab_tasks(instances), "L1", 1)
    assert benchmark_seed("sab", 1, 0) in {e.seed for e in ctx.repo.episodes(ctx.cycle_id, kind="benchmark")}
    assert len(executor.executed) == 6


def test_collected_programs_rewrite_workspace_paths_and_mark_missing_ones(tmp_path):
    instances = load_sab_instances(SAB_ROOT)
    workspace = tmp_path / "ws"
    (workspace / "pred_programs").mkdir(parents=True)
    (workspace / "pred_programs/pred_solubility_rmse.py").write_text("open('/workspace/pred_results/x.json')\n")
    (workspace / "pred_programs/pred_point_counts.py").write_text("   \n")
    found = collect_predictions(instances, {"sab_1": workspace, "sab_2": workspace, "sab_3": None}, tmp_path / "out")
    assert found == {"sab_1": True, "sab_2": False, "sab_3": False}
    assert (tmp_path / "out/pred_solubility_rmse.py").read_text() == "open('./pred_results/x.json')\n"
    assert (tmp_path / "out/pred_point_counts.py").read_text() == "ERROR"
    assert (tmp_path / "out/pred_gc_content.py").read_text() == "ERROR"


def test_sab_without_the_evaluator_is_a_clear_not_installed_error(eval_env, monkeypatch, tmp_path):
    monkeypatch.delenv(EVALUATOR_ENV, raising=False)
    instances = load_sab_instances(SAB_ROOT)
    outcomes = run_trial(eval_env.ctx, BenchmarkExecutor(eval_env.ctx, sab_workspace), sab_tasks(instances), "L0", 0)
    with pytest.raises(EvaluatorNotInstalledError, match="ScienceAgentBench evaluator not installed"):
        score_sab_trial(eval_env.ctx, instances, outcomes, SAB_ROOT, generation="L0", trial=0)
    with pytest.raises(EvaluatorNotInstalledError, match=r"run_evaluation\.py does not exist"):
        SABEvaluator.locate(tmp_path)
    monkeypatch.setenv(EVALUATOR_ENV, str(FIXTURES / "sab_harness"))
    assert SABEvaluator.locate().repo == (FIXTURES / "sab_harness").resolve()

    class ShortLog(SABEvaluator):
        def evaluate(self, benchmark_path, pred_dir, log_path, run_id):
            return [{"valid_program": 1, "codebert_score": 0.5, "success_rate": 1}] * 2

    with pytest.raises(BenchmarkError, match="logged 2 rows for 3 tasks"):
        score_sab_trial(eval_env.ctx, instances, outcomes, SAB_ROOT, generation="L0", trial=0,
                        evaluator=ShortLog(FIXTURES / "sab_harness"))  # fmt: skip
    command = SABEvaluator(FIXTURES / "sab_harness").command(SAB_ROOT / "benchmark", tmp_path, tmp_path / "l", "r")
    paths = [command[command.index(flag) + 1] for flag in ("--benchmark_path", "--pred_program_path", "--log_fname")]
    assert all(p.startswith("/") for p in paths)


def test_sab_sheet_problems_are_named(tmp_path):
    with pytest.raises(BenchmarkError, match=r"holds neither ScienceAgentBench\.jsonl"):
        load_sab_instances(tmp_path)
    (tmp_path / "ScienceAgentBench.jsonl").write_text(json.dumps({"instance_id": 1, "task_inst": "x"}) + "\n")
    with pytest.raises(BenchmarkError, match=r"row 1 lacks \['gold_program_name', 'output_fname'\]"):
        load_sab_instances(tmp_path)


# -- MLR-Bench ---------------------------------------------------------------------------------------------------------

PAPER = "# Title\n\n## Abstract\n" + "We study a shift-robust classifier on a synthetic benchmark. " * 8


def mlr_workspace(request) -> dict[str, bytes]:
    task = str(request.unit.task_id)
    if task == "iclr2023_dg":
        return {
            "results/paper.md": PAPER.encode(),
            "code/README.md": b"python run.py\n",
            "code/run.py": b"print('experiment')\n" * 20,
            "code/data.bin": b"\x00\x01",
        }
    if task == "iclr2024_gem":
        return {"results/paper.md": b"# Too short\n"}
    return {"idea.md": b"an idea, but no paper"}


class RubricPolicy(ResearchTeamPolicy):
    """Answers MLR rubric prompts with a fixed review (Overall 6); everything else as the research team."""

    def respond(self, request: ChatRequest) -> PolicyReply:
        if "# Rubric" in request.user_text():
            review = dict.fromkeys(("Clarity", "Novelty", "Soundness", "Significance"), 5)
            return PolicyReply(content=json.dumps({**review, "Overall": 6, "Confidence": 4, "justification": "ok"}))
        return super().respond(request)


def claude_reviews(overall: float) -> AnthropicStandIn:
    review = {"Clarity": 7, "Novelty": {"score": 6}, "Soundness": "7", "Significance": 6, "Overall": overall,
              "Confidence": 3}  # fmt: skip
    return AnthropicStandIn(lambda body: json.dumps(review))


def test_mlr_fixture_tasks_and_rubric_load():
    tasks = load_mlr_tasks(MLR_ROOT, MLR_NAMES)
    assert [t.name for t in tasks] == ["iclr2023_dg", "iclr2024_gem", "neurips2024_opt"]
    assert [(t.name, t.index) for t in mlr_tasks(tasks)] == [("iclr2023_dg", 0), ("iclr2024_gem", 1),
                                                             ("neurips2024_opt", 2)]  # fmt: skip
    assert "results/paper.md" in mlr_tasks(tasks)[0].instruction
    rubric = load_overall_rubric(MLR_ROOT)
    assert rubric.startswith("Score the submission from 1 (poor) to 10")
    with pytest.raises(BenchmarkError, match="lacks task descriptions for") as info:
        load_mlr_tasks(MLR_ROOT)
    assert len(MLR_SUBSET) == 12 and "iclr2024_dmlr" in str(info.value)


def test_mlr_trial_scores_with_two_judges_and_zero_without_a_paper(eval_env):
    ctx = eval_env.ctx
    eval_env.policy.base = RubricPolicy()
    tasks = load_mlr_tasks(MLR_ROOT, MLR_NAMES)
    executor = BenchmarkExecutor(ctx, mlr_workspace)
    outcomes = run_trial(ctx, executor, mlr_tasks(tasks), "L1", 0)
    stand_in = claude_reviews(8)
    gpt = open_external_judge(eval_env.config.evaluation.judges[0], max_tokens=16000)
    claude = open_external_judge(eval_env.config.evaluation.judges[1], http_client=stand_in.client(), max_tokens=16000)
    rubric = load_overall_rubric(MLR_ROOT)
    result = score_mlr_trial(ctx, tasks, outcomes, [gpt, claude], rubric, generation="L1", trial=0)
    scores = {s.task: s for s in result.scores}
    assert scores["iclr2023_dg"].score == pytest.approx((6 + 8) / 2)
    assert scores["iclr2023_dg"].details["reviews"]["claude-judge"]["Novelty"] == 6.0
    # A paper under 200 bytes and a missing paper score 0 on every criterion, without asking a judge.
    assert scores["iclr2024_gem"].score == 0.0 and scores["neurips2024_opt"].score == 0.0
    assert scores["iclr2024_gem"].details["reviews"]["gpt-judge"]["Overall"] == 0.0
    assert len(PAPER.encode()) >= MIN_PAPER_BYTES > len(b"# Too short\n")
    rubric_requests = [b for b in eval_env.judge_requests() if "# Rubric" in b["messages"][1]["content"]]
    assert len(rubric_requests) == 1 and len(stand_in.bodies) == 1
    prompt = rubric_requests[0]["messages"][1]["content"]
    assert PAPER.strip()[:40] in prompt and "code/run.py" in prompt and "data.bin" not in prompt
    assert rubric_requests[0]["max_completion_tokens"] == 16000
    assert result.metrics["papers_delivered"] == 1 and result.mean == pytest.approx(7 / 3)
    # Reviews are cached: scoring the trial again asks nobody.
    again = score_mlr_trial(ctx, tasks, outcomes, [gpt, claude], rubric, generation="L1", trial=0)
    assert again == result and len(stand_in.bodies) == 1
    # One judge is not enough.
    with pytest.raises(BenchmarkError, match="needs 2 judges, got 1"):
        score_mlr_trial(ctx, tasks, outcomes, [gpt], rubric, generation="L1", trial=0)


def test_mlr_missing_judge_review_is_an_error_when_summarizing(eval_env):
    ctx = eval_env.ctx
    eval_env.policy.base = RubricPolicy()
    tasks = load_mlr_tasks(MLR_ROOT, MLR_NAMES)
    outcomes = run_trial(ctx, BenchmarkExecutor(ctx, mlr_workspace), mlr_tasks(tasks), "L0", 0)
    prose = AnthropicStandIn(lambda body: "No JSON, just thoughts.")
    gpt = open_external_judge(eval_env.config.evaluation.judges[0])
    claude = open_external_judge(eval_env.config.evaluation.judges[1], http_client=prose.client(),
                                 retry=RetryPolicy(max_attempts=1))  # fmt: skip
    result = score_mlr_trial(ctx, tasks, outcomes, [gpt, claude], load_overall_rubric(MLR_ROOT), generation="L0",
                             trial=0)  # fmt: skip
    assert len(prose.bodies) == 3  # three attempts, all unusable
    dg = next(s for s in result.scores if s.task == "iclr2023_dg")
    assert dg.score is None and dg.details["missing_judges"] == ["claude-judge"]
    with pytest.raises(BenchmarkError, match="iclr2023_dg is missing a judge"):
        summarize_mlr([result])


def test_mean_and_sample_sd_over_trials():
    def trial(number: int, scores: list[float]) -> TrialResult:
        return TrialResult("mlr", "L1", number, tuple(TaskScore(f"t{i}", s, i) for i, s in enumerate(scores)))

    results = [trial(0, [2.0, 4.0]), trial(1, [3.0, 3.0]), trial(2, [6.0, 2.0])]
    summary = summarize_trials(results)
    assert summary.per_trial == {0: 3.0, 1: 3.0, 2: 4.0}
    assert summary.mean == pytest.approx(10 / 3)
    assert summary.sd == pytest.approx(statistics.stdev([3.0, 3.0, 4.0]))  # n - 1 in the denominator
    assert summary.sd == pytest.approx((1 / 3) ** 0.5)
    assert mean_sd([0.5]) == (0.5, None)
    with pytest.raises(BenchmarkError, match="repeat"):
        summarize_trials([results[0], results[0]])
    with pytest.raises(BenchmarkError, match="have no score"):
        summarize_trials([trial(0, [1.0]), TrialResult("mlr", "L1", 1, (TaskScore("t0", None),))])
    # The reference fixture: a SAB trial where half the tasks succeed has mean 0.5.
    sab = TrialResult("sab", "L1", 0, tuple(TaskScore(f"sab_{i}", float(i % 2), i) for i in range(1, 103)))
    assert sab.mean == 0.5


def test_reviews_are_validated():
    good = {"Clarity": 5, "Novelty": 5, "Soundness": 5, "Significance": 5, "Overall": 5, "Confidence": 3}
    assert parse_review(good)["Overall"] == 5.0
    with pytest.raises(ValueError, match="Overall"):
        parse_review({**good, "Overall": "high"})
    with pytest.raises(ValueError, match="outside 0-5"):
        parse_review({**good, "Confidence": 9})
