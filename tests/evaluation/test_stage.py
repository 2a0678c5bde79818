"""The evaluation stage end to end with scripted judges: rollouts → pairs → external judging (every judge × the
three presentation seeds, seed 44 swapped and mapped back) → summary → resumability without repeated judgments."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mass_ops.evaluation.external import external_judges, open_external_judge, self_judge
from mass_ops.evaluation.pairing import RolloutPair
from mass_ops.evaluation.stats import ledger_key
from mass_ops.llm import RetryPolicy
from mass_ops.seeds import presentation_swapped
from mass_ops.stages.evaluate import (
    EvaluationStageError,
    judge_pairs,
    pair_rollouts,
    pairs_key,
    run_rollouts,
    summarize,
    workspace_alias,
)
from tests.evaluation.fakes import (
    CLAUDE_JUDGE,
    CLAUDE_KEY,
    GPT_JUDGE,
    GPT_KEY,
    AnthropicStandIn,
    EvalEnv,
    alias_judge,
    aliases_of,
    open_eval_env,
    preferring,
    shown_aliases,
    spawn_judging,
    user_text_of,
    verdict_text,
)
from tests.inner_loop_fakes import kill_when


def rollout_pairs(env: EvalEnv, count: int = 1) -> list[RolloutPair]:
    executor = env.rollout_executor()
    new = run_rollouts(env.ctx, executor, "L1", count=count, label="l1")
    old = run_rollouts(env.ctx, executor, "L0", count=count, label="l0")
    assert (new.label, old.label) == ("l1", "l0")
    return pair_rollouts(env.ctx, "l1", "l0")


def judges_preferring(env: EvalEnv, decide, *, retry: RetryPolicy | None = None):
    """gpt-judge (policy server) and claude-judge (Anthropic stand-in) answering with `decide(user_text)`."""
    env.policy.judge_winner = lambda request: decide(request.user_text())
    stand_in = AnthropicStandIn(lambda body: verdict_text(decide(user_text_of(body))))
    gpt = open_external_judge(env.config.evaluation.judges[0], retry=retry or RetryPolicy(max_attempts=1))
    claude = open_external_judge(env.config.evaluation.judges[1], http_client=stand_in.client(), retry=retry)
    return gpt, claude, stand_in


def test_every_judge_and_seed_is_judged_once_with_the_swap_rule(eval_env):
    pairs = rollout_pairs(eval_env)
    assert [(p.task, p.replicate) for p in pairs] == [(51, 0), (60, 0)]
    new_aliases = aliases_of(pairs, "a")
    decide = alias_judge(preferring(new_aliases))  # both judges always prefer L1's workspace
    gpt, claude, stand_in = judges_preferring(eval_env, decide)
    result = judge_pairs(eval_env.ctx, pairs, [gpt, claude])
    assert (result.judged, result.skipped, result.failures) == (12, 0, {})

    rows = eval_env.ctx.repo.comparisons(eval_env.ctx.cycle_id, "external")
    expected_keys = {
        ledger_key(p.pair_id, j, s) for p in pairs for j in (GPT_JUDGE, CLAUDE_JUDGE) for s in (42, 43, 44)
    }
    assert {r.key for r in rows} == expected_keys
    by_pair = {p.pair_id: p for p in pairs}
    for row in rows:
        pair_id, judge, seed = row.key.split("/")
        pair = by_pair[pair_id]
        assert row.verdict == "A"  # mapped back: L1 (side A) won every judgment
        assert row.swapped is (seed == "44") is presentation_swapped(int(seed))
        assert (row.side_a, row.side_b) == (pair.a, pair.b)
        assert (row.episode_a_id, row.episode_b_id) == (pair.episode_a_id, pair.episode_b_id)
        assert row.judge_model == (GPT_JUDGE if judge == GPT_JUDGE else "claude-stand-in")
        assert row.llm_call_id is not None and row.seed == int(seed)
        assert row.rationale.startswith("[shown swapped") is row.swapped

    # Seed 44 showed B's workspace as A: the raw answer was "B" and was mapped back to "A".
    presented = [shown_aliases(body["messages"][1]["content"]) for body in eval_env.judge_requests()]
    presented += [shown_aliases(user_text_of(body)) for body in stand_in.bodies]
    assert len(presented) == 12
    swapped_shown = [shown for shown in presented if shown["A"] not in new_aliases]
    assert len(swapped_shown) == 4  # 2 pairs × 2 judges × seed 44
    assert all(shown["B"] in new_aliases for shown in swapped_shown)
    # Judges never see which generation made a workspace.
    for body in eval_env.judge_requests():
        text = body["messages"][1]["content"]
        assert "gL1" not in text and "gL0" not in text and "candidate-a" in text

    # Call ledger: one succeeded external_judge call per judgment.
    calls = [c for c in eval_env.ctx.repo.llm_calls(eval_env.ctx.cycle_id) if c.unit_key.startswith("eval/")]
    assert Counter(c.purpose for c in calls) == {"external_judge": 12}
    assert all(c.status == "succeeded" and c.unit_key.endswith("/a1") for c in calls)

    # Rerunning judges nothing.
    again = judge_pairs(eval_env.ctx, pairs, [gpt, claude])
    assert (again.judged, again.skipped) == (0, 12)
    assert len(eval_env.judge_requests()) == 6 and len(stand_in.bodies) == 6

    # Keys never reach rows or artifacts.
    stored = Path(eval_env.config.storage.metadata_url.removeprefix("sqlite:///")).read_bytes()
    for path in (eval_env.tmp / "artifacts").rglob("*"):
        if path.is_file():
            stored += path.read_bytes()
    assert GPT_KEY.encode() not in stored and CLAUDE_KEY.encode() not in stored
    assert pairs == [RolloutPair.from_dict(row) for row in eval_env.ctx.artifacts.get_json(
        pairs_key(eval_env.ctx.cycle_name, "l1", "l0"))]  # fmt: skip


def test_a_killed_judging_run_resumes_without_repeating_a_judgment(eval_env, monkeypatch):
    pairs = rollout_pairs(eval_env)
    decide = alias_judge(preferring(aliases_of(pairs, "b")))  # L0 wins this time
    gpt, claude, stand_in = judges_preferring(eval_env, decide)
    ctx = eval_env.ctx
    real_record = ctx.repo.record_comparison
    state = {"calls": 0}

    def dies_on_the_third(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == 3:
            # The judge's answer is already in the call ledger; the process dies before the ledger row.
            raise SystemExit("killed")
        return real_record(*args, **kwargs)

    monkeypatch.setattr(ctx.repo, "record_comparison", dies_on_the_third)
    with pytest.raises(SystemExit):
        judge_pairs(ctx, pairs, [gpt, claude], max_workers=1)
    monkeypatch.setattr(ctx.repo, "record_comparison", real_record)
    recorded = ctx.repo.comparisons(ctx.cycle_id, "external")
    asked = len(eval_env.judge_requests()) + len(stand_in.bodies)
    # Nothing new starts after the kill (one judgment already running may finish).
    assert 2 <= len(recorded) <= 3 and asked == len(recorded) + 1

    result = judge_pairs(ctx, pairs, [gpt, claude], max_workers=2)
    assert (result.judged, result.skipped) == (12 - len(recorded), len(recorded))
    # 12 judgments, 12 model calls in total: the third answer was reused, not asked again.
    assert len(eval_env.judge_requests()) + len(stand_in.bodies) == 12
    calls = [c for c in ctx.repo.llm_calls(ctx.cycle_id) if c.unit_key.startswith("eval/")]
    assert len(calls) == 12 and all(c.unit_key.endswith("/a1") for c in calls)
    rows = ctx.repo.comparisons(ctx.cycle_id, "external")
    assert len(rows) == 12 and {r.verdict for r in rows} == {"B"}
    assert len({r.llm_call_id for r in rows}) == 12


def test_failed_judgments_are_reported_and_only_they_are_redone(eval_env):
    pairs = rollout_pairs(eval_env)
    decide = alias_judge(preferring(aliases_of(pairs, "a")))
    gpt, _, _ = judges_preferring(eval_env, decide)
    down = AnthropicStandIn(lambda body: "", status=529)
    claude = open_external_judge(eval_env.config.evaluation.judges[1], http_client=down.client(),
                                 retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.0))  # fmt: skip
    with pytest.raises(EvaluationStageError, match=r"6 of 12 judgments failed.*6 recorded"):
        judge_pairs(eval_env.ctx, pairs, [gpt, claude])
    assert Counter(r.key.split("/")[1] for r in eval_env.ctx.repo.comparisons(eval_env.ctx.cycle_id, "external")) == {
        GPT_JUDGE: 6
    }
    gpt_asked = len(eval_env.judge_requests())
    healthy = AnthropicStandIn(lambda body: verdict_text(decide(user_text_of(body))))
    claude = open_external_judge(eval_env.config.evaluation.judges[1], http_client=healthy.client())
    assert judge_pairs(eval_env.ctx, pairs, [gpt, claude]).judged == 6
    assert len(eval_env.judge_requests()) == gpt_asked and len(healthy.bodies) == 6


def test_summary_tables_ties_and_agreement(eval_env):
    pairs = rollout_pairs(eval_env, count=2)  # tasks 51 (train) and 60 (test) × 2 replicates
    new_aliases = aliases_of(pairs, "a")
    tie_aliases = {workspace_alias(p.a) for p in pairs if p.task == 60}
    decide = alias_judge(preferring(new_aliases, ties=tie_aliases))  # L1 wins on 51, ties on 60
    gpt, claude, _ = judges_preferring(eval_env, decide)
    with pytest.raises(EvaluationStageError, match="24 of 24 external judgments are missing"):
        summarize(eval_env.ctx, pairs, label="first", bootstrap_samples=200)
    judge_pairs(eval_env.ctx, pairs, [gpt, claude])
    # The in-loop self-judge on the same pairs: it prefers L0 on task 51, so it disagrees there.
    old_aliases = aliases_of(pairs, "b")
    eval_env.policy.judge_winner = lambda request: alias_judge(preferring(old_aliases, ties=tie_aliases))(
        request.user_text()
    )
    judge_pairs(eval_env.ctx, pairs, [self_judge(eval_env.config, eval_env.client)], seeds=[42])

    summary = summarize(eval_env.ctx, pairs, label="first", bootstrap_samples=200)
    results = summary.results
    overall = results["summary"]["overall"]
    assert (overall["wins"], overall["losses"], overall["ties"], overall["judgments"]) == (12, 0, 12, 24)
    assert overall["win_rate"] == 1.0
    assert results["summary"]["by_task"]["51"]["win_rate"] == 1.0
    assert results["summary"]["by_task"]["60"]["win_rate"] is None  # only ties: no rate
    assert results["summary"]["by_split"]["train"]["wins"] == 12
    assert results["summary"]["by_split"]["test"]["win_rate"] is None
    assert set(results["summary"]["by_judge"]) == {GPT_JUDGE, CLAUDE_JUDGE}
    assert results["summary"]["overall"]["wilson_95"][1] == 1.0
    # The self-judge is not an external judge: it only feeds the agreement table.
    agreement = results["agreement"]["L1"]
    assert (agreement["pairs"], agreement["agreements"], agreement["decisive_pairs"]) == (4, 2, 2)
    assert agreement["decisive_agreements"] == 0 and results["self_judgments"] == 4

    row = next(e for e in eval_env.ctx.repo.evaluations(kind="pairwise") if e.key == summary.key)
    assert row.generation_id == eval_env.ctx.repo.get_generation("L1").id
    assert row.baseline_generation_id == eval_env.ctx.repo.get_generation("L0").id
    assert json.loads(Path(summary.results_uri.removeprefix("file://")).read_text()) == results
    # Summarizing again is idempotent; new judgments under the same label are refused.
    assert summarize(eval_env.ctx, pairs, label="first", bootstrap_samples=200).results == results
    judge_pairs(eval_env.ctx, pairs, [self_judge(eval_env.config, eval_env.client)], seeds=[43])
    with pytest.raises(EvaluationStageError, match="already recorded with other results"):
        summarize(eval_env.ctx, pairs, label="first", bootstrap_samples=200)


def test_unusable_answers_become_invalid_verdicts_counted_as_ties(eval_env):
    from tests.policy_server import PolicyReply

    pairs = rollout_pairs(eval_env)[:1]
    gpt, _, _ = judges_preferring(eval_env, alias_judge(preferring(aliases_of(pairs, "a"))))
    broken = PolicyReply(content="not json at all")
    eval_env.policy.judge_replies = [broken] * 3  # seed 42: three unusable answers (1 + 2 retries)
    judge_pairs(eval_env.ctx, pairs, [gpt], max_workers=1)
    rows = {
        r.key.rsplit("/", 1)[1]: r.verdict for r in eval_env.ctx.repo.comparisons(eval_env.ctx.cycle_id, "external")
    }
    assert rows == {"42": "invalid", "43": "A", "44": "A"}
    summary = summarize(eval_env.ctx, pairs, judges=[GPT_JUDGE], label="inv", bootstrap_samples=50)
    overall = summary.results["summary"]["overall"]
    assert (overall["wins"], overall["ties"], overall["invalid"], overall["win_rate"]) == (2, 1, 1, 1.0)


def test_a_sigkilled_judging_process_resumes_without_repeating_a_judgment(eval_env):
    pairs = rollout_pairs(eval_env)
    eval_env.policy.judge_winner = lambda request: alias_judge(preferring(aliases_of(pairs, "a")))(request.user_text())
    eval_env.server.config.latency_s = 0.25  # slow judges: the kill lands mid-run
    ctx = eval_env.ctx
    child = spawn_judging(eval_env.config, pairs, eval_env.tmp)
    kill_when(child, lambda: len(ctx.repo.comparisons(ctx.cycle_id, "external")) >= 2)
    before = {row.key: row.id for row in ctx.repo.comparisons(ctx.cycle_id, "external")}
    assert 2 <= len(before) < 6

    eval_env.server.config.latency_s = 0.0
    with external_judges(eval_env.config, names=[GPT_JUDGE]) as judges:
        result = judge_pairs(ctx, pairs, judges)
    assert result.skipped == len(before) and result.judged == 6 - len(before)
    rows = ctx.repo.comparisons(ctx.cycle_id, "external")
    assert len(rows) == 6 and {row.key: row.id for row in rows if row.key in before} == before
    calls = [c for c in ctx.repo.llm_calls(ctx.cycle_id) if c.unit_key.startswith("eval/")]
    succeeded = Counter(c.unit_key.rsplit("/", 1)[0] for c in calls if c.status == "succeeded")
    assert len(succeeded) == 6 and set(succeeded.values()) == {1}  # no judgment was made twice
    # At most the one call in flight at the kill was sent again (its answer never reached the ledger).
    assert 6 <= len(eval_env.judge_requests()) <= 7


@pytest.mark.postgres
def test_the_stage_on_postgres(tmp_path, monkeypatch, postgres_url):
    with open_eval_env(tmp_path, monkeypatch, postgres_url) as env:
        pairs = rollout_pairs(env)
        gpt, claude, _ = judges_preferring(env, alias_judge(preferring(aliases_of(pairs, "a"))))
        assert judge_pairs(env.ctx, pairs, [gpt, claude], max_workers=4).judged == 12
        assert judge_pairs(env.ctx, pairs, [gpt, claude]).skipped == 12
        summary = summarize(env.ctx, pairs, label="pg", bootstrap_samples=100)
        assert summary.results["summary"]["overall"]["win_rate"] == 1.0
        assert summarize(env.ctx, pairs, label="pg", bootstrap_samples=100).results == summary.results
