"""The paper's benchmark table: per benchmark and generation of the lineage (L0, L1, L2 …), the score's mean ± sample
SD over trials, tasks attempted vs scored in each trial, mean output tokens, and score per output token relative to
L0 (MASS_SPEC §10, ISSUE #18.4).

A trial's score is the mean over its scored tasks (an unscored task — a grader that did not finish — is counted in
"attempted" and left out of the mean, so the table shows what is missing rather than hiding it); the figure over
trials is the mean and the sample SD (n − 1) of those per-trial means. Score per output token is Σ score / Σ output
tokens over the scored episodes with token accounting (`efficiency.score_per_output_token`), and the last column
divides it by L0's on the same benchmark.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.evaluation.benchmarks.scoring import TrialResult, mean_sd
from mass_ops.evaluation.efficiency import TokenAccounted, score_per_output_token

BASE_GENERATION = "L0"
HEADERS = (
    "benchmark",
    "generation",
    "trials",
    "score (mean ± SD)",
    "attempted/scored per trial",
    "mean output tokens",
    "score per 1k output tokens",
    "score per token vs L0",
)


@dataclass(frozen=True)
class BenchmarkCell:
    """One benchmark's figures for one generation."""

    benchmark: str
    generation: str
    trials: int
    mean: float | None
    sd: float | None
    attempted_scored: tuple[tuple[int, int], ...]
    mean_output_tokens: float | None
    score_per_output_token: float | None
    relative_to_base: float | None


def generation_order(name: str) -> tuple[int, str]:
    """L0, L1, L2 … in lineage order; other names after them, alphabetically."""
    match = re.fullmatch(r"L(\d+)", name)
    return (int(match.group(1)), "") if match else (1 << 30, name)


def _trial_mean(result: TrialResult) -> float | None:
    scores = [float(s.score) for s in result.scores if s.score is not None]
    return sum(scores) / len(scores) if scores else None


def _attempted_scored(result: TrialResult) -> tuple[int, int]:
    attempted = result.metrics.get("attempted", len(result.scores))
    scored = result.metrics.get("scored", sum(1 for s in result.scores if s.score is not None))
    return int(attempted), int(scored)


def benchmark_table(
    trials: Sequence[TrialResult], episodes: Mapping[int, TokenAccounted] | Sequence[TokenAccounted]
) -> list[BenchmarkCell]:
    """The table's cells, by benchmark then lineage order."""
    groups: dict[tuple[str, str], list[TrialResult]] = defaultdict(list)
    for result in trials:
        groups[(result.benchmark, result.generation)].append(result)
    efficiency = {
        (e.benchmark, e.generation): e
        for e in score_per_output_token([i for r in trials for i in r.scored_episodes()], episodes)
    }
    cells = []
    for benchmark, generation in sorted(groups, key=lambda k: (k[0], generation_order(k[1]))):
        results = sorted(groups[(benchmark, generation)], key=lambda r: r.trial)
        means = [m for m in map(_trial_mean, results) if m is not None]
        mean, sd = mean_sd(means) if means else (None, None)
        tokens = efficiency.get((benchmark, generation))
        per_token = tokens.score_per_output_token if tokens else None
        base = efficiency.get((benchmark, BASE_GENERATION))
        base_per_token = base.score_per_output_token if base else None
        relative = per_token / base_per_token if per_token is not None and base_per_token else None
        cells.append(
            BenchmarkCell(
                benchmark=benchmark,
                generation=generation,
                trials=len(results),
                mean=mean,
                sd=sd,
                attempted_scored=tuple(_attempted_scored(r) for r in results),
                mean_output_tokens=tokens.mean_output_tokens if tokens else None,
                score_per_output_token=per_token,
                relative_to_base=relative,
            )
        )
    return cells


def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table_rows(cells: Sequence[BenchmarkCell]) -> tuple[tuple[str, ...], ...]:
    """The cells as the report's text rows (columns: `HEADERS`)."""
    return tuple(
        (
            c.benchmark,
            c.generation,
            str(c.trials),
            f"{_number(c.mean, 3)} ± {_number(c.sd, 3)}",
            ", ".join(f"{a}/{s}" for a, s in c.attempted_scored),
            _number(c.mean_output_tokens, 0),
            _number(None if c.score_per_output_token is None else c.score_per_output_token * 1000, 4),
            "n/a" if c.relative_to_base is None else f"{c.relative_to_base:.2f}×",
        )
        for c in cells
    )


def draw_benchmark_table(cells: Sequence[BenchmarkCell], figure: Any) -> Any:
    """Two panels on `figure`: score mean ± SD per benchmark and generation, and score per token relative to L0."""
    left, right = figure.subplots(1, 2)
    if not cells:
        for ax in (left, right):
            ax.text(0.5, 0.5, "No benchmark trial recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return figure
    benchmarks = sorted({c.benchmark for c in cells})
    generations = sorted({c.generation for c in cells}, key=generation_order)
    width = 0.8 / len(generations)
    for offset, generation in enumerate(generations):
        by_benchmark = {c.benchmark: c for c in cells if c.generation == generation}
        xs = [i + offset * width for i, _ in enumerate(benchmarks)]
        chosen = [by_benchmark.get(b) for b in benchmarks]
        means = [c.mean if c and c.mean is not None else 0.0 for c in chosen]
        sds = [c.sd if c and c.sd is not None else 0.0 for c in chosen]
        left.bar(xs, means, width, yerr=sds, capsize=3, label=generation)
        ratios = [c.relative_to_base if c and c.relative_to_base is not None else 0.0 for c in chosen]
        right.bar(xs, ratios, width, label=generation)
    for ax, title in ((left, "score (mean ± sample SD over trials)"), (right, "score per output token vs L0")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(benchmarks))], benchmarks)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    right.axhline(1.0, color="#666666", linewidth=0.8, linestyle="--")
    return figure
