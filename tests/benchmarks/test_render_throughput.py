"""`benchmarks/render_throughput.py` at a tiny size, so it cannot rot: the generated episodes render (strict) and the
figure lines parse (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks.render_throughput import build_episode, main
from tests.support.benchmarks import figure

# Two workers of two turns each: with seed 0 the generator once wrote an intermediate turn without reasoning here,
# which the renderer refuses, and the benchmark died with a RenderError.
TINY = ["--episodes", "1", "--workers", "2", "--turns", "2", "--repeat", "1"]


def test_every_intermediate_turn_of_a_generated_episode_carries_reasoning() -> None:
    for record in build_episode(0, workers=2, turns=2):
        message = record["response"]["choices"][0]["message"]
        if message["tool_calls"]:
            assert message["reasoning_content"], record["seq"]


def test_the_benchmark_renders_and_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY)
    out = capsys.readouterr().out
    assert figure(out, "tokens=") > 0
    assert figure(out, "render_dataset         :") > 0  # tokens/s
    assert figure(out, "raw batch tokenisation :") > 0
    assert figure(out, "ratio render/ids-only =") > 0
    assert figure(out, "ratio render/raw =") > 0
