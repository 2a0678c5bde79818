"""Readers of what a cycle used, per stage: tokens, reported cost, wall-clock and GPU-hours, prompt-cache hits, and
the budget ledger's spend and the saved estimate beside those actuals."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.cost.prices import serving_cost, token_cost, training_cost
from mass_ops.cost.records import StageUsage
from mass_ops.evaluation.report.model import (
    IN_LOOP_PURPOSES,
    STAGE_ORDER,
    TRAIN_STAGE,
    BudgetAlertLine,
    BudgetLine,
    CacheShare,
    EstimateRow,
    StageCost,
    call_stage,
    episode_stage,
)
from mass_ops.store.schema import TrainingRun

# Calls whose client carries the cycle's budgets (`llm.calls.open_client`): the in-loop judge, optimizer and self-judge
# calls. An external judge's client has its own provider and no budget scope, so the ledger never counts its tokens.
BUDGETED_PURPOSES = IN_LOOP_PURPOSES


def _span(intervals: Iterable[tuple[datetime, datetime]]) -> float:
    """Seconds covered by the union of the intervals: the stage's wall-clock, without the idle gaps between a run
    and its rerun days later."""
    total = 0.0
    current: tuple[datetime, datetime] | None = None
    for start, end in sorted(intervals):
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            total += (current[1] - current[0]).total_seconds()
        current = (start, end)
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return max(0.0, total)


@dataclass(frozen=True)
class StageTotals:
    """What `stage_costs` reads from the records: the stages, the cycle's wall-clock (first unit start to last unit
    end) and the tokens of calls that spend from no budget scope (external judges' clients carry no budget)."""

    stages: list[StageCost]
    wall_clock_s: float
    unbudgeted_tokens: int


def stage_costs(ctx: CycleContext, runs: Sequence[TrainingRun], *, cpu_run: bool = False) -> StageTotals:
    """Tokens, cost and time per stage. GPU-hours: the inference server's GPUs over the stage's span for stages
    that use it (episodes and in-loop calls), the training ranks (one GPU each) over a run's wall-clock; none at all
    on a CPU run. Cost: see `StageCost`."""
    config = ctx.config
    prices = config.prices
    server_gpus = 0 if cpu_run else config.inference.server.gpus
    self_hosted = not config.is_remote_backend and config.models.served_name not in prices.models
    totals: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    intervals: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)  # all work of the stage
    on_server: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)  # work on our inference server
    costs: dict[str, float] = defaultdict(float)
    unbudgeted = 0
    for call in ctx.repo.llm_calls(ctx.cycle_id):
        # External judges run elsewhere and cost us no GPU time; every other call is served by our model.
        in_loop = call.purpose in IN_LOOP_PURPOSES
        stage = call_stage(call.unit_key, call.purpose)
        bucket = totals[stage]
        prompt, completion = call.prompt_tokens or 0, call.completion_tokens or 0
        bucket["calls"] += 1
        bucket["prompt_tokens"] += prompt
        bucket["completion_tokens"] += completion
        bucket["busy_s"] += call.latency_s or 0.0
        unbudgeted += 0 if call.purpose in BUDGETED_PURPOSES else prompt + completion
        reported = call.cost_usd
        costs[stage] += reported if reported is not None else token_cost(prices, call.model or "", prompt, completion)
        if call.created_at is not None:
            start = datetime.fromtimestamp(call.created_at.timestamp() - (call.latency_s or 0.0), UTC)
            intervals[stage].append((start, call.created_at))
            if in_loop:
                on_server[stage].append((start, call.created_at))
    for episode in ctx.repo.episodes(ctx.cycle_id):
        stage = episode_stage(episode.kind)
        bucket = totals[stage]
        bucket["episodes"] += 1
        bucket["prompt_tokens"] += episode.prompt_tokens or 0
        bucket["completion_tokens"] += episode.completion_tokens or 0
        bucket["busy_s"] += episode.duration_s or 0.0
        costs[stage] += token_cost(
            prices,
            episode.model or "",
            episode.prompt_tokens or 0,
            episode.completion_tokens or 0,
            getattr(episode, "cached_prompt_tokens", None) or 0,
        )
        if episode.started_at is not None and episode.finished_at is not None:
            intervals[stage].append((episode.started_at, episode.finished_at))
            on_server[stage].append((episode.started_at, episode.finished_at))
    gpus: dict[str, float] = defaultdict(float)
    for stage, spans in on_server.items():
        gpus[stage] = _span(spans) / 3600 * server_gpus
        if self_hosted:
            costs[stage] += serving_cost(prices, gpus[stage])
    train_span = []
    for run in runs:
        if run.started_at is not None and run.finished_at is not None:
            wall = (run.finished_at - run.started_at).total_seconds()
            totals[TRAIN_STAGE]["busy_s"] += wall
            gpus[TRAIN_STAGE] += 0.0 if cpu_run else wall / 3600 * config.training.replicas
            train_span.append((run.started_at, run.finished_at))
    costs[TRAIN_STAGE] += training_cost(prices, gpus.get(TRAIN_STAGE, 0.0))
    stages = []
    for stage in STAGE_ORDER:
        recorded = totals.get(stage)
        if recorded is None and stage not in gpus:
            continue
        bucket = recorded or {}
        spans = intervals.get(stage, []) + (train_span if stage == TRAIN_STAGE else [])
        hours = gpus.get(stage, 0.0)  # the training ranks' for the train stage, the inference server's for the others
        usage = StageUsage(
            prompt_tokens=int(bucket.get("prompt_tokens", 0)),
            completion_tokens=int(bucket.get("completion_tokens", 0)),
            cost_usd=costs.get(stage, 0.0),
            serving_gpu_hours=0.0 if stage == TRAIN_STAGE else hours,
            training_gpu_hours=hours if stage == TRAIN_STAGE else 0.0,
            wall_clock_s=_span(spans),
        )
        stages.append(
            StageCost(
                stage=stage,
                usage=usage,
                calls=int(bucket.get("calls", 0)),
                episodes=int(bucket.get("episodes", 0)),
                busy_s=float(bucket.get("busy_s", 0.0)),
            )
        )
    every = [span for spans in intervals.values() for span in spans] + train_span
    wall = (max(end for _, end in every) - min(start for start, _ in every)).total_seconds() if every else 0.0
    return StageTotals(stages, max(0.0, wall), unbudgeted)


def _cached_tokens(row: Any, usage: Mapping[str, Any] | None) -> int | None:
    """Cached prompt tokens of a call or episode: its own column when recorded, else the server's
    ``usage.prompt_tokens_details.cached_tokens``; None when the server did not report any."""
    value = getattr(row, "cached_prompt_tokens", None)
    if value is None and isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def cache_shares(ctx: CycleContext) -> list[CacheShare]:
    """Prompt-cache shares per stage; empty when no unit of the cycle reported cached tokens."""
    units: dict[str, int] = defaultdict(int)
    reporting: dict[str, int] = defaultdict(int)
    cached: dict[str, int] = defaultdict(int)
    prompt: dict[str, int] = defaultdict(int)

    def add(stage: str, hits: int | None, prompt_tokens: int | None) -> None:
        units[stage] += 1
        if hits is not None and prompt_tokens:
            reporting[stage] += 1
            cached[stage] += hits
            prompt[stage] += prompt_tokens

    for call in ctx.repo.llm_calls(ctx.cycle_id):
        add(call_stage(call.unit_key, call.purpose), _cached_tokens(call, call.usage), call.prompt_tokens)
    for episode in ctx.repo.episodes(ctx.cycle_id):
        add(episode_stage(episode.kind), _cached_tokens(episode, None), episode.prompt_tokens)
    if not any(reporting.values()):
        return []
    order = {stage: i for i, stage in enumerate(STAGE_ORDER)}
    return [
        CacheShare(stage, units[stage], reporting[stage], cached[stage], prompt[stage])
        for stage in sorted(units, key=lambda s: (order.get(s, len(order)), s))
    ]


def cost_control(
    ctx: CycleContext, stages: Sequence[StageCost]
) -> tuple[list[BudgetLine], list[EstimateRow], str | None]:
    """Budget lines from the ledger and the saved estimate (`validate_config` stores it in the cycle's provenance
    under "estimate") beside each stage's actuals; the third value says what the estimate was made from."""
    from mass_ops.store.budgets import BudgetLimits

    config = ctx.config
    limits = BudgetLimits.from_mapping(config.budgets.model_dump())
    spend = ctx.repo.budget_spend(ctx.cycle_id)
    order = sorted(spend, key=lambda s: (s != "cycle", s != "in_loop", s))
    budgets = [
        BudgetLine(s, spend[s].tokens, spend[s].cost_usd, spend[s].requests, *limits.for_scope(s)[:2]) for s in order
    ]
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    saved = (cycle.provenance or {}).get("estimate") if cycle is not None else None
    estimated = {s["stage"]: _saved_usage(s) for s in (saved or {}).get("stages", [])}
    actual = {s.stage: s.usage for s in stages}
    rows = [
        EstimateRow(stage, estimated.get(stage), actual.get(stage, StageUsage()))
        for stage in [*estimated, *(s for s in actual if s not in estimated)]
    ]
    source = None
    if saved is not None:
        source = f"measured on {saved['lineage_cycle']}" if saved.get("lineage_cycle") else _default_source(saved)
    return budgets, rows, source


def _saved_usage(stage: Mapping[str, Any]) -> StageUsage:
    """A stage of the saved estimate (`cost.estimate.StageEstimate.as_dict`) as the usage it expected."""
    return StageUsage(
        prompt_tokens=stage["prompt_tokens"],
        completion_tokens=stage["completion_tokens"],
        cost_usd=stage["cost_usd"],
        serving_gpu_hours=stage["serving_gpu_hours"],
        training_gpu_hours=stage["training_gpu_hours"],
        wall_clock_s=stage.get("wall_clock_s", 0.0),
    )


def budget_alerts(ctx: CycleContext) -> list[BudgetAlertLine]:
    """The budget alerts the cycle raised (`store.budgets.recorded_alerts`), each with the limit it crossed a share
    of as the cycle's config sets it now."""
    from mass_ops.store.budgets import MEASURES, BudgetLimits, recorded_alerts

    limits = BudgetLimits.from_mapping(ctx.config.budgets.model_dump())
    lines = []
    for alert in recorded_alerts(ctx.repo, ctx.cycle_id):
        try:
            tokens, cost, prefix = limits.for_scope(alert.scope)
        except ValueError:  # a scope this version no longer knows: still shown, without its limit
            tokens, cost, prefix = None, None, "budgets." + alert.scope
        limit = cost if alert.unit == "USD" else tokens
        at = alert.at if alert.at.tzinfo is None else alert.at.astimezone(UTC)
        setting = f"{prefix}_{MEASURES.get(alert.unit, alert.unit)}"
        when = f"{at:%Y-%m-%d %H:%M} UTC"
        lines.append(BudgetAlertLine(alert.scope, setting, alert.unit, limit, alert.percent, when))
    return lines


def _default_source(saved: Mapping[str, Any]) -> str:
    """What an estimate without a parent cycle was made from: the preset's own scale when it names one."""
    scale = saved.get("scale")
    return f"the {scale} preset's documented scale" if isinstance(scale, str) and scale else "the documented defaults"
