"""Nightly re-evaluation: its own cycle, tonight's targets and servers, results keyed by (logical date, generation)
with fresh rollouts every night that a rerun of the night reuses, and the regression check against the floor and
the previous night using tonight's interval (hand-built evaluation rows for the latter)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mass_ops.config import CycleConfig, validate_config
from mass_ops.context import CycleContext
from mass_ops.evaluation.rollouts import ROLLOUT_SET_KIND
from mass_ops.layout import PAIRWISE_KIND
from mass_ops.serving import ServingError
from mass_ops.stages import api as stages
from mass_ops.stages.nightly import (
    NIGHTLY_SCOPE,
    NightlyError,
    check_regression,
    nightly_config,
    nightly_evaluate,
    nightly_targets,
    served_generations,
)
from tests.evaluation.fakes import (
    CLAUDE_JUDGE,
    GPT_JUDGE,
    AnthropicStandIn,
    EvalEnv,
    RecordingExecutors,
    judge_with,
    prefer_generation,
    route_anthropic_judges,
    serve_generation_stand_ins,
    user_text_of,
    verdict_text,
)
from tests.inner_loop_fakes import migrated_sqlite, open_test_cycle

NIGHT_1 = "2026-11-30T03:00:00+00:00"
NIGHT_2 = "2026-12-01T03:00:00+00:00"


def with_evaluation(config: CycleConfig, **evaluation: Any) -> CycleConfig:
    data = config.model_dump(mode="json")
    data["evaluation"].update(evaluation)
    return validate_config(data)


def pairwise_rows(ctx: CycleContext) -> list[Any]:
    return [row for row in ctx.repo.evaluations(kind=PAIRWISE_KIND) if row.cycle_id == ctx.cycle_id]


# -- the nightly cycle, targets and servers --------------------------------------------------------------------------


def test_nightly_results_have_their_own_cycle_named_after_the_settings(eval_env):
    config = nightly_config(eval_env.config)
    assert config.cycle_name == f"nightly-{eval_env.config.config_hash()[:10]}"
    assert nightly_config(eval_env.config).cycle_name == config.cycle_name  # the same settings, the same cycle
    changed = with_evaluation(eval_env.config, regression_threshold=0.2)
    assert nightly_config(changed).cycle_name not in (config.cycle_name, eval_env.config.cycle_name)
    # Only the name differs from the settings it was made from.
    assert config.model_dump(exclude={"name"}) == eval_env.config.model_dump(exclude={"name"})
    ctx = open_test_cycle(config)
    assert ctx.cycle_id != eval_env.ctx.cycle_id and ctx.repo.get_cycle(config.cycle_name).id == ctx.cycle_id


def test_targets_are_the_newest_generation_once_it_has_a_parent(eval_env):
    data = eval_env.config.model_dump(mode="json")
    data["storage"]["metadata_url"] = migrated_sqlite(eval_env.tmp / "fresh.db")  # no generation registered yet
    ctx = open_test_cycle(nightly_config(validate_config(data)))
    repo = ctx.repo
    assert nightly_targets(ctx) == []
    base = repo.register_generation("L0", 0, bf16_uri="models/L0-bf16")
    assert nightly_targets(ctx) == []  # the base model alone: nothing to compare with
    child = repo.register_generation("L1", 1, bf16_uri="models/L1-bf16", parent_id=base.id)
    assert nightly_targets(ctx) == ["L1"]
    repo.register_generation("L2", 2, bf16_uri="models/L2-bf16", parent_id=child.id)
    assert nightly_targets(ctx) == ["L2"]

    # Tonight's servers: each evaluated generation and its parent, each once.
    assert served_generations(ctx, ["L2"]) == ["L2", "L1"]
    assert served_generations(ctx, ["L2", "L1"]) == ["L2", "L1", "L0"]
    assert served_generations(ctx, ["L1", "L1"]) == ["L1", "L0"]
    assert served_generations(ctx, []) == []
    with pytest.raises(NightlyError, match=r"^nightly: generation L0 has no registered parent to compare with$"):
        served_generations(ctx, ["L0"])
    with pytest.raises(ServingError, match=r"generation 'L9' is not registered"):
        served_generations(ctx, ["L2", "L9"])


def test_the_nightly_stage_functions_open_the_nightly_cycle(eval_env):
    assert stages.nightly_targets(eval_env.config) == ["L1"]
    assert stages.nightly_serving(eval_env.config, ["L1"]) == ["L1", "L0"]
    nightly = eval_env.ctx.repo.get_cycle(nightly_config(eval_env.config).cycle_name)
    assert nightly is not None and nightly.id != eval_env.ctx.cycle_id


# -- nightly_evaluate ------------------------------------------------------------------------------------------------


class Nightly:
    """The nightly cycle of the eval environment, L1 and L0 served by scripted servers in the nightly scope, every
    judge preferring L1's workspaces, and a recording executor factory."""

    def __init__(self, env: EvalEnv, monkeypatch: pytest.MonkeyPatch) -> None:
        self.env = env
        self.ctx = open_test_cycle(nightly_config(env.config))
        decide = prefer_generation(self.ctx, "L1")
        judge_with(env.policy, decide)
        self.claude = AnthropicStandIn(lambda body: verdict_text(decide(user_text_of(body))))
        route_anthropic_judges(monkeypatch, self.claude)
        self.executors = RecordingExecutors()
        self.servers: dict[str, Any] = {}

    def evaluate(self, date: str, generation: str = "L1") -> dict[str, Any]:
        return nightly_evaluate(self.ctx, generation, date, executor=self.executors)

    def judge_calls(self) -> dict[str, int]:
        return {
            GPT_JUDGE: len(self.env.judge_requests()),
            CLAUDE_JUDGE: len(self.claude.bodies),
            **{name: len(server.judge_requests()) for name, server in self.servers.items()},
        }

    def recorded(self) -> tuple[int, int, int]:
        """(episodes, external-ledger judgments, pairwise evaluations) of the nightly cycle."""
        ctx = self.ctx
        return (
            len(ctx.repo.episodes(ctx.cycle_id)),
            len(ctx.repo.comparisons(ctx.cycle_id, "external")),
            len(pairwise_rows(ctx)),
        )


@pytest.fixture
def nightly(eval_env: EvalEnv, tmp_path, monkeypatch) -> Iterator[Nightly]:
    monkeypatch.chdir(tmp_path)  # the servers' state files live under runs/ of the cwd
    night = Nightly(eval_env, monkeypatch)
    with serve_generation_stand_ins(NIGHTLY_SCOPE, ["L1", "L0"]) as servers:
        night.servers = servers
        judge_with(servers["L1"].policy, prefer_generation(night.ctx, "L1"))
        yield night


def test_each_night_samples_fresh_rollouts_once_and_a_rerun_reuses_them(nightly):
    ctx = nightly.ctx
    first = nightly.evaluate(NIGHT_1)
    assert {k: first[k] for k in ("generation", "baseline", "date", "win_rate")} == {
        "generation": "L1",
        "baseline": "L0",
        "date": "20261130T030000",
        "win_rate": 1.0,
    }
    assert first["evaluation"] == f"{ctx.cycle_name}/{PAIRWISE_KIND}/nightly-L1-20261130T030000"
    # The test split (task 60) × rollout_count 1 for each generation; 1 pair × (2 externals + self) × 3 seeds.
    assert len(nightly.executors.executed) == 2
    assert nightly.judge_calls() == {GPT_JUDGE: 3, CLAUDE_JUDGE: 3, "L1": 3, "L0": 0}
    assert nightly.recorded() == (2, 9, 1)
    sets = {row.results["label"]: row.results for row in ctx.repo.evaluations(kind=ROLLOUT_SET_KIND)}
    assert set(sets) == {"nightly-L1-20261130-n1", "nightly-L0-20261130-n1"}
    assert all(results["tasks"] == [60] for results in sets.values())
    assert {row.model for row in ctx.repo.episodes(ctx.cycle_id)} == {"served-L1", "served-L0"}

    seeds_1 = {row.seed for row in ctx.repo.episodes(ctx.cycle_id)}

    # The next night: fresh rollouts (another seed base), judged anew, a new evaluation row.
    second = nightly.evaluate(NIGHT_2)
    assert second["date"] == "20261201T030000" and second["evaluation"].endswith("/nightly-L1-20261201T030000")
    assert second["win_rate"] == first["win_rate"]
    assert len(nightly.executors.executed) == 4
    assert nightly.judge_calls() == {GPT_JUDGE: 6, CLAUDE_JUDGE: 6, "L1": 6, "L0": 0}
    assert nightly.recorded() == (4, 18, 2)
    seeds_2 = {row.seed for row in ctx.repo.episodes(ctx.cycle_id)} - seeds_1
    assert len(seeds_2) == 1 and not seeds_2 & seeds_1, "both generations share the night's seed; nights differ"
    rows = {row.key: row.results for row in pairwise_rows(ctx)}
    assert {results["nightly_date"] for results in rows.values()} == {"20261130T030000", "20261201T030000"}
    one, two = (rows[result["evaluation"]] for result in (first, second))
    assert one["summary"] == two["summary"] and one["agreement"] == two["agreement"]

    # A rerun of a night (a cleared task, a backfill over it) records nothing new; the same instant written with
    # another UTC offset is the same night.
    assert nightly.evaluate(NIGHT_1) == first
    assert nightly.evaluate("2026-11-30T04:00:00+01:00") == first
    assert nightly.recorded() == (4, 18, 2) and len(nightly.executors.executed) == 4

    # Tonight against the previous night: the same rate, no regression.
    verdict = check_regression(ctx, [second])
    assert verdict["regressions"] == []
    assert verdict["checked"][0]["previous"] == ("20261130T030000", 1.0)


def test_a_bad_date_or_generation_is_one_clear_error_and_records_nothing(nightly):
    with pytest.raises(NightlyError, match=r"^nightly: date 'last night' is not an ISO 8601 date-time$"):
        nightly.evaluate("last night")
    with pytest.raises(NightlyError, match=r"^nightly: date '' is not an ISO 8601 date-time$"):
        nightly.evaluate("")
    with pytest.raises(NightlyError, match=r"generation L0 has no registered parent"):
        nightly.evaluate(NIGHT_1, generation="L0")
    with pytest.raises(ServingError, match=r"generation 'L9' is not registered"):
        nightly.evaluate(NIGHT_1, generation="L9")
    assert nightly.executors.made == [] and nightly.recorded() == (0, 0, 0)
    assert nightly.judge_calls() == {GPT_JUDGE: 0, CLAUDE_JUDGE: 0, "L1": 0, "L0": 0}


# -- check_regression ------------------------------------------------------------------------------------------------


@pytest.fixture
def watch(eval_env) -> CycleContext:
    """A nightly cycle with regression_threshold 0.1 (floor 0.4) and L2 (parent L1) registered too."""
    ctx = open_test_cycle(nightly_config(with_evaluation(eval_env.config, regression_threshold=0.1)))
    ctx.repo.register_generation("L2", 2, bf16_uri="models/L2-bf16", parent_id=ctx.repo.get_generation("L1").id)
    return ctx


def night(
    ctx: CycleContext,
    stamp: str,
    win_rate: float | None,
    generation: str = "L1",
    baseline: str = "L0",
    *,
    cycle_id: int | None = None,
) -> None:
    """A hand-built nightly evaluation row (what `nightly_evaluate` records, reduced to what the check reads)."""
    results = {
        "generation_a": generation,
        "generation_b": baseline,
        "nightly_date": stamp,
        "summary": {"overall": {"win_rate": win_rate}},
    }
    ctx.repo.record_evaluation(
        f"{ctx.cycle_name}/{PAIRWISE_KIND}/hand-{generation}-{stamp}-{cycle_id or ctx.cycle_id}",
        PAIRWISE_KIND,
        generation_id=ctx.repo.get_generation(generation).id,
        baseline_generation_id=ctx.repo.get_generation(baseline).id,
        results=results,
        cycle_id=cycle_id or ctx.cycle_id,
    )


def tonight(
    win_rate: float | None,
    generation: str = "L1",
    baseline: str = "L0",
    interval: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """What `nightly_evaluate` returns for tonight, 2026-11-30 (a narrow ±0.02 interval unless given)."""
    if interval is None and win_rate is not None:
        interval = (round(win_rate - 0.02, 3), round(win_rate + 0.02, 3))
    return {
        "generation": generation,
        "baseline": baseline,
        "date": "20261130T030000",
        "win_rate": win_rate,
        "wilson_95": list(interval) if interval else None,
    }


def test_a_win_rate_below_the_floor_is_a_regression(watch):
    verdict = check_regression(watch, [tonight(0.35)])
    assert verdict["threshold"] == 0.1
    assert verdict["regressions"] == [
        "L1 wins 0.350 (95% interval up to 0.370) of decisive judgments against L0 on 20261130T030000, below 0.400 "
        "(0.5 − evaluation.regression_threshold 0.1)"
    ]
    assert verdict["checked"] == [
        {
            "generation": "L1",
            "baseline": "L0",
            "date": "20261130T030000",
            "win_rate": 0.35,
            "wilson_95": [0.33, 0.37],
            "previous": None,
        }
    ]
    # Just above the floor, with no earlier night: fine.
    assert check_regression(watch, [tonight(0.45)])["regressions"] == []


def test_a_low_rate_whose_interval_reaches_the_floor_is_noise_not_a_regression(watch):
    night(watch, "20261129T030000", 0.8)
    verdict = check_regression(watch, [tonight(0.35, interval=(0.2, 0.72))])
    assert verdict["regressions"] == [], "too few judgments to tell a regression from sampling noise"


def test_a_drop_larger_than_the_threshold_since_the_previous_night_is_a_regression(watch):
    night(watch, "20261129T030000", 0.8)
    (message,) = check_regression(watch, [tonight(0.6)])["regressions"]  # above the floor, but 0.2 lower
    assert message == (
        "L1's win rate against L0 dropped from 0.800 (20261129T030000) to 0.600 (95% interval up to 0.620) on "
        "20261130T030000, more than evaluation.regression_threshold 0.1"
    )
    assert check_regression(watch, [tonight(0.75)])["regressions"] == []  # a drop of 0.05 is within the threshold
    both = check_regression(watch, [tonight(0.3)])["regressions"]  # below the floor and a drop of 0.5
    assert len(both) == 2 and "below 0.400" in both[0] and "dropped from 0.800" in both[1]


def test_the_previous_night_is_the_latest_earlier_decisive_result_of_the_same_comparison(watch, eval_env):
    night(watch, "20261127T030000", 0.95)
    night(watch, "20261129T030000", 0.62)
    night(watch, "20261129T180000", None)  # no decisive judgment that night: no rate to compare with
    night(watch, "20261201T030000", 0.99)  # a later night (a backfill runs out of order)
    night(watch, "20261129T120000", 0.99, cycle_id=eval_env.ctx.cycle_id)  # another cycle's result
    night(watch, "20261129T120000", 0.99, "L2", "L1")  # another comparison
    (item,) = check_regression(watch, [tonight(0.6)])["checked"]
    assert item["previous"] == ("20261129T030000", 0.62)
    assert check_regression(watch, [tonight(0.6)])["regressions"] == []
    # The other comparison has its own history.
    (other,) = check_regression(watch, [tonight(0.85, "L2", "L1")])["regressions"]
    assert other.startswith("L2's win rate against L1 dropped from 0.990 (20261129T120000) to 0.850")


def test_no_decisive_judgment_is_not_a_regression(watch):
    night(watch, "20261129T030000", 0.9)
    verdict = check_regression(watch, [tonight(None)])
    assert verdict["regressions"] == []
    assert verdict["checked"][0]["win_rate"] is None and verdict["checked"][0]["previous"] == ("20261129T030000", 0.9)


def test_each_generation_is_checked_on_its_own(watch, eval_env):
    verdict = check_regression(watch, [tonight(0.7), tonight(0.2, "L2", "L1")])
    assert [item["generation"] for item in verdict["checked"]] == ["L1", "L2"]
    (message,) = verdict["regressions"]
    assert message.startswith("L2 wins 0.200 (95% interval up to 0.220) of decisive judgments against L1")
    # The stage function checks in the same nightly cycle.
    config = with_evaluation(eval_env.config, regression_threshold=0.1)
    assert stages.check_regression(config, [tonight(0.7), tonight(0.2, "L2", "L1")]) == verdict
