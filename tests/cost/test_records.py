"""`cost.records.StageUsage`: the one per-stage record of tokens, cost, GPU-hours and wall-clock that the estimate,
the report and the status carry, and the flat JSON each keeps printing."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from mass_ops.cost.estimate import StageEstimate, total_of
from mass_ops.cost.records import StageUsage
from mass_ops.evaluation.report.model import EstimateRow, StageCost
from mass_ops.ops.status import StageStatus


def test_usage_adds_every_figure_and_totals_tokens_and_gpu_hours() -> None:
    a = StageUsage(100, 20, 1.5, 2.0, 0.5, 60.0)
    b = StageUsage(prompt_tokens=1, completion_tokens=2, cost_usd=0.25, training_gpu_hours=1.0, wall_clock_s=30.0)
    total = a + b
    assert total == StageUsage(101, 22, 1.75, 2.0, 1.5, 90.0)
    assert (total.tokens, total.gpu_hours) == (123, 3.5)
    assert StageUsage() + a == a
    with pytest.raises(FrozenInstanceError):
        a.cost_usd = 0.0  # type: ignore[misc]


def test_the_estimate_reads_its_figures_through_its_usage_and_prints_them_flat() -> None:
    usage = StageUsage(1_000, 200, 3.0, 1.25, 0.75, 7_200.0)
    stage = StageEstimate("collect", usage, episodes=4, llm_calls=2, prompt_tokens_sd=10, completion_tokens_sd=5)
    assert (stage.prompt_tokens, stage.tokens, stage.gpu_hours, stage.wall_clock_s, stage.cost_usd) == (
        1_000, 1_200, 2.0, 7_200.0, 3.0
    )  # fmt: skip
    assert list(stage.as_dict().items()) == [
        ("stage", "collect"), ("episodes", 4), ("llm_calls", 2), ("prompt_tokens", 1_000), ("completion_tokens", 200),
        ("prompt_tokens_sd", 10), ("completion_tokens_sd", 5), ("serving_gpu_hours", 1.25),
        ("training_gpu_hours", 0.75), ("wall_clock_s", 7_200.0), ("cost_usd", 3.0), ("source", "default"),
    ]  # fmt: skip
    total = total_of([stage, StageEstimate("train", StageUsage(training_gpu_hours=2.0, wall_clock_s=100.0))])
    assert total.usage == StageUsage(1_000, 200, 3.0, 1.25, 2.75, 7_300.0)


def test_the_report_and_the_status_carry_the_same_record() -> None:
    usage = StageUsage(500, 50, 0.5, serving_gpu_hours=0.25, wall_clock_s=90.0)
    cost = StageCost("search", usage, calls=3, episodes=1, busy_s=120.0)
    assert (cost.span_s, cost.gpu_hours, cost.prompt_tokens, cost.completion_tokens) == (90.0, 0.25, 500, 50)
    status = StageStatus("search", 2, 1, 0, 0, 1, 0, True, usage=usage, elapsed_s=10.0)
    assert (status.tokens, status.cost_usd) == (550, 0.5)
    row = status.as_dict()
    assert list(row)[8:] == ["prompt_tokens", "completion_tokens", "cost_usd", "elapsed_s", "eta_s", "note", "tokens"]
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_usd"], row["tokens"]) == (500, 50, 0.5, 550)
    assert "usage" not in row and "gpu_hours" not in row


def test_the_report_sets_the_estimated_usage_beside_the_actual() -> None:
    row = EstimateRow("collect", StageUsage(100_000, 20_000, 4.5, 1.5, 0.0), StageUsage(90_000, 12_000, 1.0, 0.5))
    assert (row.estimated_tokens, row.actual_tokens, row.estimated_gpu_hours, row.actual_gpu_hours) == (
        120_000, 102_000, 1.5, 0.5
    )  # fmt: skip
    assert (row.estimated_usd, row.actual_usd, row.token_ratio) == (4.5, 1.0, 120_000 / 102_000)
    unestimated = EstimateRow("rank", None, StageUsage())
    assert (unestimated.estimated_tokens, unestimated.estimated_usd, unestimated.token_ratio) == (None, None, None)


def test_total_usage_adds_the_records_usages_and_is_zero_for_none():
    from types import SimpleNamespace

    from mass_ops.cost.records import StageUsage, total_usage

    a = SimpleNamespace(usage=StageUsage(10, 5, 0.5, 1.0, 0.0, 60.0))
    b = SimpleNamespace(usage=StageUsage(1, 2, 0.25, 0.0, 2.0, 30.0))
    assert total_usage([a, b]) == StageUsage(11, 7, 0.75, 1.0, 2.0, 90.0)
    assert total_usage([]) == StageUsage()
