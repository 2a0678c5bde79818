"""Win rates W/(W+L) with ties excluded, null without decisive judgments, Wilson and pair-bootstrap intervals,
per task / split / judge tables (MASS_SPEC §5 tie handling, §10 summary)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from mass_ops.evaluation.stats import (
    Judgment,
    LedgerKeyError,
    PairwiseSummary,
    format_rate,
    judgments_from_ledger,
    ledger_key,
    pair_bootstrap_interval,
    parse_ledger_key,
    summarize_judgments,
    wilson_interval,
    win_rate,
)


def judgments(verdicts: str, *, task: int = 51, judge: str = "j", per_pair: int = 1) -> list[Judgment]:
    """One judgment per character (A, B, T = tie, I = invalid); `per_pair` consecutive judgments share a pair."""
    code = {"A": "A", "B": "B", "T": "tie", "I": "invalid"}
    return [
        Judgment(pair_id=f"{task}-p{i // per_pair}", task=task, judge=judge, seed=i, verdict=code[v])
        for i, v in enumerate(verdicts)
    ]


def test_wilson_interval_matches_the_textbook_values():
    # 8 of 10 at 95%: the Wilson score interval is [0.4902, 0.9433]; 0 of 10 gives [0, 0.2775].
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and round(high, 4) == 0.2775
    # Symmetry: k of n mirrors n - k of n.
    a, b = wilson_interval(3, 7), wilson_interval(4, 7)
    assert math.isclose(a[0], 1 - b[1]) and math.isclose(a[1], 1 - b[0])
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError, match="wins 11"):
        wilson_interval(11, 10)


def test_ties_and_invalid_verdicts_are_excluded_from_the_rate():
    rate = win_rate(judgments("AAABTTII"))
    assert (rate.wins, rate.losses, rate.ties, rate.invalid, rate.judgments) == (3, 1, 4, 2, 8)
    assert rate.win_rate == 0.75
    assert rate.wilson == wilson_interval(3, 4)
    # Adding ties changes nothing but the tie count.
    more = win_rate(judgments("AAABTTIITTTT"))
    assert more.win_rate == rate.win_rate and more.wilson == rate.wilson and more.ties == 8


def test_rate_is_null_without_a_decisive_judgment():
    for verdicts in ("", "T", "TTI"):
        rate = win_rate(judgments(verdicts))
        assert rate.win_rate is None and rate.wilson is None and rate.bootstrap is None
        assert format_rate(rate) == "n/a"


def test_pair_bootstrap_on_known_counts():
    # Every decisive judgment won: every resample has rate 1.
    assert pair_bootstrap_interval(judgments("AAAAAT", per_pair=2), samples=200) == (1.0, 1.0)
    assert pair_bootstrap_interval(judgments("BBBB"), samples=200) == (0.0, 0.0)
    # 60 pairs of one judgment each, 40 wins: close to Wilson, contains 2/3, deterministic for a seed.
    data = judgments("AAB" * 20)
    boot = pair_bootstrap_interval(data, samples=2000, seed=7)
    wilson = wilson_interval(40, 60)
    assert boot[0] < 2 / 3 < boot[1]
    assert abs(boot[0] - wilson[0]) < 0.04 and abs(boot[1] - wilson[1]) < 0.04
    assert boot == pair_bootstrap_interval(data, samples=2000, seed=7)
    assert pair_bootstrap_interval(data, samples=1) is None


def test_pair_bootstrap_resamples_whole_pairs():
    # Pairs whose judges always agree: 6 judgments per pair make the judgments look 6x more numerous than the
    # pairs; the pair bootstrap stays as wide as for one judgment per pair, Wilson narrows.
    one = judgments("AB" * 10)
    six = judgments("".join(v * 6 for v in "AB" * 10), per_pair=6)
    narrow = win_rate(six).wilson
    width = lambda interval: interval[1] - interval[0]  # noqa: E731
    boot_one = pair_bootstrap_interval(one, samples=3000, seed=3)
    boot_six = pair_bootstrap_interval(six, samples=3000, seed=3)
    assert boot_one == boot_six
    assert width(narrow) < width(boot_six) * 0.6


def test_per_task_split_and_judge_tables():
    data = (
        judgments("AAB", task=51, judge="gpt")
        + judgments("ABB", task=51, judge="claude")
        + judgments("TTB", task=60, judge="gpt")
        + judgments("TTT", task=60, judge="claude")
        + judgments("AAA", task=202, judge="gpt")
    )
    summary = summarize_judgments(data, lambda task: "test" if task == 60 else "train", bootstrap_samples=100)
    assert list(summary.by_task) == ["51", "60", "202"]
    assert summary.by_task["51"].win_rate == 0.5
    assert summary.by_task["60"].win_rate == 0.0 and summary.by_task["60"].ties == 5
    assert summary.by_task["202"].win_rate == 1.0
    assert summary.by_split["train"].wins == 6 and summary.by_split["train"].losses == 3
    assert summary.by_split["test"].win_rate == 0.0
    assert (summary.by_judge["gpt"].wins, summary.by_judge["gpt"].losses) == (5, 2)
    assert (summary.by_judge["claude"].wins, summary.by_judge["claude"].losses) == (1, 2)
    assert summary.overall.win_rate == 6 / 10
    # The summary survives its JSON form.
    assert PairwiseSummary.from_dict(summary.as_dict()) == summary


def test_ledger_keys_round_trip_and_bad_keys_fail():
    key = ledger_key("ab" * 32, "gpt-5.5", 44)
    assert parse_ledger_key(key) == ("ab" * 32, "gpt-5.5", 44)
    for bad in ("pair/judge", "pair/judge/x", "/judge/1", "pair/a/b/1"):
        with pytest.raises(LedgerKeyError, match="external ledger key"):
            parse_ledger_key(bad)
    rows = [
        SimpleNamespace(key=ledger_key("p1", "gpt", seed), task_id="51", verdict=v, swapped=seed == 44)
        for seed, v in zip((42, 43, 44), ("A", "tie", "B"), strict=True)
    ]
    parsed = judgments_from_ledger(rows, {"p1": "L1"})
    assert [(j.pair_id, j.judge, j.seed, j.outcome, j.generation, j.swapped) for j in parsed] == [
        ("p1", "gpt", 42, "A", "L1", False),
        ("p1", "gpt", 43, "tie", "L1", False),
        ("p1", "gpt", 44, "B", "L1", True),
    ]


@pytest.mark.parametrize(("wins", "losses"), list(itertools.product((0, 1, 5), (0, 2, 9))))
def test_rate_and_wilson_agree_on_any_counts(wins, losses):
    rate = win_rate(judgments("A" * wins + "B" * losses + "T"))
    if wins + losses == 0:
        assert rate.win_rate is None
    else:
        assert rate.win_rate == wins / (wins + losses)
        assert rate.wilson[0] <= rate.win_rate <= rate.wilson[1]
