"""Nightly re-evaluation: the newest registered generation against its parent on the test split, every night.

* `nightly_config` gives the nightly runs their own cycle row (``nightly-<hash>``), so they never collide with the
  training cycles' frozen configs; the same nightly settings always land in the same row.
* `nightly_targets` — the newest registered generation that has a parent (none before the first cycle registered).
* `nightly_evaluate` — test-split rollouts of the generation and its parent (one rollout set per generation, reused
  every night: their seeds depend on task and replicate only), paired and judged like a cycle's evaluation, recorded
  as a pairwise evaluation labelled with the logical date. Results are keyed by (logical date, generation): a rerun,
  a cleared task or `airflow backfill create` over past dates records the missing dates only and judges nothing
  twice (judgments are keyed by pair, judge and seed).
* `check_regression` — a generation regresses when its win rate against its parent falls below
  0.5 − `evaluation.regression_threshold`, or drops by more than the threshold from the previous night's result.
"""

from __future__ import annotations

from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.evaluation.cycle import ExecutorFactory, episode_pool, open_judges, rollout_set, stand_in_note
from mass_ops.evaluation.serving import generation_server, registered
from mass_ops.evaluation.stage import PAIRWISE_KIND, judge_pairs, pair_rollouts, summarize

NIGHTLY_SCOPE = "nightly"
NIGHTLY_LABEL = "nightly"


class NightlyError(ValueError):
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


def nightly_evaluate(
    ctx: CycleContext, generation: str, date: str, *, executor: ExecutorFactory = episode_pool
) -> dict[str, Any]:
    """Evaluate `generation` against its parent for logical date `date` (reused when already recorded)."""
    stamp = date_stamp(date)
    parent = parent_of(ctx, generation)
    servers = {name: generation_server(ctx, name, NIGHTLY_SCOPE) for name in (generation, parent)}
    count = ctx.config.evaluation.rollout_count
    labels = {
        name: rollout_set(ctx, server, executor, split="test", label=f"{NIGHTLY_LABEL}-{name}-test-n{count}")
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
    return {
        "evaluation": summary.key,
        "generation": generation,
        "baseline": parent,
        "date": stamp,
        "win_rate": summary.results["summary"]["overall"]["win_rate"],
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
    """Compare tonight's results with the floor and with the previous night; returns every check and the
    regressions found (the caller fails loudly on any)."""
    threshold = ctx.config.evaluation.regression_threshold
    floor = 0.5 - threshold
    checked, regressions = [], []
    for result in results:
        generation, baseline, stamp = result["generation"], result["baseline"], result["date"]
        rate = result.get("win_rate")
        previous = _previous_win_rate(ctx, generation, baseline, stamp)
        item = {"generation": generation, "baseline": baseline, "date": stamp, "win_rate": rate, "previous": previous}
        checked.append(item)
        if rate is None:
            continue  # no decisive judgment: nothing to compare
        if rate < floor:
            regressions.append(
                f"{generation} wins {rate:.3f} of decisive judgments against {baseline} on {stamp}, below "
                f"{floor:.3f} (0.5 − evaluation.regression_threshold {threshold})"
            )
        if previous is not None and previous[1] - rate > threshold:
            regressions.append(
                f"{generation}'s win rate against {baseline} dropped from {previous[1]:.3f} ({previous[0]}) to "
                f"{rate:.3f} ({stamp}), more than evaluation.regression_threshold {threshold}"
            )
    return {"threshold": threshold, "checked": checked, "regressions": regressions}
