"""Per-unit figures measured on a recorded cycle: the means and spreads of tokens and seconds of its episodes (by
kind) and planned LLM calls (by purpose, each with all its attempts), and the seconds per training step — what the
next cycle's estimate uses instead of the defaults."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from mass_ops.compute.kubernetes import generation_name
from mass_ops.cost.estimate import UnitFigures
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import Cycle

# Which figures of the estimate a recorded unit measures.
EPISODE_FIGURES = {"reference": "episode", "search": "episode", "collection": "episode", "rollout": "episode"}
CALL_FIGURES = {
    "judge": "judge",
    "arbitration": "judge",
    "self_judge": "judge",
    "optimizer": "optimizer",
    "external_judge": "external_judge",
}


def parent_cycle(repo: MetadataRepository, generation: int) -> Cycle | None:
    """The cycle that produced generation L(`generation`) (the parent of a cycle of that generation): the cycle row
    its registration points at. None for L0 or a generation registered without a cycle."""
    if generation <= 0:
        return None
    registered = repo.get_generation(generation_name(generation))
    if registered is None or registered.cycle_id is None:
        return None
    return repo.get_cycle_by_id(registered.cycle_id)


def _figures(samples: list[tuple[int, int, float]]) -> UnitFigures:
    prompts = [float(p) for p, _, _ in samples]
    completions = [float(c) for _, c, _ in samples]
    seconds = [s for _, _, s in samples]
    spread = statistics.pstdev if len(samples) < 2 else statistics.stdev
    return UnitFigures(
        prompt_tokens=statistics.fmean(prompts),
        completion_tokens=statistics.fmean(completions),
        seconds=statistics.fmean(seconds),
        prompt_sd=spread(prompts),
        completion_sd=spread(completions),
        samples=len(samples),
        source="lineage",
    )


def measured_figures(repo: MetadataRepository, cycle_id: int) -> dict[str, UnitFigures]:
    """Figures of every kind of unit the cycle recorded with token counts (infrastructure failures left out: their
    tokens say nothing about a finished unit)."""
    samples: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for episode in repo.episodes(cycle_id):
        key = EPISODE_FIGURES.get(episode.kind)
        if key is None or episode.status == "infra_failure" or episode.prompt_tokens is None:
            continue
        samples[key].append((episode.prompt_tokens, episode.completion_tokens or 0, episode.duration_s or 0.0))
    # A planned call is one unit however many attempts it took (unusable answers are retried, a sample of pairs is
    # judged again swapped): the estimate counts units, so a unit's figures are the sums over its attempts.
    units: dict[tuple[str, str], list[int | float]] = {}
    for call in repo.llm_calls(cycle_id):
        key = CALL_FIGURES.get(call.purpose)
        if key is None or call.status == "failed" or call.prompt_tokens is None:
            continue
        unit = units.setdefault((key, call_unit(call.unit_key)), [0, 0, 0.0])
        unit[0] += call.prompt_tokens
        unit[1] += call.completion_tokens or 0
        unit[2] += call.latency_s or 0.0
    for (key, _unit), (prompt, completion, seconds) in sorted(units.items()):
        samples[key].append((int(prompt), int(completion), float(seconds)))
    return {key: _figures(rows) for key, rows in samples.items()}


_ATTEMPT = re.compile(r"(/swapped)?/a\d+$")


def call_unit(unit_key: str) -> str:
    """The planned unit of a call attempt's key: ``task51/rhi/v1_vs_no_harness/swapped/a2`` →
    ``task51/rhi/v1_vs_no_harness``."""
    return _ATTEMPT.sub("", unit_key)


def measured_step_seconds(repo: MetadataRepository, cycle_id: int, run_key: str = "sft") -> float | None:
    """Seconds per optimizer step of the cycle's finished training run (wall-clock over its last step), or None."""
    run = repo.get_training_run(cycle_id, run_key)
    if run is None or run.started_at is None or run.finished_at is None:
        return None
    steps = max((c.step for c in repo.checkpoints(run.id)), default=0)
    if steps <= 0:
        return None
    return (run.finished_at - run.started_at).total_seconds() / steps
