"""Judge agreement: the in-loop self-judge against the external majority, per generation, on a hand-built ledger."""

from __future__ import annotations

import pytest

from mass_ops.evaluation.agreement import cohen_kappa, judge_agreement, majority
from mass_ops.evaluation.stats import Judgment


def ledger(rows: list[tuple[str, str, str, str]]) -> list[Judgment]:
    """(pair, generation, judge, verdicts) → one judgment per verdict character (A, B, T = tie, I = invalid)."""
    code = {"A": "A", "B": "B", "T": "tie", "I": "invalid"}
    out = []
    for pair, generation, judge, verdicts in rows:
        for seed, verdict in enumerate(verdicts, start=42):
            out.append(Judgment(pair, 51, judge, seed, code[verdict], generation=generation))
    return out


def test_majority_counts_decisive_verdicts_only():
    judged = ledger([("p", "L1", "x", "AAB"), ("q", "L1", "x", "ABT"), ("r", "L1", "x", "TTI"), ("s", "L1", "x", "TB")])
    by_pair = {pair: [j for j in judged if j.pair_id == pair] for pair in "pqrs"}
    assert majority(by_pair["p"]) == "A"
    assert majority(by_pair["q"]) == "tie"
    assert majority(by_pair["r"]) == "tie"
    assert majority(by_pair["s"]) == "B"
    assert majority([]) is None


def test_agreement_per_generation_on_a_hand_built_ledger():
    rows = [
        # generation L1: external majorities A, B, tie, A; self says A, A, tie, A -> 3 of 4 agree.
        ("p1", "L1", "gpt", "AAB"), ("p1", "L1", "claude", "ATA"), ("p1", "L1", "self", "A"),
        ("p2", "L1", "gpt", "BBB"), ("p2", "L1", "claude", "BBA"), ("p2", "L1", "self", "A"),
        ("p3", "L1", "gpt", "ABT"), ("p3", "L1", "claude", "TTT"), ("p3", "L1", "self", "T"),
        ("p4", "L1", "gpt", "AAA"), ("p4", "L1", "claude", "AAA"), ("p4", "L1", "self", "ABA"),
        # a pair without a self verdict does not count
        ("p5", "L1", "gpt", "BBB"),
        # generation L2: majorities B, A; self says B, B -> 1 of 2.
        ("q1", "L2", "gpt", "BBB"), ("q1", "L2", "self", "B"),
        ("q2", "L2", "gpt", "AAB"), ("q2", "L2", "claude", "AAI"), ("q2", "L2", "self", "B"),
    ]  # fmt: skip
    result = judge_agreement(ledger(rows))
    assert list(result) == ["L1", "L2"]
    l1, l2 = result["L1"], result["L2"]
    assert (l1.pairs, l1.agreements, l1.rate) == (4, 3, 0.75)
    # Decisive on both sides: p1 (A/A), p2 (A/B), p4 (A/A) -> 2 of 3.
    assert (l1.decisive_pairs, l1.decisive_agreements) == (3, 2)
    assert l1.confusion == {"A|A": 2, "A|B": 1, "tie|tie": 1}
    # kappa for L1: observed 0.75; self (A,A,tie,A) vs external (A,B,tie,A): expected = (3·2 + 0·1 + 1·1)/16.
    expected = (3 * 2 + 1 * 1) / 16
    assert l1.kappa == pytest.approx((0.75 - expected) / (1 - expected))
    assert (l2.pairs, l2.agreements, l2.rate, l2.decisive_rate) == (2, 1, 0.5, 0.5)


def test_kappa_edge_cases():
    assert cohen_kappa([]) is None
    assert cohen_kappa([("A", "A"), ("A", "A")]) is None  # chance agreement is 1: undefined
    assert cohen_kappa([("A", "A"), ("B", "B")]) == 1.0
    assert cohen_kappa([("A", "B"), ("B", "A")]) == -1.0


def test_no_self_verdicts_means_no_agreement_rows():
    assert judge_agreement(ledger([("p1", "L1", "gpt", "AAA"), ("p1", "L1", "claude", "BBB")])) == {}
