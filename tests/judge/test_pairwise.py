"""The position-bias sample of the pairwise judge: which pairs are judged again swapped, and that the extra call is
recorded, resumable and never changes the verdict (judge.position_bias_sample)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mass_ops.judge.evidence import EvidenceCaps, build_bundle
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge, in_position_bias_sample, swapped_unit
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling
from mass_ops.store.schema import CallStatus
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.judge.scripted import break_judge, open_judged_cycle


def _case(tmp_path: Path, key: str) -> PairwiseCase:
    caps = EvidenceCaps.local("q")
    bundles = []
    for side in ("a", "b"):
        root = tmp_path / side
        root.mkdir(exist_ok=True)
        (root / "research_report.md").write_text(side.upper())
        bundles.append(build_bundle(root, task_id=51, task_text="Study SPY.", location=side, caps=caps))
    return PairwiseCase(CallUnit(key, "judge", 51), 51, "Study SPY.", "alpha", "beta", *bundles, seed=450051)


def _judge(inner_loop: InnerLoopEnv, sample: float) -> tuple[PairwiseJudge, CallLedger]:
    opened = open_judged_cycle(inner_loop, {"position_bias_sample": sample, "invalid_retries": 0})
    ctx = opened.ctx
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    config = opened.config
    judge = PairwiseJudge(
        opened.client,
        ledger,
        lambda seed: in_loop_sampling(config, seed),
        invalid_retries=config.judge.invalid_retries,
        swap_consistent=config.search.swap_consistent,
        position_bias_sample=config.judge.position_bias_sample,
    )
    return judge, ledger


def test_the_sample_is_a_deterministic_nested_share_of_the_keys() -> None:
    keys = [f"task51/ranking/t51_L0_s{i}_vs_t51_L0_s{i + 1}" for i in range(4000)]
    half = {k for k in keys if in_position_bias_sample(k, 0.5)}
    fifth = {k for k in keys if in_position_bias_sample(k, 0.2)}
    assert half == {k for k in keys if in_position_bias_sample(k, 0.5)}  # same pick on every call (and rerun)
    assert fifth < half  # a larger share only adds pairs: raising it never drops a measured pair
    assert 0.45 < len(half) / len(keys) < 0.55 and 0.15 < len(fifth) / len(keys) < 0.25  # ±6 binomial SD
    assert not any(in_position_bias_sample(k, 0.0) for k in keys)
    assert all(in_position_bias_sample(k, 1.0) for k in keys)
    # The pick is SHA-256 of the key, not Python's per-process salted hash(): pinned values, stable everywhere.
    picked = [in_position_bias_sample(f"eval/external/p{i}/gpt/42", 0.5) for i in range(8)]
    assert picked == [True, False, False, True, True, False, False, False]
    assert swapped_unit(CallUnit("task51/rhi/v1_vs_no_harness", "judge", 51)).key == (
        "task51/rhi/v1_vs_no_harness/swapped"
    )


def test_a_sampled_pair_is_judged_again_swapped_and_the_verdict_stays_the_first_calls(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    inner_loop.policy.judge_winner = lambda request: "A"  # full position bias: the first workspace always wins
    judge, ledger = _judge(inner_loop, 1.0)
    case = _case(tmp_path, "task51/rhi/v1_vs_no_harness")
    outcome = judge.judge(case)
    assert (outcome.verdict, outcome.swapped_verdict, outcome.calls) == ("A", "B", 2)
    assert "swapped" not in outcome.rationale  # the measurement is not folded into the verdict's record
    bodies = inner_loop.judge_requests()
    assert "- Workspace A: alpha" in bodies[0]["messages"][1]["content"]
    assert "- Workspace A: beta" in bodies[1]["messages"][1]["content"]
    assert bodies[0]["seed"] == bodies[1]["seed"] == 450051
    swapped = ledger.attempts(swapped_unit(case.unit))
    assert [(r.unit_key, r.status) for r in swapped] == [
        ("task51/rhi/v1_vs_no_harness/swapped/a1", CallStatus.SUCCEEDED)
    ]
    assert outcome.usage == ledger.attempts(case.unit)[0].usage  # the forward call's usage only

    # A rerun reuses both recorded answers: no new request, the same outcome.
    again = judge.judge(case)
    assert len(inner_loop.judge_requests()) == 2
    assert (again.verdict, again.swapped_verdict, again.calls) == ("A", "B", 0)


def test_a_pair_outside_the_sample_and_an_invalid_verdict_make_no_extra_call(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    inner_loop.policy.judge_winner = lambda request: "B"
    judge, ledger = _judge(inner_loop, 0.5)
    keys = [f"task51/ranking/c{i}_vs_c{i + 1}" for i in range(40)]
    outside = next(k for k in keys if not in_position_bias_sample(k, 0.5))
    inside = next(k for k in keys if in_position_bias_sample(k, 0.5))
    outcome = judge.judge(_case(tmp_path, outside))
    assert (outcome.verdict, outcome.swapped_verdict, outcome.calls) == ("B", None, 1)
    assert len(inner_loop.judge_requests()) == 1

    break_judge(inner_loop, lambda request: True)
    broken = judge.judge(_case(tmp_path, inside))
    assert (broken.verdict, broken.swapped_verdict, broken.calls) == ("invalid", None, 1)
    assert ledger.attempts(swapped_unit(CallUnit(inside, "judge", 51))) == []


def test_the_sample_share_is_checked() -> None:
    with pytest.raises(ValueError, match="position_bias_sample must lie in"):
        PairwiseJudge(object(), CallLedger.__new__(CallLedger), lambda seed: None, position_bias_sample=1.5)  # type: ignore[arg-type]
