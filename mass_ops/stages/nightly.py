"""Nightly re-evaluation: the newest registered generation against its parent on the test split, every night.

* `nightly_config` gives the nightly runs their own cycle row (``nightly-<hash>``), so they never collide with the
  training cycles' frozen configs; the same nightly settings always land in the same row.
* `nightly_targets` — the newest registered generation that has a parent (none before the first cycle registered).
* `nightly_evaluate` — the night's test-split rollouts of the generation and its parent (fresh samples every night:
  the seed base moves with the logical date's UTC day, `seeds.nightly_rollout_seed_base`), paired and judged like a
  cycle's evaluation, recorded as a pairwise evaluation labelled with the logical date. Results are keyed by (logical
  date, generation): a rerun, a cleared task or `airflow backfill create` over past dates does each night's work once
  (episodes keyed by seed, judgments by pair, judge and seed) and records only the missing nights.
* `check_regression` — a generation regresses when even the upper end of tonight's 95% Wilson interval of its win
  rate against its parent is below 0.5 − `evaluation.regression_threshold`, or below the previous night's win rate
  minus the threshold (sampling noise alone does not fail a night).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.seeds import nightly_rollout_seed_base
from mass_ops.serving import generation_server, registered
from mass_ops.stages.evaluate import (
    PAIRWISE_KIND,
    ExecutorFactory,
    episode_pool,
    judge_pairs,
    open_judges,
    pair_rollouts,
    rollout_set,
    stand_in_note,
    summarize,
)

NIGHTLY_SCOPE = "nightly"
NIGHTLY_LABEL = "nightly"


class NightlyError(InputError):
    """A nightly evaluation cannot run (unknown generation, generation without parent, bad date)."""


def nightly_config(config: CycleConfig) -> CycleConfig:
    """The config under which nightly results are recorded: its own cycle, named after the settings' hash."""
    return config.model_copy(update={"name": f"nightly-{config.config_hash()[:10]}"})


def nightly_targets(ctx: CycleContext) -> list[str]:
    """The generations to evaluate tonight: the newest registered one, when it has a parent."""
    newest = ctx.repo.latest_generation()
    return [newest.name] if newest is not None and newest.parent_id is not None else []


def parent_of(ctx: CycleContext, generation: str) -> str:
    """The registered parent of `generation`."""
    row = registered(ctx, generation)
    parent = next((g for g in ctx.repo.lineage(row.id) if g.id == row.parent_id), None)
    if parent is None:
        raise NightlyError(f"nightly: generation {generation} has no registered parent to compare with")
    return parent.name


def served_generations(ctx: CycleContext, generations: list[str]) -> list[str]:
    """What tonight's servers must serve: each generation and its parent, once each."""
    names: list[str] = []
    for generation in generations:
        names.extend([generation, parent_of(ctx, generation)])
    return list(dict.fromkeys(names))


def date_stamp(date: str) -> str:
    """A logical date (ISO 8601) as a label part in UTC: ``20261130T030000`` (a date without offset is UTC)."""
    try:
        when = datetime.fromisoformat(date)
    except (TypeError, ValueError):
        raise NightlyError(f"nightly: date {date!r} is not an ISO 8601 date-time") from None
    if when.tzinfo is not None:
        # The stamp drops the offset: one instant must give one stamp, and two instants never the same one.
        when = when.astimezone(UTC)
    return when.strftime("%Y%m%dT%H%M%S")


def night_config(config: CycleConfig, stamp: str) -> CycleConfig:
    """`config` with the rollout seed base of the night of `stamp` (its UTC calendar day)."""
    night = datetime.strptime(stamp, "%Y%m%dT%H%M%S").date()
    base = nightly_rollout_seed_base(config.evaluation.rollout_seed_base, night)
    evaluation = config.evaluation.model_copy(update={"rollout_seed_base": base})
    return config.model_copy(update={"evaluation": evaluation})


def nightly_evaluate(
    ctx: CycleContext, generation: str, date: str, *, executor: ExecutorFactory = episode_pool
) -> dict[str, Any]:
    """Evaluate `generation` against its parent for logical date `date` on that night's rollouts (reused, with
    their judgments, when the night is rerun)."""
    stamp = date_stamp(date)
    parent = parent_of(ctx, generation)
    servers = {name: generation_server(ctx, name, NIGHTLY_SCOPE) for name in (generation, parent)}
    night = dataclasses.replace(ctx, config=night_config(ctx.config, stamp))
    count = ctx.config.evaluation.rollout_count
    labels = {
        name: rollout_set(night, server, executor, split="test", label=f"{NIGHTLY_LABEL}-{name}-{stamp[:8]}-n{count}")
        for name, server in servers.items()
    }
    pairs = pair_rollouts(ctx, labels[generation], labels[parent])
    with ExitStack() as stack:
        externals, own, stand_in = open_judges(ctx, servers[generation], servers[parent], stack)
        judge_pairs(ctx, pairs, [*externals, own])
        extra: dict[str, Any] = {"nightly_date": stamp}
        if stand_in:
            extra["note"] = stand_in_note(parent)
        summary = summarize(
            ctx, pairs, label=f"{NIGHTLY_LABEL}-{generation}-{stamp}", judges=[j.name for j in externals], extra=extra
        )
    overall = summary.results["summary"]["overall"]
    return {
        "evaluation": summary.key,
        "generation": generation,
        "baseline": parent,
        "date": stamp,
        "win_rate": overall["win_rate"],
        "wilson_95": overall["wilson_95"],
        "results_uri": summary.results_uri,
    }


def _previous_win_rate(ctx: CycleContext, generation: str, baseline: str, stamp: str) -> tuple[str, float] | None:
    """The latest earlier night's decisive win rate of the same comparison in this nightly cycle."""
    earlier = []
    for row in ctx.repo.evaluations(kind=PAIRWISE_KIND):
        results = row.results or {}
        night = results.get("nightly_date")
        if (
            row.cycle_id == ctx.cycle_id
            and isinstance(night, str)
            and night < stamp
            and (results.get("generation_a"), results.get("generation_b")) == (generation, baseline)
        ):
            rate = results.get("summary", {}).get("overall", {}).get("win_rate")
            if rate is not None:
                earlier.append((night, float(rate)))
    return max(earlier) if earlier else None


def check_regression(ctx: CycleContext, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Tonight's results against the floor and the previous night, using the upper end of tonight's 95% Wilson
    interval so that sampling noise alone does not fail a night; returns every check and the regressions found
    (the caller fails loudly on any)."""
    threshold = ctx.config.evaluation.regression_threshold
    floor = 0.5 - threshold
    checked, regressions = [], []
    for result in results:
        generation, baseline, stamp = result["generation"], result["baseline"], result["date"]
        rate, interval = result.get("win_rate"), result.get("wilson_95")
        previous = _previous_win_rate(ctx, generation, baseline, stamp)
        item = {
            "generation": generation,
            "baseline": baseline,
            "date": stamp,
            "win_rate": rate,
            "wilson_95": interval,
            "previous": previous,
        }
        checked.append(item)
        if rate is None or not interval:
            continue  # no decisive judgment: nothing to compare
        upper = float(interval[1])
        if upper < floor:
            regressions.append(
                f"{generation} wins {rate:.3f} (95% interval up to {upper:.3f}) of decisive judgments against "
                f"{baseline} on {stamp}, below {floor:.3f} (0.5 − evaluation.regression_threshold {threshold})"
            )
        if previous is not None and upper < previous[1] - threshold:
            regressions.append(
                f"{generation}'s win rate against {baseline} dropped from {previous[1]:.3f} ({previous[0]}) to "
                f"{rate:.3f} (95% interval up to {upper:.3f}) on {stamp}, more than evaluation.regression_threshold "
                f"{threshold}"
            )
    return {"threshold": threshold, "checked": checked, "regressions": regressions}
