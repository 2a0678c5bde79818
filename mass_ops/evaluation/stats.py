"""Win rates of side A in external pairwise judgments, with intervals (MASS_SPEC §5 tie handling, §10 summary).

win rate = W / (W + L): ties (and invalid verdicts, which count as ties) are excluded; with no decisive judgment the
rate is None, never 0.5. Two 95% intervals: Wilson's score interval on W out of W + L (treats judgments as
independent), and a pair bootstrap that resamples pairs with all their judgments — judgments of one pair share the
two workspaces, so the bootstrap is the honest one when several judges and seeds look at each pair. Tables are given
per task, per split, per judge and overall.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.errors import InputError
from mass_ops.ranking import quantile

# Two-sided 95%: the standard normal quantile at 0.975.
Z_95 = 1.959963984540054
DEFAULT_BOOTSTRAP_SAMPLES = 2000
DEFAULT_BOOTSTRAP_SEED = 20261014


class LedgerKeyError(InputError):
    """An external-ledger key is not ``<pair_id>/<judge>/<seed>``."""


@dataclass(frozen=True)
class Judgment:
    """One judgment of a pair in side-A orientation (after mapping any presentation swap back)."""

    pair_id: str
    task: int
    judge: str
    seed: int
    verdict: str  # A, B, tie or invalid
    generation: str | None = None  # side A's generation: what the evaluation is of
    swapped: bool = False

    @property
    def outcome(self) -> str:
        """A, B or tie (an invalid verdict counts as a tie)."""
        return self.verdict if self.verdict in ("A", "B") else "tie"


def ledger_key(pair: str, judge: str, seed: int) -> str:
    """Key of one judgment in the external ledger."""
    return f"{pair}/{judge}/{seed}"


def parse_ledger_key(key: str) -> tuple[str, str, int]:
    """(pair_id, judge, seed) of an external-ledger key; judge names may not contain '/'."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise LedgerKeyError(f"external ledger key {key!r} is not <pair_id>/<judge>/<seed>")
    try:
        seed = int(parts[2])
    except ValueError:
        raise LedgerKeyError(f"external ledger key {key!r}: seed {parts[2]!r} is not an integer") from None
    return parts[0], parts[1], seed


def judgments_from_ledger(rows: Iterable[Any], generation_of: Mapping[str, str] | None = None) -> list[Judgment]:
    """Judgments from external-ledger `Comparison` rows; `generation_of` maps pair ids to side A's generation."""
    judgments = []
    for row in rows:
        pair, judge, seed = parse_ledger_key(row.key)
        judgments.append(
            Judgment(
                pair_id=pair,
                task=int(row.task_id),
                judge=judge,
                seed=seed,
                verdict=row.verdict,
                generation=(generation_of or {}).get(pair),
                swapped=bool(row.swapped),
            )
        )
    return judgments


def wilson_interval(wins: int, trials: int, z: float = Z_95) -> tuple[float, float] | None:
    """Wilson score interval of `wins` successes in `trials`; None when there are no trials."""
    if trials <= 0:
        return None
    if not 0 <= wins <= trials:
        raise ValueError(f"wilson_interval: wins {wins} must lie in [0, {trials}]")
    p = wins / trials
    z2 = z * z
    denominator = 1 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def pair_bootstrap_interval(
    judgments: Sequence[Judgment],
    *,
    samples: int = DEFAULT_BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_BOOTSTRAP_SEED,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile interval of W/(W+L) over resamples of whole pairs; resamples without a decisive judgment are
    skipped. None when no judgment is decisive or `samples` < 2."""
    per_pair: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for judgment in judgments:
        counts = per_pair[judgment.pair_id]
        if judgment.outcome == "A":
            counts[0] += 1
        elif judgment.outcome == "B":
            counts[1] += 1
    pairs = [tuple(counts) for counts in per_pair.values()]
    if samples < 2 or not any(w + lose for w, lose in pairs):
        return None
    rng = random.Random(seed)
    n = len(pairs)
    rates = []
    for _ in range(samples):
        wins = losses = 0
        for _ in range(n):
            w, lose = pairs[rng.randrange(n)]
            wins += w
            losses += lose
        if wins + losses:
            rates.append(wins / (wins + losses))
    if not rates:
        return None
    rates.sort()
    alpha = (1 - level) / 2
    return quantile(rates, alpha), quantile(rates, 1 - alpha)


@dataclass(frozen=True)
class WinRate:
    """Counts and win rate of side A over a group of judgments."""

    wins: int
    losses: int
    ties: int
    invalid: int
    judgments: int
    pairs: int
    win_rate: float | None
    wilson: tuple[float, float] | None
    bootstrap: tuple[float, float] | None

    @property
    def decisive(self) -> int:
        return self.wins + self.losses

    def as_dict(self) -> dict[str, Any]:
        return {
            "wins": self.wins,
            "losses": self.losses,
            "ties": self.ties,
            "invalid": self.invalid,
            "judgments": self.judgments,
            "pairs": self.pairs,
            "win_rate": self.win_rate,
            "wilson_95": list(self.wilson) if self.wilson else None,
            "bootstrap_95": list(self.bootstrap) if self.bootstrap else None,
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> WinRate:
        wilson, boot = row.get("wilson_95"), row.get("bootstrap_95")
        return cls(
            wins=int(row["wins"]),
            losses=int(row["losses"]),
            ties=int(row["ties"]),
            invalid=int(row.get("invalid", 0)),
            judgments=int(row["judgments"]),
            pairs=int(row.get("pairs", 0)),
            win_rate=row.get("win_rate"),
            wilson=(float(wilson[0]), float(wilson[1])) if wilson else None,
            bootstrap=(float(boot[0]), float(boot[1])) if boot else None,
        )


def win_rate(
    judgments: Sequence[Judgment],
    *,
    bootstrap_samples: int = DEFAULT_BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_BOOTSTRAP_SEED,
) -> WinRate:
    """W/(W+L) of side A with Wilson and pair-bootstrap 95% intervals; ties and invalid verdicts excluded."""
    wins = sum(1 for j in judgments if j.outcome == "A")
    losses = sum(1 for j in judgments if j.outcome == "B")
    invalid = sum(1 for j in judgments if j.verdict == "invalid")
    ties = len(judgments) - wins - losses
    decisive = wins + losses
    return WinRate(
        wins=wins,
        losses=losses,
        ties=ties,
        invalid=invalid,
        judgments=len(judgments),
        pairs=len({j.pair_id for j in judgments}),
        win_rate=wins / decisive if decisive else None,
        wilson=wilson_interval(wins, decisive),
        bootstrap=pair_bootstrap_interval(judgments, samples=bootstrap_samples, seed=seed),
    )


def grouped_win_rates(
    judgments: Sequence[Judgment],
    key: Callable[[Judgment], str],
    *,
    bootstrap_samples: int = DEFAULT_BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_BOOTSTRAP_SEED,
) -> dict[str, WinRate]:
    """Win rate per group, groups in sorted order (numeric task ids sort numerically)."""
    groups: dict[str, list[Judgment]] = defaultdict(list)
    for judgment in judgments:
        groups[key(judgment)].append(judgment)
    ordered = sorted(groups, key=lambda name: (0, int(name), "") if name.isdigit() else (1, 0, name))
    return {name: win_rate(groups[name], bootstrap_samples=bootstrap_samples, seed=seed) for name in ordered}


@dataclass(frozen=True)
class PairwiseSummary:
    """Overall, per-task, per-split and per-judge win rates of one evaluation."""

    overall: WinRate
    by_task: dict[str, WinRate]
    by_split: dict[str, WinRate]
    by_judge: dict[str, WinRate]

    def as_dict(self) -> dict[str, Any]:
        return {
            "overall": self.overall.as_dict(),
            "by_task": {name: rate.as_dict() for name, rate in self.by_task.items()},
            "by_split": {name: rate.as_dict() for name, rate in self.by_split.items()},
            "by_judge": {name: rate.as_dict() for name, rate in self.by_judge.items()},
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> PairwiseSummary:
        return cls(
            overall=WinRate.from_dict(row["overall"]),
            by_task={k: WinRate.from_dict(v) for k, v in row.get("by_task", {}).items()},
            by_split={k: WinRate.from_dict(v) for k, v in row.get("by_split", {}).items()},
            by_judge={k: WinRate.from_dict(v) for k, v in row.get("by_judge", {}).items()},
        )


def summarize_judgments(
    judgments: Sequence[Judgment],
    split_of: Callable[[int], str],
    *,
    bootstrap_samples: int = DEFAULT_BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_BOOTSTRAP_SEED,
) -> PairwiseSummary:
    """The summary tables; `split_of(task)` names a task's split (train / test)."""
    options = {"bootstrap_samples": bootstrap_samples, "seed": seed}
    return PairwiseSummary(
        overall=win_rate(judgments, **options),
        by_task=grouped_win_rates(judgments, lambda j: str(j.task), **options),
        by_split=grouped_win_rates(judgments, lambda j: split_of(j.task), **options),
        by_judge=grouped_win_rates(judgments, lambda j: j.judge, **options),
    )


def format_rate(rate: WinRate, interval: str = "bootstrap") -> str:
    """``0.625 [0.41, 0.80]`` or ``n/a`` when no judgment is decisive."""
    if rate.win_rate is None:
        return "n/a"
    bounds = rate.bootstrap if interval == "bootstrap" else rate.wilson
    if bounds is None:
        return f"{rate.win_rate:.3f}"
    return f"{rate.win_rate:.3f} [{bounds[0]:.2f}, {bounds[1]:.2f}]"
