"""A cycle's evaluation phase (L1 against its parent L0) with a fake executor and scripted servers: the rollout units
the DAG maps, one unit on its generation's server, and `evaluate` end to end — both rollout sets, every external judge
× seed plus the new generation's in-loop self-judge, the summary with agreement, reruns that judge nothing again, and
the parent's in-loop judge standing in (and saying so in the report) when no external judge is configured."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mass_ops.config import validate_config
from mass_ops.context import CycleContext
from mass_ops.evaluation.report import build_blocks, collect_report_data, render_markdown
from mass_ops.evaluation.rollouts import ROLLOUT_SET_KIND, default_label
from mass_ops.evaluation.stats import ledger_key
from mass_ops.seeds import rollout_seed
from mass_ops.serving import ServingError, evaluation_scope
from mass_ops.stages import api as stages
from mass_ops.stages.evaluate import (
    PAIRWISE_KIND,
    evaluate,
    evaluated_generations,
    rollout_units,
    run_rollout_unit,
    stand_in_note,
)
from tests.evaluation.fakes import (
    CLAUDE_JUDGE,
    GPT_JUDGE,
    AnthropicStandIn,
    EvalEnv,
    GenerationStandIn,
    RecordingExecutors,
    judge_with,
    prefer_generation,
    route_anthropic_judges,
    serve_generation_stand_ins,
    user_text_of,
    verdict_text,
)
from tests.inner_loop_fakes import open_test_cycle

SEEDS = (42, 43, 44)


def pairwise_rows(ctx: CycleContext) -> list[Any]:
    return [row for row in ctx.repo.evaluations(kind=PAIRWISE_KIND) if row.cycle_id == ctx.cycle_id]


class CycleEvaluation:
    """The eval environment plus one scripted server per evaluated generation (recorded in the cycle's scope), the
    Anthropic stand-in behind the configured claude-judge, and a recording executor factory."""

    def __init__(self, env: EvalEnv, ctx: CycleContext, servers: dict[str, GenerationStandIn]) -> None:
        self.env = env
        self.ctx = ctx
        self.servers = servers
        self.executors = RecordingExecutors()
        self.claude = AnthropicStandIn(lambda body: verdict_text(self.external(user_text_of(body))))
        self.external = prefer_generation(ctx, "L1")  # what the external judges decide (replaceable)
        judge_with(env.policy, lambda text: self.external(text))

    def judge_calls(self) -> dict[str, int]:
        """Judge requests received so far, by who was asked."""
        return {
            GPT_JUDGE: len(self.env.judge_requests()),
            CLAUDE_JUDGE: len(self.claude.bodies),
            **{name: len(server.judge_requests()) for name, server in self.servers.items()},
        }

    def run_units(self) -> list[Any]:
        """Every rollout unit, one call each, as the DAG's mapped tasks do."""
        return [
            run_rollout_unit(self.ctx, generation, task, replicate, executor=self.executors)
            for generation, task, replicate in rollout_units(self.ctx.config)
        ]


def open_evaluation(env: EvalEnv, ctx: CycleContext, monkeypatch: pytest.MonkeyPatch) -> Iterator[CycleEvaluation]:
    with serve_generation_stand_ins(evaluation_scope(ctx.config), ["L1", "L0"]) as servers:
        cycle = CycleEvaluation(env, ctx, servers)
        route_anthropic_judges(monkeypatch, cycle.claude)
        yield cycle


@pytest.fixture
def cycle(eval_env: EvalEnv, tmp_path, monkeypatch) -> Iterator[CycleEvaluation]:
    monkeypatch.chdir(tmp_path)  # the servers' state files live under runs/ of the cwd
    yield from open_evaluation(eval_env, eval_env.ctx, monkeypatch)


@pytest.fixture
def unjudged(eval_env: EvalEnv, tmp_path, monkeypatch) -> Iterator[CycleEvaluation]:
    """A cycle whose config names no external judge (the demo: no keys)."""
    monkeypatch.chdir(tmp_path)
    data = eval_env.config.model_dump(mode="json")
    data["name"] = "no-external-judge"
    data["evaluation"]["judges"] = []
    ctx = open_test_cycle(validate_config(data))
    yield from open_evaluation(eval_env, ctx, monkeypatch)


# -- rollout units ---------------------------------------------------------------------------------------------------


def test_rollout_units_cover_both_generations_new_first(eval_env):
    data = eval_env.config.model_dump(mode="json")
    data["evaluation"]["rollout_count"] = 2
    config = validate_config(data)
    assert evaluated_generations(config) == ("L1", "L0")
    units = rollout_units(config)
    assert units == [(g, t, r) for g in ("L1", "L0") for t in (51, 60) for r in (0, 1)]
    assert len(units) == 2 * len(config.rollout_tasks()) * config.evaluation.rollout_count == 8
    # The stage function (what the DAG maps over) gives the same units as JSON lists.
    assert stages.rollout_units(config) == [list(unit) for unit in units]


def test_a_rollout_unit_runs_on_its_generations_server_once(cycle):
    ctx = cycle.ctx
    outcome = run_rollout_unit(ctx, "L0", 60, 0, executor=cycle.executors)
    row = ctx.repo.get_episode(outcome.episode_id)
    seed = rollout_seed(ctx.config.evaluation.rollout_seed_base, 60, 0)
    assert (row.cycle_id, row.kind, int(row.task_id), row.candidate, row.seed) == (ctx.cycle_id, "rollout", 60, 0, seed)
    assert (row.generation, row.model, row.condition) == ("L0", "served-L0", "t60_bare")
    assert len(cycle.executors.executed) == 1
    # A retry of the same unit reuses the recorded episode.
    again = run_rollout_unit(ctx, "L0", 60, 0, executor=cycle.executors)
    assert again.reused and again.episode_id == outcome.episode_id and len(cycle.executors.executed) == 1
    # The same (task, replicate) of the other generation is another episode, with the same seed, on its server.
    other = ctx.repo.get_episode(run_rollout_unit(ctx, "L1", 60, 0, executor=cycle.executors).episode_id)
    assert (other.generation, other.model, other.seed) == ("L1", "served-L1", seed) and other.id != row.id


def test_a_rollout_unit_outside_the_evaluation_is_refused_before_anything_runs(cycle):
    ctx = cycle.ctx
    refused = [
        (("L2", 51, 0), r"this cycle evaluates L1 and L0, not 'L2'"),
        (("L1", 51, 1), r"replicate 1 is outside 0\.\.0 \(evaluation\.rollout_count\)"),
        (("L1", 51, -1), r"replicate -1 is outside 0\.\.0"),
        (("L1", 202, 0), r"task 202 is not in this cycle's rollout pool \[51, 60\]"),  # a train candidate
    ]
    for (generation, task, replicate), problem in refused:
        with pytest.raises(ValueError, match=problem):
            run_rollout_unit(ctx, generation, task, replicate, executor=cycle.executors)
    assert cycle.executors.made == [] and ctx.repo.episodes(ctx.cycle_id) == []


def test_a_rollout_unit_without_its_server_is_one_clear_error(eval_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    executors = RecordingExecutors()
    with pytest.raises(ServingError, match=r"no local server of L1 was started in scope 'inner-loop-test'"):
        run_rollout_unit(eval_env.ctx, "L1", 51, 0, executor=executors)
    with pytest.raises(ServingError, match=r"no local server of L1 was started"):
        evaluate(eval_env.ctx, executor=executors)
    assert executors.made == [] and eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id) == []


# -- evaluate --------------------------------------------------------------------------------------------------------


def test_evaluate_judges_every_pair_by_every_judge_and_seed_and_records_the_summary(cycle):
    ctx = cycle.ctx
    judge_with(cycle.servers["L1"].policy, prefer_generation(ctx, "L1"))  # the self-judge agrees with the externals
    judge_with(cycle.servers["L0"].policy, prefer_generation(ctx, "L0"))  # never asked: external judges exist
    outcomes = cycle.run_units()
    assert len(outcomes) == 4 and len(cycle.executors.executed) == 4

    result = evaluate(ctx, executor=cycle.executors)
    assert len(cycle.executors.executed) == 4  # every episode was already recorded by its unit
    assert {k: result[k] for k in ("generation", "baseline", "pairs", "judged_now", "win_rate", "stand_in_judge")} == {
        "generation": "L1",
        "baseline": "L0",
        "pairs": 2,
        "judged_now": 2 * 3 * 3,  # 2 pairs × (gpt-judge, claude-judge, self) × 3 seeds
        "win_rate": 1.0,
        "stand_in_judge": False,
    }

    # Both rollout sets are recorded, under the default labels, with the episodes the units ran.
    sets = {row.results["generation"]: row.results for row in ctx.repo.evaluations(kind=ROLLOUT_SET_KIND)}
    assert set(sets) == {"L1", "L0"}
    for generation, results in sets.items():
        assert results["label"] == default_label(generation, [51, 60], 1)
        ids = {o.episode_id for o in outcomes if o.request.generation == generation}
        assert {entry["episode_id"] for entry in results["entries"]} == ids

    # Every (pair, judge, seed) is in the external ledger once; the self-judge is L1's in-loop judge.
    rows = ctx.repo.comparisons(ctx.cycle_id, "external")
    pair_ids = {row.key.split("/")[0] for row in rows}
    assert len(pair_ids) == 2
    assert {row.key for row in rows} == {
        ledger_key(p, judge, seed) for p in pair_ids for judge in (GPT_JUDGE, CLAUDE_JUDGE, "self") for seed in SEEDS
    }
    assert {row.judge_model for row in rows if row.key.split("/")[1] == "self"} == {"served-L1"}
    assert cycle.judge_calls() == {GPT_JUDGE: 6, CLAUDE_JUDGE: 6, "L1": 6, "L0": 0}
    assert {body["model"] for body in cycle.servers["L1"].judge_requests()} == {"served-L1"}

    # The summary: external judges only in the win rate, the self-judge in the agreement table.
    (row,) = pairwise_rows(ctx)
    assert row.key == result["evaluation"] and row.results_uri == result["results_uri"]
    results = row.results
    assert (results["judges"], results["seeds"]) == ([GPT_JUDGE, CLAUDE_JUDGE], list(SEEDS))
    assert results["self_judge"] == "self"
    overall = results["summary"]["overall"]
    assert (overall["wins"], overall["losses"], overall["judgments"]) == (12, 0, 12)
    assert results["self_judgments"] == 6
    agreement = results["agreement"]["L1"]
    assert (agreement["pairs"], agreement["agreements"], agreement["decisive_agreements"]) == (2, 2, 2)
    assert "note" not in results
    assert row.generation_id == ctx.repo.get_generation("L1").id
    assert row.baseline_generation_id == ctx.repo.get_generation("L0").id

    # A rerun (a retried or cleared task) judges nothing again and returns the recorded evaluation.
    calls = cycle.judge_calls()
    again = evaluate(ctx, executor=cycle.executors)
    assert again == {**result, "judged_now": 0}
    assert cycle.judge_calls() == calls and len(cycle.executors.executed) == 4
    assert len(pairwise_rows(ctx)) == 1 and len(ctx.repo.comparisons(ctx.cycle_id, "external")) == 18


def test_evaluate_runs_missing_rollouts_itself_and_records_disagreement(cycle):
    ctx = cycle.ctx
    cycle.external = prefer_generation(ctx, "L0")  # the external judges prefer the parent ...
    judge_with(cycle.servers["L1"].policy, prefer_generation(ctx, "L1"))  # ... L1's own judge prefers itself
    run_rollout_unit(ctx, "L1", 51, 0, executor=cycle.executors)  # one unit ran before; evaluate does the rest
    result = evaluate(ctx, executor=cycle.executors)
    assert len(cycle.executors.executed) == 4 and len(set(cycle.executors.executed)) == 4
    assert (result["win_rate"], result["judged_now"]) == (0.0, 18)
    (row,) = pairwise_rows(ctx)
    agreement = row.results["agreement"]["L1"]
    assert (agreement["pairs"], agreement["agreements"], agreement["decisive_pairs"]) == (2, 0, 2)
    assert agreement["confusion"] == {"A|B": 2}  # self says L1 (A), the externals say L0 (B), on both pairs


def test_without_external_judges_the_parents_in_loop_judge_stands_in_and_the_report_says_so(unjudged):
    ctx = unjudged.ctx
    judge_with(unjudged.servers["L0"].policy, prefer_generation(ctx, "L0"))  # the stand-in prefers its own rollouts
    judge_with(unjudged.servers["L1"].policy, prefer_generation(ctx, "L1"))
    unjudged.run_units()
    result = evaluate(ctx, executor=unjudged.executors)
    assert (result["stand_in_judge"], result["win_rate"], result["judged_now"]) == (True, 0.0, 2 * 2 * 3)

    # The stand-in is L0's in-loop judge on L0's server; the self-judge is L1's on L1's; no external is asked.
    assert unjudged.judge_calls() == {GPT_JUDGE: 0, CLAUDE_JUDGE: 0, "L1": 6, "L0": 6}
    assert {body["model"] for body in unjudged.servers["L0"].judge_requests()} == {"served-L0"}
    rows = ctx.repo.comparisons(ctx.cycle_id, "external")
    assert {(row.key.split("/")[1], row.judge_model) for row in rows} == {
        ("in-loop-L0", "served-L0"),
        ("self", "served-L1"),
    }
    assert all(row.verdict == "B" for row in rows if row.key.split("/")[1] == "in-loop-L0")

    (row,) = pairwise_rows(ctx)
    assert row.results["judges"] == ["in-loop-L0"]
    assert row.results["note"] == stand_in_note("L0")
    assert "L0's in-loop judge stands in (not an independent verdict)" in row.results["note"]
    assert row.results["agreement"]["L1"]["agreements"] == 0

    # The report carries the note next to the evaluation it qualifies.
    data = collect_report_data(ctx)
    assert f"Evaluation {row.results['label']}: {stand_in_note('L0')}" in data.notes
    assert stand_in_note("L0") in render_markdown(build_blocks(data))

    # Rerunning judges nothing again.
    calls = unjudged.judge_calls()
    assert evaluate(ctx, executor=unjudged.executors)["judged_now"] == 0
    assert unjudged.judge_calls() == calls and len(pairwise_rows(ctx)) == 1
