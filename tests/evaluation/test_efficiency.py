"""Score per output token from the episodes' token accounting, on hand-built episode rows."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest

from mass_ops.evaluation.efficiency import ScoredEpisode, score_per_output_token
from mass_ops.store.repository import MetadataRepository
from tests.inner_loop_fakes import migrated_sqlite


@pytest.fixture
def repo(tmp_path):
    return MetadataRepository.from_url(migrated_sqlite(tmp_path / "m.db"))


def test_score_per_output_token_on_hand_built_episodes(repo):
    cycle = repo.ensure_cycle("eff", {}, "h" * 64)
    started = datetime(2026, 10, 1, tzinfo=UTC)
    seeds = itertools.count(3_110_000)

    def episode(task: str, generation: str, tokens: int | None) -> int:
        row = repo.record_episode(
            cycle.id, task_id=task, kind="benchmark", seed=next(seeds), status="succeeded",
            generation=generation, completion_tokens=tokens, started_at=started, finished_at=started,
        )  # fmt: skip
        return row.id

    scored = [
        ScoredEpisode("sab", "L0", "sab_1", 0, 1.0, episode("sab_1", "L0", 4000)),
        ScoredEpisode("sab", "L0", "sab_2", 0, 0.0, episode("sab_2", "L0", 6000)),
        ScoredEpisode("sab", "L1", "sab_1", 0, 1.0, episode("sab_1", "L1", 2000)),
        ScoredEpisode("sab", "L1", "sab_2", 0, 1.0, episode("sab_2", "L1", 3000)),
        # no token accounting: left out of both sums, but counted
        ScoredEpisode("sab", "L1", "sab_3", 0, 1.0, episode("sab_3", "L1", None)),
        ScoredEpisode("mlr", "L1", "iclr2023_dg", 0, 6.5, episode("iclr2023_dg", "L1", 13000)),
    ]
    rows = repo.episodes(cycle.id)
    result = {(e.benchmark, e.generation): e for e in score_per_output_token(scored, rows)}
    assert list(result) == [("mlr", "L1"), ("sab", "L0"), ("sab", "L1")]
    l0, l1, mlr = result[("sab", "L0")], result[("sab", "L1")], result[("mlr", "L1")]
    assert l0.score_per_output_token == pytest.approx(1.0 / 10000)
    assert l0.mean_output_tokens == 5000 and l0.mean_score == 0.5
    assert (l1.episodes, l1.accounted, l1.output_tokens) == (3, 2, 5000)
    assert l1.score_per_output_token == pytest.approx(2.0 / 5000)
    assert l1.score_per_1k_output_tokens == pytest.approx(0.4)
    assert l1.mean_score == 1.0
    assert mlr.score_per_output_token == pytest.approx(6.5 / 13000)
    # The same generation doing better per token is visible even where the raw score would tie.
    assert l1.score_per_output_token > l0.score_per_output_token


def test_no_output_tokens_gives_no_ratio(repo):
    cycle = repo.ensure_cycle("eff0", {}, "h" * 64)
    row = repo.record_episode(cycle.id, task_id="sab_1", kind="benchmark", seed=1, status="succeeded",
                              generation="L0", completion_tokens=0)  # fmt: skip
    (only,) = score_per_output_token([ScoredEpisode("sab", "L0", "sab_1", 0, 1.0, row.id)], {row.id: row})
    assert only.score_per_output_token is None and only.accounted == 1
