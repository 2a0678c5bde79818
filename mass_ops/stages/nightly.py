"""Nightly re-evaluation: the newest registered generation against its parent on the test split, every night.

`nightly_config` gives the nightly runs their own cycle row; `nightly_targets` picks the newest served generation
with a parent (one awaiting promotion approval is passed over); `nightly_evaluate` runs, pairs and judges the night's
test-split rollouts, keyed by (logical date, generation) so reruns and backfills record only missing nights;
`check_regression` fails a night whose win rate's upper 95% Wilson bound is below 0.5 − threshold or below the
previous night's rate minus the threshold. The optional benchmark slice runs under the night's `nightly_trial`.
Details: docs/evaluation.md (`mass_ops.stages.nightly`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, date, datetime
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.layout import PAIRWISE_KIND
from mass_ops.seeds import nightly_rollout_seed_base
from mass_ops.serving import generation_server, registered
from mass_ops.stages.evaluate import (
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
    """The generations to evaluate tonight: the newest served one (`mass_ops.stages.promotion`: a generation awaiting
    its promotion's approval is passed over), when it has a parent."""
    from mass_ops.stages.promotion import served_generation

    newest = served_generation(ctx)
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


# --- the benchmark slice ---------------------------------------------------------------------------------------------
#
# A night may also run a small slice of the public benchmarks (`benchmark_slice`: benchmark names, the first
# `instances` instances of each, one trial) on every generation tonight's servers serve — the evaluated generations
# and their parents, so each night has a same-server comparison. The slice is recorded in the nightly cycle (never in
# a `mass_benchmarks` run's cycle) under the night's own trial index `nightly_trial`: 100,000 + the days from
# 2000-01-01 to the night's UTC day. A full run numbers its trials 0..k-1, so the two never share a trial, and every
# night is a new trial whose instances, seeds and scores a rerun or backfill of that night finds recorded and skips.
# The nightly report of that cycle then shows the slice in its benchmark section (mean ± SD over the nights run).

NIGHTLY_TRIAL_BASE = 100_000
NIGHTLY_TRIAL_EPOCH = date(2000, 1, 1)
NIGHTLY_BENCHMARK_STAGE_PREFIX = "nightly_benchmark"  # the stage names BenchmarkTrialOperator calls for the slice


def nightly_trial(date_iso: str) -> int:
    """The benchmark trial index of the night of logical date `date_iso` (its UTC calendar day); above every trial
    index a full benchmark run uses (0..k-1), and below 2**31 in the episode seeds (trial · 1,000 + task)."""
    night = datetime.strptime(date_stamp(date_iso)[:8], "%Y%m%d").date()
    return NIGHTLY_TRIAL_BASE + (night - NIGHTLY_TRIAL_EPOCH).days


def check_benchmark_slice(benchmarks: Sequence[str] | None, instances: Any, data_dir: str | None = None) -> list[str]:
    """The slice's benchmarks (deduplicated, in the given order); NightlyError in one line for an unknown benchmark,
    an instance count below 1, or a slice benchmark whose dataset folder is missing (nothing is downloaded)."""
    from mass_ops.evaluation.benchmarks.sources import SUITE, benchmark_adapter

    names = list(benchmarks or [])
    unknown = [name for name in names if name not in SUITE]
    if unknown:
        raise NightlyError(
            f"nightly: benchmark_slice {unknown} unknown; choose from {list(SUITE)} (empty: no benchmark slice)"
        )
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise NightlyError(f"nightly: benchmark_slice_instances must be a whole number ≥ 1, got {instances!r}")
    chosen = list(dict.fromkeys(names))
    for name in chosen:
        benchmark_adapter(name, data_dir)  # BenchmarkError (one line) when its dataset folder is missing
    return chosen


def benchmark_slice_units(
    ctx: CycleContext,
    generations: Sequence[str],
    benchmarks: Sequence[str] | None,
    instances: Any,
    date_iso: str,
    data_dir: str | None = None,
) -> list[dict[str, Any]]:
    """One unit per (benchmark, served generation) of tonight's slice, as `BenchmarkTrialOperator` maps them:
    ``{"benchmark", "generation", "trial", "limit", "data_dir"}``; none for an empty slice."""
    chosen = check_benchmark_slice(benchmarks, instances, data_dir)
    if not chosen:
        return []
    trial = nightly_trial(date_iso)
    served = served_generations(ctx, list(generations))
    return [
        {"benchmark": name, "generation": generation, "trial": trial, "limit": instances, "data_dir": data_dir}
        for name in chosen
        for generation in served
    ]


def _nightly_ctx(config: CycleConfig) -> CycleContext:
    from mass_ops.context import open_cycle

    return open_cycle(nightly_config(config))


def _slice_served(config: CycleConfig, generation: str) -> CycleContext:
    """The nightly cycle's context pointed at `generation`'s nightly server (both backends)."""
    from mass_ops.serving import serving_context

    ctx = _nightly_ctx(config)
    return serving_context(ctx, generation_server(ctx, generation, NIGHTLY_SCOPE))


def _check_trial(trial: Any) -> int:
    if isinstance(trial, bool) or not isinstance(trial, int) or trial < NIGHTLY_TRIAL_BASE:
        raise NightlyError(f"nightly: benchmark slice trial {trial!r} is not a nightly trial (≥ {NIGHTLY_TRIAL_BASE})")
    return trial


# The slice's stage functions: the same signatures as `stages.benchmarks`' (BenchmarkTrialOperator calls them with
# the `nightly_benchmark` prefix), recorded in the nightly cycle and run on tonight's servers (scope `nightly`).


def nightly_benchmark_slice(
    config: CycleConfig, benchmarks: Sequence[str] | None, instances: Any, data_dir: str | None = None
) -> dict[str, Any]:
    """The nightly DAG's first check of its slice params (see `check_benchmark_slice`)."""
    del config
    return {"benchmarks": check_benchmark_slice(benchmarks, instances, data_dir), "instances": instances}


def nightly_benchmark_units(
    config: CycleConfig,
    generations: Sequence[str],
    benchmarks: Sequence[str] | None,
    instances: Any,
    date_iso: str,
    data_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Tonight's slice units (`benchmark_slice_units`) in the nightly cycle."""
    return benchmark_slice_units(_nightly_ctx(config), generations, benchmarks, instances, date_iso, data_dir)


def nightly_benchmark_trial(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    limit: int | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Tonight's slice of `benchmark` for `generation`, run, graded and recorded here (local backend; see
    `stages.benchmarks.benchmark_trial`), skipping every instance already recorded for this night."""
    from mass_ops.stages.benchmarks import trial_on

    return trial_on(_slice_served, config, benchmark, generation, _check_trial(trial), limit, data_dir)


def nightly_benchmark_trial_tasks(
    config: CycleConfig, benchmark: str, limit: int | None = None, data_dir: str | None = None
) -> dict[str, Any]:
    """The slice's tasks of `benchmark`, checked before any agent time (`stages.benchmarks.benchmark_trial_tasks`)."""
    from mass_ops.stages.benchmarks import benchmark_trial_tasks

    return benchmark_trial_tasks(config, benchmark, limit, data_dir)


def nightly_benchmark_instance(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    task: str,
    data_dir: str | None = None,
    episode_pod: bool = False,
) -> dict[str, Any]:
    """One slice instance's episode on tonight's server of `generation`, then its score or the grader job to run;
    with `episode_pod`, the episode pod to run first (recorded in the nightly cycle) — see
    `stages.benchmarks.instance_step`."""
    from mass_ops.stages.benchmarks import instance_on

    return instance_on(_slice_served, config, benchmark, generation, _check_trial(trial), task, data_dir, episode_pod)


def nightly_benchmark_grader_result(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    task: str,
    log: str,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """One slice instance graded from its grader Job's log and recorded once in the nightly cycle."""
    from mass_ops.stages.benchmarks import benchmark_grader_result

    return benchmark_grader_result(
        nightly_config(config), benchmark, generation, _check_trial(trial), task, log, data_dir
    )


def nightly_benchmark_trial_record(
    config: CycleConfig,
    benchmark: str,
    generation: str,
    trial: int,
    limit: int | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """The night's trial row of `benchmark` for `generation` in the nightly cycle, from its recorded instances."""
    from mass_ops.stages.benchmarks import benchmark_trial_record

    return benchmark_trial_record(nightly_config(config), benchmark, generation, _check_trial(trial), limit, data_dir)
