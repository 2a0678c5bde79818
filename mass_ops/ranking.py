"""Within-task ranking: ring tournament schedule, seeds, Bradley–Terry scores and ranks (MASS_SPEC §6).

The tournament and the Bradley–Terry fit reproduce the reference release exactly; `bootstrap_intervals` is our
addition for reports and never feeds back into scores or ranks.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.errors import InputError

#: Virtual wins (and virtual games) each candidate gets against a unit-strength reference (MASS_SPEC §6).
DEFAULT_PRIOR = 0.5
#: MM iterations of the reference fit.
DEFAULT_ITERATIONS = 500
# Bootstrap refits stop once every log-strength moves less than this; the point fit always runs all iterations.
_BOOTSTRAP_TOLERANCE = 1e-9
# Resample-by-candidate² cells fitted at once (4M float64: ~32 MB per array).
_BOOTSTRAP_CELLS = 4_000_000


class RankingError(InputError):
    """Bad input to the tournament schedule, the Bradley–Terry fit or the ranking."""


@dataclass(frozen=True)
class MatchResult:
    """One judged pair: `a` was shown as candidate A, `b` as candidate B; `winner` is a, b, or None for a tie."""

    a: str
    b: str
    winner: str | None

    @classmethod
    def from_verdict(cls, a: str, b: str, verdict: Literal["A", "B", "tie"]) -> MatchResult:
        """Map a judge verdict ("A", "B" or "tie") onto the candidate names."""
        if verdict == "A":
            return cls(a, b, a)
        if verdict == "B":
            return cls(a, b, b)
        if verdict == "tie":
            return cls(a, b, None)
        raise RankingError(f"match {a} vs {b}: verdict must be 'A', 'B' or 'tie', got {verdict!r}")


@dataclass(frozen=True)
class RankedEntry:
    """A candidate's Bradley–Terry score (log strength, mean strength 1) and rank (1 = best)."""

    name: str
    score: float
    rank: int


@dataclass(frozen=True)
class ScoreInterval:
    """Percentile bootstrap interval of one candidate's score."""

    low: float
    high: float


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RankingError(f"{what} must be an integer, got {value!r}")
    return value


def _check_names(names: Iterable[str], where: str) -> list[str]:
    listed = list(names)
    for name in listed:
        if not isinstance(name, str) or not name:
            raise RankingError(f"{where}: candidate names must be non-empty strings, got {name!r}")
    duplicates = sorted(name for name, count in Counter(listed).items() if count > 1)
    if duplicates:
        raise RankingError(f"{where}: duplicate candidate names {duplicates}")
    return listed


def tournament_pairs(names: Iterable[str], opponents: int = 6, *, seed: int) -> list[tuple[str, str]]:
    """Ring-tournament schedule: ordered (A, B) pairs, each candidate meeting `opponents` others when n allows.

    Names are sorted, shuffled with `random.Random(seed)` and placed on a ring; position i meets i+d (mod n) for
    d = 1..min(opponents/2, n-1). The unique unordered pairs are sorted, then each pair's orientation is flipped
    with probability 0.5 by `random.Random(seed + 1)` (one draw per pair, in sorted order).
    """
    opponents = _check_int(opponents, "opponents")
    seed = _check_int(seed, "tournament seed")
    if opponents < 2 or opponents % 2:
        raise RankingError(f"opponents must be even and ≥ 2, got {opponents}")
    ring = sorted(_check_names(names, "tournament"))
    random.Random(seed).shuffle(ring)
    n = len(ring)
    unordered: set[tuple[str, str]] = set()
    for i in range(n):
        for distance in range(1, min(opponents // 2, n - 1) + 1):
            first, second = ring[i], ring[(i + distance) % n]
            unordered.add((first, second) if first < second else (second, first))
    orientation = random.Random(seed + 1)
    pairs = []
    for first, second in sorted(unordered):
        pairs.append((second, first) if orientation.random() < 0.5 else (first, second))
    return pairs


def _tally(names: Sequence[str], matches: Iterable[MatchResult]) -> tuple[list[float], list[dict[int, float]]]:
    """Total wins per candidate (tie = 0.5 each) and games per opponent pair, by index."""
    index = {name: i for i, name in enumerate(names)}
    wins = [0.0] * len(names)
    games: list[dict[int, float]] = [{} for _ in names]
    for match in matches:
        if match.a not in index or match.b not in index:
            unknown = match.a if match.a not in index else match.b
            raise RankingError(f"match {match.a} vs {match.b}: unknown candidate {unknown!r}")
        if match.a == match.b:
            raise RankingError(f"match {match.a} vs {match.b}: a candidate cannot meet itself")
        i, j = index[match.a], index[match.b]
        if match.winner is None:
            wins[i] += 0.5
            wins[j] += 0.5
        elif match.winner == match.a:
            wins[i] += 1.0
        elif match.winner == match.b:
            wins[j] += 1.0
        else:
            raise RankingError(f"match {match.a} vs {match.b}: winner {match.winner!r} is neither candidate")
        games[i][j] = games[i].get(j, 0.0) + 1.0
        games[j][i] = games[j].get(i, 0.0) + 1.0
    return wins, games


def _fit(
    wins: Sequence[float],
    games: Sequence[Mapping[int, float]],
    iterations: int,
    prior: float,
    tolerance: float | None = None,
) -> list[float]:
    """Minorise–maximise fit of strengths; returns log strengths with mean strength 1."""
    n = len(wins)
    strength = [1.0] * n
    numerators = [w + prior for w in wins]
    neighbours = [tuple(g.items()) for g in games]
    for _ in range(iterations):
        updated = []
        for i in range(n):
            p_i = strength[i]
            denominator = prior / (p_i + 1.0)
            for j, count in neighbours[i]:
                denominator += count / (p_i + strength[j])
            updated.append(numerators[i] / denominator)
        # Renormalising every iteration is what keeps the fit finite: the virtual wins against the unit reference
        # carry no virtual losses, so without it every strength would keep growing.
        mean = sum(updated) / n
        updated = [p / mean for p in updated]
        change = max(abs(math.log(new / old)) for new, old in zip(updated, strength, strict=True))
        strength = updated
        if tolerance is not None and change < tolerance:
            break
    return [math.log(p) for p in strength]


def _fit_resamples(
    names: Sequence[str],
    matches: Sequence[MatchResult],
    draws: Sequence[Sequence[int]],
    iterations: int,
    prior: float,
    tolerance: float,
) -> Any:
    """`_fit` of every resample (row b: the matches at `draws[b]`) at once, as a (resamples × candidates) array of
    log strengths: the same update per row, each row frozen once it converged (as `_fit` stops)."""
    import numpy as np

    index = {name: i for i, name in enumerate(names)}
    n, count = len(names), len(draws)
    first = np.array([index[m.a] for m in matches])
    second = np.array([index[m.b] for m in matches])
    first_wins = np.array([0.5 if m.winner is None else float(m.winner == m.a) for m in matches])
    chosen = np.asarray(draws, dtype=np.int64)  # (resamples, matches)
    rows = np.repeat(np.arange(count), chosen.shape[1])
    a, b, won = first[chosen].ravel(), second[chosen].ravel(), first_wins[chosen].ravel()
    wins = np.zeros((count, n))
    np.add.at(wins, (rows, a), won)
    np.add.at(wins, (rows, b), 1.0 - won)
    games = np.zeros((count, n, n))
    np.add.at(games, (rows, a, b), 1.0)
    np.add.at(games, (rows, b, a), 1.0)

    strength = np.ones((count, n))
    numerators = wins + prior
    active = np.arange(count)
    for _ in range(iterations):
        p = strength[active]
        pair = p[:, :, None] + p[:, None, :]  # p_i + p_j (the diagonal meets no games)
        denominator = prior / (p + 1.0) + (games[active] / pair).sum(axis=2)
        updated = numerators[active] / denominator
        updated /= updated.mean(axis=1, keepdims=True)
        change = np.abs(np.log(updated / p)).max(axis=1)
        strength[active] = updated
        active = active[change >= tolerance]
        if active.size == 0:
            break
    return np.log(strength)


def _check_fit_args(iterations: int, prior: float) -> None:
    if _check_int(iterations, "iterations") < 1:
        raise RankingError(f"iterations must be ≥ 1, got {iterations}")
    if isinstance(prior, bool) or not isinstance(prior, int | float) or not math.isfinite(prior) or prior <= 0:
        raise RankingError(f"prior must be a positive number, got {prior!r}")


def bradley_terry(
    names: Iterable[str],
    matches: Iterable[MatchResult],
    iterations: int = DEFAULT_ITERATIONS,
    prior: float = DEFAULT_PRIOR,
) -> dict[str, float]:
    """Bradley–Terry scores (log strength, mean strength 1) by the reference MM iteration.

    Each iteration sets p_i' = (W_i + prior) / (prior/(p_i + 1) + Σ_j n_ij/(p_i + p_j)) for all i from the previous
    p, then rescales so that mean p = 1. W_i counts wins (a tie gives 0.5 to each side), n_ij games between i and j.
    """
    listed = _check_names(names, "Bradley–Terry fit")
    if not listed:
        raise RankingError("Bradley–Terry fit: no candidates")
    _check_fit_args(iterations, prior)
    wins, games = _tally(listed, matches)
    return dict(zip(listed, _fit(wins, games, iterations, prior), strict=True))


def rank(scores: Mapping[str, float]) -> list[RankedEntry]:
    """Order candidates by (-score, name); rank 1 is the best, ranks are 1..n with no gaps."""
    for name, score in scores.items():
        if not isinstance(score, int | float) or isinstance(score, bool) or not math.isfinite(score):
            raise RankingError(f"rank: score of {name!r} must be a finite number, got {score!r}")
    ordered = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    return [RankedEntry(name=name, score=float(score), rank=i + 1) for i, (name, score) in enumerate(ordered)]


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (q in [0, 1]) of an ascending sequence (numpy's default rule); the one quantile
    of mass-ops (ranking intervals and evaluation bootstrap intervals)."""
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = position - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * fraction


def bootstrap_intervals(
    names: Iterable[str],
    matches: Iterable[MatchResult],
    n_boot: int = 1000,
    *,
    seed: int,
    level: float = 0.95,
    iterations: int = DEFAULT_ITERATIONS,
    prior: float = DEFAULT_PRIOR,
) -> dict[str, ScoreInterval]:
    """Percentile bootstrap intervals of the Bradley–Terry scores.

    Resamples the matches with replacement `n_boot` times (random.Random(seed)), refits each resample with the same
    update (stopping early once converged) and takes the (1±level)/2 percentiles per candidate. Scores and ranks
    come from `bradley_terry` alone; this only describes their uncertainty.
    """
    listed = _check_names(names, "bootstrap")
    if not listed:
        raise RankingError("bootstrap: no candidates")
    _check_fit_args(iterations, prior)
    if _check_int(n_boot, "n_boot") < 2:
        raise RankingError(f"bootstrap: n_boot must be ≥ 2, got {n_boot}")
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0.0 < level < 1.0:
        raise RankingError(f"bootstrap: level must be between 0 and 1 (exclusive), got {level!r}")
    pool = list(matches)
    if not pool:
        raise RankingError("bootstrap: no matches to resample")
    _tally(listed, pool)  # validate every match once, before the resampling
    rng = random.Random(_check_int(seed, "bootstrap seed"))
    # The same draws as resampling the matches one by one (`choices` maps each random() to an index alike), fitted
    # all at once: a pure-Python refit per resample cost seconds of CPU per task and held the interpreter lock.
    draws = [rng.choices(range(len(pool)), k=len(pool)) for _ in range(n_boot)]
    # In chunks: a chunk's (resamples × candidates²) arrays stay near 32 MB even for hundreds of candidates.
    chunk = max(1, _BOOTSTRAP_CELLS // (len(listed) * len(listed)))
    samples: list[list[float]] = [[] for _ in listed]
    for start in range(0, n_boot, chunk):
        fitted = _fit_resamples(listed, pool, draws[start : start + chunk], iterations, prior, _BOOTSTRAP_TOLERANCE)
        for column, values in zip(samples, fitted.T.tolist(), strict=True):
            column.extend(values)
    for column in samples:
        column.sort()
    tail = (1.0 - level) / 2.0
    intervals = {}
    for name, column in zip(listed, samples, strict=True):
        intervals[name] = ScoreInterval(low=quantile(column, tail), high=quantile(column, 1.0 - tail))
    return intervals
