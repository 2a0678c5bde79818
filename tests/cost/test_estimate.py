"""The pre-run estimate: per-stage figures of the paper preset computed by hand from its counts and the default
tables, the same estimate in `plan --json`, lineage figures measured on a seeded parent cycle, and the budget check."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.config import load_config
from mass_ops.cost.estimate import DEFAULT_FIGURES, DEFAULT_TRAIN_STEP_S, check_budget
from mass_ops.ops.plan import build_plan, cycle_estimate
from mass_ops.train.plan import training_command_for
from tests.inner_loop_fakes import migrated_sqlite

PAPER = ["tasks.catalogue=builtin", "storage.metadata_url=sqlite:///does-not-exist/mass.db"]


def paper(*extra: str):
    config = load_config("paper", [*PAPER, *extra])
    return config, build_plan(config, training_command_for(config))


def test_paper_estimate_matches_a_hand_computation_from_the_preset_counts() -> None:
    config, plan = paper()
    estimate = cycle_estimate(config, plan)
    ep, judge, opt, ext = (DEFAULT_FIGURES[k] for k in ("episode", "judge", "optimizer", "external_judge"))
    # search: 9 tasks x (reference + 12 versions); 9 x 12 baseline + 9 x 11 arbitration judge calls; 99 proposals.
    search = estimate.stage("search")
    assert (search.episodes, search.llm_calls) == (117, 108 + 99 + 99)
    assert search.prompt_tokens == 117 * ep.prompt_tokens + 207 * judge.prompt_tokens + 99 * opt.prompt_tokens
    assert search.completion_tokens == 117 * 40_000 + 207 * 3_000 + 99 * 8_000
    busy = 117 * ep.seconds + 207 * judge.seconds + 99 * opt.seconds
    assert search.wall_clock_s == pytest.approx(busy / 4)  # 4 requests in flight on one GPU
    assert search.serving_gpu_hours == pytest.approx(busy / 4 / 3600 * 1)
    assert search.cost_usd == pytest.approx(busy / 4 / 3600 * 3.0)  # self-hosted: 3 USD per GPU-hour, no token price
    collect = estimate.stage("collect")
    assert (collect.episodes, collect.prompt_tokens) == (8 * 18, 144 * 2_000_000)
    assert collect.cost_usd == pytest.approx(144 * 2400 / 4 / 3600 * 3.0)
    train = estimate.stage("train")
    assert train.training_gpu_hours == pytest.approx(1624 * DEFAULT_TRAIN_STEP_S / 3600 * 3)  # 3 training ranks
    assert train.cost_usd == pytest.approx(1624 * 60 / 3600 * 3 * 3.0)
    evaluate = estimate.stage("evaluate")
    # 11 tasks x 10 rollouts for each of L1 and L0; 110 self-judge calls; 110 pairs x 2 judges x 3 seeds external.
    assert (evaluate.episodes, evaluate.llm_calls) == (220, 110 + 660)
    assert evaluate.prompt_tokens == 220 * ep.prompt_tokens + 110 * judge.prompt_tokens + 660 * ext.prompt_tokens
    assert estimate.unpriced_models == ["claude-opus-4-8", "gpt-5.5"]
    assert estimate.total.cost_usd == pytest.approx(sum(s.cost_usd for s in estimate.stages))


def test_api_judge_prices_are_charged_per_token() -> None:
    config, plan = paper("prices.models={gpt-5.5: {prompt_per_million: 2.0, completion_per_million: 10.0}}")
    base = cycle_estimate(paper()[0], plan).stage("evaluate")
    priced = cycle_estimate(config, plan)
    judged = 330 * 30_000 * 2.0 / 1e6 + 330 * 6_000 * 10.0 / 1e6
    assert priced.stage("evaluate").cost_usd == pytest.approx(base.cost_usd + judged)
    assert priced.unpriced_models == ["claude-opus-4-8"]


def test_plan_prints_the_estimate_and_carries_it_in_json() -> None:
    runner = CliRunner()
    args = ["plan", "--config", "paper", *(a for o in PAPER for a in ("--set", o))]
    shown = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "Estimate per stage" in shown.output
    assert "615.16" in shown.output  # the total in USD of the hand computation's figures
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    total = data["estimate"]["total"]
    assert (total["episodes"], total["llm_calls"]) == (117 + 144 + 220, 306 + 432 + 770)
    assert total["training_gpu_hours"] == pytest.approx(81.2)


def test_lineage_figures_come_from_the_parent_generations_cycle(tmp_path) -> None:
    from mass_ops.store.repository import MetadataRepository

    url = migrated_sqlite(tmp_path / "meta.db")
    repo = MetadataRepository.from_url(url)
    parent = repo.ensure_cycle("paper-L0", {"x": 1}, "a" * 64)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for i, (prompt, completion) in enumerate([(1_000, 100), (3_000, 300)]):
        repo.record_episode(parent.id, task_id=51, kind="collection", seed=i, candidate=i, status="succeeded",
                            prompt_tokens=prompt, completion_tokens=completion, started_at=start,
                            finished_at=start + timedelta(seconds=600))  # fmt: skip
    repo.record_episode(parent.id, task_id=51, kind="collection", seed=9, candidate=9, status="infra_failure",
                        prompt_tokens=10**9, completion_tokens=0)  # fmt: skip
    for i, tokens in enumerate([200, 400]):
        repo.record_llm_call(parent.id, f"call{i}", purpose="self_judge", model="L0", prompt_tokens=tokens,
                             completion_tokens=10, latency_s=30.0)  # fmt: skip
    repo.register_generation("L1", 1, cycle_id=parent.id, bf16_uri="models/L1-bf16")
    config = load_config("paper", ["tasks.catalogue=builtin", f"storage.metadata_url={url}", "generation=1"])
    estimate = cycle_estimate(config, build_plan(config, training_command_for(config)))
    assert estimate.lineage_cycle == "paper-L0"
    collect = estimate.stage("collect")
    assert collect.source == "lineage"
    # mean 2,000 prompt tokens (stdev 1,414.2 of the two samples; the infra failure is left out) over 144 episodes
    assert collect.prompt_tokens == 144 * 2_000
    assert collect.prompt_tokens_sd == round(12 * 1414.2135623730951)
    assert collect.wall_clock_s == pytest.approx(144 * 600 / 4)
    assert estimate.stage("rank").prompt_tokens == estimate.stage("rank").llm_calls * 300
    assert estimate.stage("search").source == "default+lineage"  # episodes and judges measured, optimizer not


def test_budget_check_names_each_budget_exceeded() -> None:
    config, plan = paper()
    estimate = cycle_estimate(config, plan)
    assert check_budget(estimate, None, None).problems == []
    check = check_budget(estimate, 100.0, 10**12)
    assert check.over_budget
    assert check.problems == ["estimated cost 615.16 USD exceeds budgets.cycle_cost_usd 100.00 USD"]
