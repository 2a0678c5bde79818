"""Judge agreement: does the in-loop self-judge agree with the external judges on the same pairs?

MASS uses the current model as its own judge during search and ranking; the reference release names evaluator
agreement across generations as not included (MASS_SPEC §12). Here, per pair, the external verdict is the majority
over every external judgment (all judges × presentation seeds) and the self verdict the majority over the self-judge's
judgments; a majority counts A against B only, and a draw (or only ties) is a tie. A pair takes part when both sides
have a verdict. Reported per generation (side A's generation): raw agreement over A/B/tie, agreement on the pairs both
call decisively, and Cohen's kappa over the three categories.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.evaluation.stats import Judgment

SELF_JUDGE = "self"
CATEGORIES = ("A", "B", "tie")


def majority(judgments: Iterable[Judgment]) -> str | None:
    """A or B by plain majority of decisive verdicts, tie on a draw or when all are ties; None without judgments."""
    outcomes = [j.outcome for j in judgments]
    if not outcomes:
        return None
    a, b = outcomes.count("A"), outcomes.count("B")
    if a > b:
        return "A"
    if b > a:
        return "B"
    return "tie"


def cohen_kappa(pairs: Sequence[tuple[str, str]]) -> float | None:
    """Cohen's kappa of two raters over A/B/tie; None when undefined (no pairs, or chance agreement is 1)."""
    if not pairs:
        return None
    n = len(pairs)
    observed = sum(1 for left, right in pairs if left == right) / n
    left_counts = Counter(left for left, _ in pairs)
    right_counts = Counter(right for _, right in pairs)
    expected = sum(left_counts[c] * right_counts[c] for c in CATEGORIES) / (n * n)
    if expected >= 1.0:
        return None
    return (observed - expected) / (1 - expected)


@dataclass(frozen=True)
class Agreement:
    """Self-judge vs external majority over one group of pairs."""

    generation: str
    pairs: int
    agreements: int
    decisive_pairs: int
    decisive_agreements: int
    kappa: float | None
    confusion: dict[str, int]  # "<self>|<external>" -> pairs

    @property
    def rate(self) -> float | None:
        return self.agreements / self.pairs if self.pairs else None

    @property
    def decisive_rate(self) -> float | None:
        return self.decisive_agreements / self.decisive_pairs if self.decisive_pairs else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "pairs": self.pairs,
            "agreements": self.agreements,
            "rate": self.rate,
            "decisive_pairs": self.decisive_pairs,
            "decisive_agreements": self.decisive_agreements,
            "decisive_rate": self.decisive_rate,
            "kappa": self.kappa,
            "confusion": dict(self.confusion),
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Agreement:
        return cls(
            generation=str(row["generation"]),
            pairs=int(row["pairs"]),
            agreements=int(row["agreements"]),
            decisive_pairs=int(row["decisive_pairs"]),
            decisive_agreements=int(row["decisive_agreements"]),
            kappa=row.get("kappa"),
            confusion=dict(row.get("confusion") or {}),
        )


def _agreement(generation: str, verdicts: Sequence[tuple[str, str]]) -> Agreement:
    decisive = [(s, e) for s, e in verdicts if s != "tie" and e != "tie"]
    confusion = Counter(f"{s}|{e}" for s, e in verdicts)
    return Agreement(
        generation=generation,
        pairs=len(verdicts),
        agreements=sum(1 for s, e in verdicts if s == e),
        decisive_pairs=len(decisive),
        decisive_agreements=sum(1 for s, e in decisive if s == e),
        kappa=cohen_kappa(verdicts),
        confusion=dict(sorted(confusion.items())),
    )


def judge_agreement(judgments: Iterable[Judgment], *, self_judge: str = SELF_JUDGE) -> dict[str, Agreement]:
    """Agreement per generation (judgments without a generation are grouped under ``"?"``), generations sorted."""
    by_pair: dict[str, list[Judgment]] = defaultdict(list)
    for judgment in judgments:
        by_pair[judgment.pair_id].append(judgment)
    verdicts: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for rows in by_pair.values():
        own = majority(j for j in rows if j.judge == self_judge)
        external = majority(j for j in rows if j.judge != self_judge)
        if own is None or external is None:
            continue
        generations = {j.generation for j in rows if j.generation}
        generation = sorted(generations)[0] if len(generations) == 1 else "?"
        verdicts[generation].append((own, external))
    return {generation: _agreement(generation, verdicts[generation]) for generation in sorted(verdicts)}
