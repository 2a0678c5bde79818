"""The ranking's bootstrap intervals (`mass_ops.ranking.bootstrap_intervals`): the resamples fitted at once against the
baseline of refitting them one by one with the reference update (`_fit`), on the same draws, in the same run.

A paper task ranks 16 candidates over 48 ring matches with 1,000 resamples; the one-by-one refit is pure Python and
holds the interpreter lock for seconds per task, which stalls every other chain of an in-process inner loop.

    .venv/bin/python benchmarks/ranking_bootstrap.py [--candidates 16] [--opponents 6] [--resamples 1000]
"""

from __future__ import annotations

import argparse
import random
import time

from mass_ops.ranking import (
    _BOOTSTRAP_TOLERANCE,
    DEFAULT_ITERATIONS,
    DEFAULT_PRIOR,
    MatchResult,
    _fit,
    _tally,
    bootstrap_intervals,
    tournament_pairs,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--opponents", type=int, default=6)
    parser.add_argument("--resamples", type=int, default=1000)
    args = parser.parse_args(argv)
    names = [f"c{i:02d}" for i in range(args.candidates)]
    rng = random.Random(1)
    matches = [
        MatchResult(a, b, a if rng.random() < 0.5 else b) for a, b in tournament_pairs(names, args.opponents, seed=1)
    ]

    start = time.perf_counter()
    bootstrap_intervals(names, matches, args.resamples, seed=3)
    vectorised = time.perf_counter() - start

    start = time.perf_counter()
    draws = random.Random(3)
    for _ in range(args.resamples):
        wins, games = _tally(names, draws.choices(matches, k=len(matches)))
        _fit(wins, games, DEFAULT_ITERATIONS, DEFAULT_PRIOR, _BOOTSTRAP_TOLERANCE)
    one_by_one = time.perf_counter() - start

    print(
        f"bootstrap of {args.candidates} candidates, {len(matches)} matches, {args.resamples} resamples: "
        f"{vectorised:.3f} s fitted at once, {one_by_one:.3f} s one by one (baseline); "
        f"ratio {vectorised / one_by_one:.3f}"
    )


if __name__ == "__main__":
    main()
