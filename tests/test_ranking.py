"""Ring tournament, seeds, Bradley–Terry fit and bootstrap intervals (MASS_SPEC §6)."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest

from mass_ops.ranking import (
    MatchResult,
    RankedEntry,
    RankingError,
    bootstrap_intervals,
    bradley_terry,
    rank,
    tournament_pairs,
)
from mass_ops.seeds import schedule_seed

NAMES = [f"t51_L0_s{715100 + i}" for i in range(18)]


def _degrees(pairs: list[tuple[str, str]]) -> Counter[str]:
    return Counter(name for pair in pairs for name in pair)


def _connected(names: list[str], pairs: list[tuple[str, str]]) -> bool:
    links: dict[str, set[str]] = defaultdict(set)
    for a, b in pairs:
        links[a].add(b)
        links[b].add(a)
    seen, frontier = {names[0]}, [names[0]]
    while frontier:
        for other in links[frontier.pop()] - seen:
            seen.add(other)
            frontier.append(other)
    return seen == set(names)


def _random_matches(names: list[str], pairs: list[tuple[str, str]], rng: random.Random) -> list[MatchResult]:
    """Outcomes drawn from a latent Bradley–Terry model, with ~10 % ties."""
    strength = {name: rng.gauss(0.0, 1.2) for name in names}
    matches = []
    for a, b in pairs:
        if rng.random() < 0.1:
            matches.append(MatchResult(a, b, None))
        else:
            p_a = 1.0 / (1.0 + math.exp(strength[b] - strength[a]))
            matches.append(MatchResult(a, b, a if rng.random() < p_a else b))
    return matches


# --- tournament ---------------------------------------------------------------------------------------------------


def test_paper_tournament_has_54_unique_pairs_degree_6_connected() -> None:
    pairs = tournament_pairs(NAMES, 6, seed=schedule_seed(1234, 51))
    unordered = {tuple(sorted(pair)) for pair in pairs}
    assert len(pairs) == 54
    assert len(unordered) == 54
    assert all(a != b for a, b in pairs)
    assert set(_degrees(pairs).values()) == {6}
    assert set(_degrees(pairs)) == set(NAMES)
    assert _connected(NAMES, pairs)


def test_tournament_is_deterministic_and_independent_of_input_order() -> None:
    shuffled = NAMES[::-1]
    assert tournament_pairs(NAMES, 6, seed=99) == tournament_pairs(shuffled, 6, seed=99)
    assert tournament_pairs(NAMES, 6, seed=99) != tournament_pairs(NAMES, 6, seed=100)


def test_tournament_follows_the_ring_then_orientation_recipe() -> None:
    seed = 1285
    pairs = tournament_pairs(NAMES, 6, seed=seed)
    ring = sorted(NAMES)
    random.Random(seed).shuffle(ring)
    position = {name: i for i, name in enumerate(ring)}
    for a, b in pairs:
        gap = (position[a] - position[b]) % 18
        assert min(gap, 18 - gap) in (1, 2, 3)
    # The unordered pairs come out sorted; the orientation of each is one Random(seed + 1) draw in that order.
    unordered = [tuple(sorted(pair)) for pair in pairs]
    assert unordered == sorted(unordered)
    draws = random.Random(seed + 1)
    assert [pair != sorted_pair for pair, sorted_pair in zip(pairs, unordered, strict=True)] == [
        draws.random() < 0.5 for _ in pairs
    ]


def test_orientation_depends_on_the_seed_and_mixes_both_ways() -> None:
    flips = []
    for seed in range(20):
        pairs = tournament_pairs(NAMES, 6, seed=seed)
        flips.append(sum(a > b for a, b in pairs))
    assert all(5 < count < 49 for count in flips)
    assert len(set(flips)) > 3


def test_small_pools_pair_everyone_without_duplicates() -> None:
    four = ["a", "b", "c", "d"]
    pairs = tournament_pairs(four, 6, seed=3)
    assert sorted(tuple(sorted(p)) for p in pairs) == [
        ("a", "b"),
        ("a", "c"),
        ("a", "d"),
        ("b", "c"),
        ("b", "d"),
        ("c", "d"),
    ]
    assert tournament_pairs(["solo"], 6, seed=3) == []
    assert tournament_pairs([], 2, seed=3) == []
    two_opponents = tournament_pairs(NAMES, 2, seed=5)
    assert len(two_opponents) == 18 and set(_degrees(two_opponents).values()) == {2}


@pytest.mark.parametrize("opponents", [0, 1, 3, 5, -2, True, 2.0])
def test_invalid_opponents_are_rejected(opponents: object) -> None:
    with pytest.raises(RankingError, match="opponents"):
        tournament_pairs(NAMES, opponents, seed=1)  # type: ignore[arg-type]


def test_duplicate_or_empty_names_are_rejected() -> None:
    with pytest.raises(RankingError, match="duplicate candidate names"):
        tournament_pairs(["a", "b", "a"], 2, seed=1)
    with pytest.raises(RankingError, match="non-empty strings"):
        tournament_pairs(["a", ""], 2, seed=1)


# --- Bradley–Terry ------------------------------------------------------------------------------------------------


def test_chain_orders_a_above_b_above_c() -> None:
    matches = [MatchResult("a", "b", "a"), MatchResult("c", "b", "b"), MatchResult("a", "c", "a")]
    scores = bradley_terry(["a", "b", "c"], matches)
    assert scores["a"] > scores["b"] > scores["c"]
    assert [entry.name for entry in rank(scores)] == ["a", "b", "c"]
    only_links = bradley_terry(["a", "b", "c"], matches[:2])
    assert only_links["a"] > only_links["b"] > only_links["c"]


def test_ties_are_symmetric() -> None:
    assert bradley_terry(["x", "y"], [MatchResult("x", "y", None)]) == pytest.approx({"x": 0.0, "y": 0.0})
    matches = [MatchResult("a", "b", None), MatchResult("a", "c", "a"), MatchResult("c", "b", "b")]
    scores = bradley_terry(["a", "b", "c"], matches)
    assert scores["a"] == pytest.approx(scores["b"], abs=1e-12)
    assert scores["a"] > scores["c"]
    # Swapping who was shown first changes nothing.
    swapped = [MatchResult(m.b, m.a, m.winner) for m in matches]
    assert bradley_terry(["a", "b", "c"], swapped) == pytest.approx(scores, abs=1e-12)


def test_mean_strength_is_one() -> None:
    rng = random.Random(7)
    matches = _random_matches(NAMES, tournament_pairs(NAMES, 6, seed=7), rng)
    scores = bradley_terry(NAMES, matches)
    assert sum(math.exp(s) for s in scores.values()) / len(NAMES) == pytest.approx(1.0, abs=1e-12)
    assert max(scores.values()) - min(scores.values()) > 0.5


def _reference_stationarity(names, matches, scores, prior=0.5) -> list[float]:
    """(W_i + prior) / (p_i · D_i(p)) per candidate; constant across i at the reference fixed point."""
    p = {name: math.exp(scores[name]) for name in names}
    wins = dict.fromkeys(names, 0.0)
    denominators = {name: prior / (p[name] + 1.0) for name in names}
    for m in matches:
        if m.winner is None:
            wins[m.a] += 0.5
            wins[m.b] += 0.5
        else:
            wins[m.winner] += 1.0
        denominators[m.a] += 1.0 / (p[m.a] + p[m.b])
        denominators[m.b] += 1.0 / (p[m.a] + p[m.b])
    return [(wins[name] + prior) / (p[name] * denominators[name]) for name in names]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (rows[r][n] - sum(rows[r][c] * solution[c] for c in range(r + 1, n))) / rows[r][r]
    return solution


def _independent_fit(names: list[str], matches: list[MatchResult], prior: float = 0.5) -> dict[str, float]:
    """Penalised maximum likelihood by Newton's method, written independently of the MM update.

    The reference prior gives each candidate `prior` virtual wins in `prior` virtual games against a unit-strength
    reference (no virtual losses), so the penalised log-likelihood ℓ(θ) = Σ a_i θ_i − h(θ), with a_i = W_i + prior and
    h(θ) = Σ_games log(e^θa + e^θb) + prior Σ_i log(e^θi + 1), has no maximum: it grows along θ + t. Renormalising to
    mean strength 1 each iteration makes the reference converge to the maximiser of ℓ_s(θ) = s Σ a_i θ_i − h(θ)
    for the s at which mean e^θ = 1. We find that s by Newton's method on log(mean e^θ(s)), using dθ/ds = H⁻¹a.
    """
    n = len(names)
    index = {name: i for i, name in enumerate(names)}
    a = [prior] * n
    games: list[tuple[int, int]] = []
    for m in matches:
        i, j = index[m.a], index[m.b]
        games.append((i, j))
        if m.winner is None:
            a[i] += 0.5
            a[j] += 0.5
        else:
            a[index[m.winner]] += 1.0

    def gradient_hessian(theta: list[float], s: float) -> tuple[list[float], list[list[float]]]:
        p = [math.exp(t) for t in theta]
        grad = [s * a[i] - prior * p[i] / (p[i] + 1.0) for i in range(n)]
        hess = [[0.0] * n for _ in range(n)]  # Hessian of h (positive definite)
        for i in range(n):
            hess[i][i] += prior * p[i] / (p[i] + 1.0) ** 2
        for i, j in games:
            share = p[i] / (p[i] + p[j])
            grad[i] -= share
            grad[j] -= 1.0 - share
            curvature = share * (1.0 - share)
            hess[i][i] += curvature
            hess[j][j] += curvature
            hess[i][j] -= curvature
            hess[j][i] -= curvature
        return grad, hess

    def maximise(theta: list[float], s: float) -> list[float]:
        for _ in range(100):
            grad, hess = gradient_hessian(theta, s)
            step = _solve(hess, grad)
            # Damp huge steps: early outer iterates can sit far from the optimum.
            biggest = max(abs(x) for x in step)
            scale = min(1.0, 2.0 / biggest) if biggest else 1.0
            theta = [t + scale * x for t, x in zip(theta, step, strict=True)]
            if biggest < 1e-13:
                break
        return theta

    total_games = len(games)
    low, high = total_games / (total_games + n * prior), 1.0  # ℓ_s is bounded above exactly for s in (low, high)
    s = (low + high) / 2.0
    theta = [0.0] * n
    for _ in range(200):
        theta = maximise(theta, s)
        p = [math.exp(t) for t in theta]
        g = math.log(sum(p) / n)
        if abs(g) < 1e-14:
            break
        if g > 0:
            high = s
        else:
            low = s
        _, hess = gradient_hessian(theta, s)
        d_theta = _solve(hess, a)
        d_g = sum(pi * d for pi, d in zip(p, d_theta, strict=True)) / sum(p)
        candidate = s - g / d_g
        s = candidate if low < candidate < high else (low + high) / 2.0
    return {name: theta[index[name]] for name in names}


def test_reference_fit_is_a_fixed_point_of_the_normalised_update() -> None:
    rng = random.Random(11)
    names = [*NAMES, "idle"]
    matches = _random_matches(NAMES, tournament_pairs(NAMES, 6, seed=11), rng)
    scores = bradley_terry(names, matches)
    ratios = _reference_stationarity(names, matches, scores)
    assert max(ratios) - min(ratios) < 1e-9
    # Reference quirk: the prior's virtual wins carry no virtual losses, so a candidate without games settles at
    # strength 1/(c - 1) for the common ratio c, above the field, not at the unit reference.
    common = ratios[0]
    assert math.exp(scores["idle"]) == pytest.approx(1.0 / (common - 1.0), rel=1e-9)
    assert scores["idle"] == max(scores.values())


@pytest.mark.parametrize("case", range(24))
def test_ranks_agree_with_an_independent_newton_fit(case: int) -> None:
    rng = random.Random(1000 + case)
    n = rng.choice([6, 9, 12, 18])
    names = [f"ep{i:02d}" for i in range(n)]
    pairs = tournament_pairs(names, rng.choice([2, 4, 6]), seed=case)
    pairs += [tuple(rng.sample(names, 2)) for _ in range(rng.randint(0, n))]  # repeats and extra pairs
    matches = _random_matches(names, pairs, rng)
    ours = bradley_terry(names, matches)
    theirs = _independent_fit(names, matches)
    assert max(abs(ours[name] - theirs[name]) for name in names) < 1e-6
    # Same order wherever the scores are not a numerical tie.
    for first in names:
        for second in names:
            if theirs[first] - theirs[second] > 1e-6:
                assert ours[first] > ours[second]
    ranked_ours = [entry.name for entry in rank({k: round(v, 6) for k, v in ours.items()})]
    ranked_theirs = [entry.name for entry in rank({k: round(v, 6) for k, v in theirs.items()})]
    assert ranked_ours == ranked_theirs


def test_bad_matches_are_rejected_with_the_pair_named() -> None:
    with pytest.raises(RankingError, match="unknown candidate 'z'"):
        bradley_terry(["a", "b"], [MatchResult("a", "z", "a")])
    with pytest.raises(RankingError, match="cannot meet itself"):
        bradley_terry(["a", "b"], [MatchResult("a", "a", "a")])
    with pytest.raises(RankingError, match="neither candidate"):
        bradley_terry(["a", "b", "c"], [MatchResult("a", "b", "c")])
    with pytest.raises(RankingError, match="iterations"):
        bradley_terry(["a", "b"], [], iterations=0)
    with pytest.raises(RankingError, match="prior"):
        bradley_terry(["a", "b"], [], prior=0.0)
    with pytest.raises(RankingError, match="no candidates"):
        bradley_terry([], [])


def test_verdicts_map_onto_names() -> None:
    assert MatchResult.from_verdict("x", "y", "A").winner == "x"
    assert MatchResult.from_verdict("x", "y", "B").winner == "y"
    assert MatchResult.from_verdict("x", "y", "tie").winner is None
    with pytest.raises(RankingError, match="verdict"):
        MatchResult.from_verdict("x", "y", "a")  # type: ignore[arg-type]


def test_rank_sorts_by_score_then_name() -> None:
    ranked = rank({"b": 0.5, "a": 0.5, "c": 1.0, "d": -2.0})
    assert ranked == [
        RankedEntry("c", 1.0, 1),
        RankedEntry("a", 0.5, 2),
        RankedEntry("b", 0.5, 3),
        RankedEntry("d", -2.0, 4),
    ]
    with pytest.raises(RankingError, match="finite"):
        rank({"a": float("nan")})


# --- bootstrap ----------------------------------------------------------------------------------------------------


def test_bootstrap_intervals_contain_the_estimate_and_leave_it_unchanged() -> None:
    rng = random.Random(5)
    matches = _random_matches(NAMES, tournament_pairs(NAMES, 6, seed=5), rng)
    before = bradley_terry(NAMES, matches)
    intervals = bootstrap_intervals(NAMES, matches, 200, seed=3)
    assert set(intervals) == set(NAMES)
    for name in NAMES:
        assert intervals[name].low <= before[name] <= intervals[name].high
        assert intervals[name].low < intervals[name].high
    assert bradley_terry(NAMES, matches) == before
    assert bootstrap_intervals(NAMES, matches, 200, seed=3) == intervals


def test_bootstrap_intervals_shrink_with_more_matches() -> None:
    rng = random.Random(6)
    names = NAMES[:10]
    pairs = tournament_pairs(names, 4, seed=6)
    strength = {name: rng.gauss(0.0, 1.0) for name in names}

    def play(rounds: int) -> list[MatchResult]:
        out = []
        for _ in range(rounds):
            for a, b in pairs:
                p_a = 1.0 / (1.0 + math.exp(strength[b] - strength[a]))
                out.append(MatchResult(a, b, a if rng.random() < p_a else b))
        return out

    def mean_width(matches: list[MatchResult]) -> float:
        intervals = bootstrap_intervals(names, matches, 150, seed=1)
        return sum(i.high - i.low for i in intervals.values()) / len(names)

    few, many = mean_width(play(1)), mean_width(play(12))
    assert many < 0.6 * few


def test_bootstrap_rejects_bad_arguments() -> None:
    matches = [MatchResult("a", "b", "a")]
    with pytest.raises(RankingError, match="level"):
        bootstrap_intervals(["a", "b"], matches, 10, seed=1, level=1.0)
    with pytest.raises(RankingError, match="n_boot"):
        bootstrap_intervals(["a", "b"], matches, 1, seed=1)
    with pytest.raises(RankingError, match="no matches"):
        bootstrap_intervals(["a", "b"], [], 10, seed=1)
    with pytest.raises(RankingError, match="unknown candidate"):
        bootstrap_intervals(["a", "b"], [MatchResult("a", "q", "a")], 10, seed=1)


def test_the_resamples_are_fitted_as_one_by_one_refits_would_fit_them() -> None:
    """The vectorised bootstrap: the same draws as resampling the matches one by one, each refit equal to the
    reference update (`_fit` with the bootstrap's early stop) on that resample, in any chunking."""
    from mass_ops import ranking

    rng = random.Random(8)
    matches = _random_matches(NAMES, tournament_pairs(NAMES, 6, seed=8), rng)
    matches += [MatchResult(NAMES[0], NAMES[1], None)]  # a tie
    draws = [random.Random(11 + b).choices(range(len(matches)), k=len(matches)) for b in range(12)]
    fitted = ranking._fit_resamples(NAMES, matches, draws, 500, 0.5, ranking._BOOTSTRAP_TOLERANCE)
    for row, drawn in zip(fitted, draws, strict=True):
        wins, games = ranking._tally(NAMES, [matches[i] for i in drawn])
        expected = ranking._fit(wins, games, 500, 0.5, ranking._BOOTSTRAP_TOLERANCE)
        assert list(row) == pytest.approx(expected, abs=1e-9)
    # The draws are the ones `choices` over the matches themselves makes (the same objects, in the same order).
    by_index = [id(matches[i]) for i in random.Random(4).choices(range(len(matches)), k=len(matches))]
    assert by_index == [id(m) for m in random.Random(4).choices(matches, k=len(matches))]


def test_the_intervals_do_not_depend_on_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    from mass_ops import ranking

    rng = random.Random(9)
    matches = _random_matches(NAMES, tournament_pairs(NAMES, 6, seed=9), rng)
    whole = bootstrap_intervals(NAMES, matches, 60, seed=2)
    monkeypatch.setattr(ranking, "_BOOTSTRAP_CELLS", len(NAMES) ** 2 * 7)  # 7 resamples per chunk
    assert bootstrap_intervals(NAMES, matches, 60, seed=2) == whole
