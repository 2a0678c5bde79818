"""`benchmarks/episode_concurrency.py` at a tiny size, so it cannot rot: both runs complete every episode and the
figure lines parse (the efficiency goal is the benchmark's verdict, not the suite's)."""

from __future__ import annotations

import pytest

from benchmarks.episode_concurrency import main
from tests.support.benchmarks import figure


def test_two_episodes_run_one_by_one_and_pooled(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--episodes", "2", "--capacity", "2", "--latency", "0.01", "--requests", "1"])
    out = capsys.readouterr().out
    assert out.count("{'succeeded': 2}") == 2, out
    assert figure(out, "sequential (one by one)") > 0  # seconds
    assert figure(out, "pool (capacity 2)") > 0
    assert figure(out, "speedup:") > 0
    assert figure(out, "efficiency = speedup / min(C, episodes) =") > 0
