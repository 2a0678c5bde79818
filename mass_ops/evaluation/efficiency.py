"""Score per output token: how much benchmark score a generation buys with the tokens its agent writes.

Per (benchmark, generation): the scores of the scored episodes divided by the output (completion) tokens those
episodes spent, from the episodes' token accounting. Episodes without token accounting are left out of both sums and
counted, so a missing proxy log cannot inflate the figure. A later generation that scores the same with fewer tokens
shows up here even when its raw score does not move.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class TokenAccounted(Protocol):
    """What is read from an episode row."""

    id: int
    completion_tokens: int | None


@dataclass(frozen=True)
class ScoredEpisode:
    """The score one episode earned on a benchmark task (e.g. SAB success 0/1, MLR overall 0–10)."""

    benchmark: str
    generation: str
    task: str
    trial: int
    score: float
    episode_id: int


@dataclass(frozen=True)
class Efficiency:
    """Score per output token of one benchmark and generation."""

    benchmark: str
    generation: str
    episodes: int
    accounted: int
    mean_score: float | None
    output_tokens: int
    mean_output_tokens: float | None
    score_per_output_token: float | None

    @property
    def score_per_1k_output_tokens(self) -> float | None:
        value = self.score_per_output_token
        return None if value is None else value * 1000

    def as_dict(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "generation": self.generation,
            "episodes": self.episodes,
            "accounted": self.accounted,
            "mean_score": self.mean_score,
            "output_tokens": self.output_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "score_per_output_token": self.score_per_output_token,
            "score_per_1k_output_tokens": self.score_per_1k_output_tokens,
        }


def score_per_output_token(
    scored: Iterable[ScoredEpisode], episodes: Mapping[int, TokenAccounted] | Iterable[TokenAccounted]
) -> list[Efficiency]:
    """Σ score / Σ completion tokens over the accounted episodes of each (benchmark, generation), sorted by both.

    `episodes` maps episode ids to rows (or is an iterable of rows). An episode is accounted when its row exists and
    reports completion tokens; the ratio is None when the accounted episodes spent no output tokens.
    """
    rows = episodes if isinstance(episodes, Mapping) else {row.id: row for row in episodes}
    groups: dict[tuple[str, str], list[ScoredEpisode]] = defaultdict(list)
    for item in scored:
        groups[(item.benchmark, item.generation)].append(item)
    results = []
    for (benchmark, generation), items in sorted(groups.items()):
        accounted = []
        for item in items:
            row = rows.get(item.episode_id)
            tokens = getattr(row, "completion_tokens", None) if row is not None else None
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
                accounted.append((item.score, tokens))
        total_score = sum(score for score, _ in accounted)
        total_tokens = sum(tokens for _, tokens in accounted)
        results.append(
            Efficiency(
                benchmark=benchmark,
                generation=generation,
                episodes=len(items),
                accounted=len(accounted),
                mean_score=sum(i.score for i in items) / len(items),
                output_tokens=total_tokens,
                mean_output_tokens=total_tokens / len(accounted) if accounted else None,
                score_per_output_token=total_score / total_tokens if total_tokens > 0 else None,
            )
        )
    return results
