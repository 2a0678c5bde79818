"""The evaluate stage's tolerance of invalid judge verdicts (`judge.max_invalid_fraction`, per judge)."""

from __future__ import annotations

import pytest

from mass_ops.config import validate_config
from mass_ops.evaluation.external import open_external_judge
from mass_ops.judge.invalid_verdicts import TooManyInvalidVerdictsError
from mass_ops.llm import RetryPolicy
from mass_ops.stages.evaluate import judge_pairs, pair_rollouts, run_rollouts
from mass_ops.store.schema import CallStatus
from tests.evaluation.fakes import GPT_JUDGE, EvalEnv, eval_env_fixture  # noqa: F401
from tests.inner_loop_fakes import FakeExecutor, open_test_cycle
from tests.policy_server import PolicyReply


def test_an_invalid_external_verdict_at_fraction_zero_fails_judging_and_the_rerun_judges_only_it(
    eval_env: EvalEnv,
) -> None:
    data = eval_env.config.model_dump(mode="json")
    data["name"] = "strict-judging"
    data["judge"].update(invalid_retries=1, max_invalid_fraction=0.0)
    ctx = open_test_cycle(validate_config(data))
    executor = FakeExecutor(ctx)
    run_rollouts(ctx, executor, "L1", count=1, label="l1")
    run_rollouts(ctx, executor, "L0", count=1, label="l0")
    pairs = pair_rollouts(ctx, "l1", "l0")
    eval_env.policy.judge_winner = lambda request: "A"
    eval_env.policy.judge_replies = [PolicyReply(content="I cannot decide.")] * 2  # the first judgment, twice
    gpt = open_external_judge(ctx.config.evaluation.judges[0], retry=RetryPolicy(max_attempts=1))
    planned = len(pairs) * 3  # presentation seeds 42, 43, 44

    with pytest.raises(TooManyInvalidVerdictsError) as failure:
        judge_pairs(ctx, pairs, [gpt], max_workers=1)
    message = str(failure.value)
    first = f"{pairs[0].pair_id}/{GPT_JUDGE}/42"
    assert "\n" not in message and message.startswith(f"evaluate judge {GPT_JUDGE}: verdict {first} is invalid")
    assert f"1 invalid of {planned} planned verdicts exceeds judge.max_invalid_fraction = 0" in message
    recorded = {row.key: row.verdict for row in ctx.repo.comparisons(ctx.cycle_id, "external")}
    assert first not in recorded and len(recorded) == planned - 1 and "invalid" not in recorded.values()
    # External judges get no sampling seed (the reference sends none): no seed to derive, none recorded.
    calls = [c for c in ctx.repo.llm_calls(ctx.cycle_id) if c.unit_key.startswith(f"eval/external/{first}/")]
    assert [(c.status, c.seed) for c in calls] == [(CallStatus.INVALID, None)] * 2

    requests = len(eval_env.judge_requests())
    result = judge_pairs(ctx, pairs, [gpt], max_workers=1)
    assert (result.judged, result.skipped, result.invalid) == (1, planned - 1, {GPT_JUDGE: 0})
    assert len(eval_env.judge_requests()) == requests + 1
    assert "invalid" not in {row.verdict for row in ctx.repo.comparisons(ctx.cycle_id, "external")}
