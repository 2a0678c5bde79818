"""The pre-run estimate of a cycle: per stage, LLM calls, agent episodes, prompt/completion tokens (with their
spread), GPU-hours of serving and training, wall-clock on the configured capacity, and cost.

Inputs are planned counts (`StageWork`, built by `ops.plan.cycle_work` from `build_plan`) and per-unit figures
(`UnitFigures`): measured on the parent generation's cycle when it has records (`cost.lineage`), else the
documented figures of the preset's own scale (`SCALES`: the paper's, or the demo's on CPU). Everything here is
arithmetic; nothing reads a store or calls a model.

Model of time: work on our inference server shares its `concurrency` (requests in flight), so a stage's server
time is its busy seconds over the concurrency, but never less than its longest chain of units that must run one
after another (a task's RHI versions). Calls to external judges run beside it with the same concurrency. Serving
GPU-hours are that server time × the server's GPUs × the servers up; training GPU-hours are steps × seconds per
step × the training GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mass_ops.config import PricesConfig
from mass_ops.cost.prices import is_priced, serving_cost, token_cost, training_cost
from mass_ops.cost.records import CarriesUsage, StageUsage


@dataclass(frozen=True)
class UnitFigures:
    """Per-unit means (and standard deviations) of one kind of unit: tokens and seconds of one episode or call."""

    prompt_tokens: float
    completion_tokens: float
    seconds: float
    prompt_sd: float = 0.0
    completion_sd: float = 0.0
    samples: int = 0  # units measured; 0 = a default
    source: str = "default"


# Defaults until a parent cycle has records. They are orders of magnitude for the paper preset on one H200 serving a
# 27B FP8 model with 4 requests in flight, not measurements; the lineage replaces them after the first cycle.
# Each figure is per planned unit: its retried attempts and position-bias swaps included (as `cost.lineage` measures).
DEFAULT_FIGURES: dict[str, UnitFigures] = {
    # A qwen-code research episode: ~60 requests whose prompt grows to ~60k tokens and is resent on each request
    # (~2M prompt tokens in all), ~40k tokens written (reasoning included), ~40 minutes.
    "episode": UnitFigures(prompt_tokens=2_000_000, completion_tokens=40_000, seconds=2_400),
    # An in-loop pairwise judge call (RHI baseline, arbitration, ranking self-judge): two trajectories' evidence
    # (~30k tokens) in, a short reasoned verdict (~3k tokens) out, ~90 s.
    "judge": UnitFigures(prompt_tokens=30_000, completion_tokens=3_000, seconds=90),
    # An optimizer call: the workflow, the results and the history (~60k tokens) in, a new design (~8k) out, ~4 min.
    "optimizer": UnitFigures(prompt_tokens=60_000, completion_tokens=8_000, seconds=240),
    # An external judge call: the same evidence as an in-loop judge, a longer high-effort answer (~6k), ~2 min.
    "external_judge": UnitFigures(prompt_tokens=30_000, completion_tokens=6_000, seconds=120),
}
# One optimizer step of the paper preset (3 windows of 49,152 tokens, ZeRO-3 LoRA on a 27B model): ~60 s.
DEFAULT_TRAIN_STEP_S = 60.0

# The demo preset's scale, measured on a demo run (tiny random Qwen3 on 2 CPU processes, `transformers serve`, outputs
# capped at 32 tokens per agent request and 64 per call; `tests/cost/fixtures/demo_cycle.json`): a random model's agent
# stops after 2 requests of the qwen-code system prompt and the task (~16k tokens each), and its judge answers are never
# usable JSON, so each judge call is 3 attempts (judge.invalid_retries 2) of ~1.3k tokens; its one optimizer answer is
# kept as unusable (search.on_invalid_proposal keep_design).
DEMO_FIGURES: dict[str, UnitFigures] = {
    "episode": UnitFigures(prompt_tokens=32_500, completion_tokens=64, seconds=90),
    "judge": UnitFigures(prompt_tokens=4_000, completion_tokens=192, seconds=120),
    "optimizer": UnitFigures(prompt_tokens=2_500, completion_tokens=64, seconds=20),
    "external_judge": UnitFigures(prompt_tokens=4_000, completion_tokens=192, seconds=120),
}


@dataclass(frozen=True)
class Scale:
    """The per-unit figures a preset's estimate starts from before its lineage has records, and whether its work
    runs on GPUs (a CPU run has no GPU-hours to price)."""

    name: str
    figures: Mapping[str, UnitFigures]
    train_step_s: float
    on_gpus: bool = True


SCALES: dict[str, Scale] = {
    "paper": Scale("paper", DEFAULT_FIGURES, DEFAULT_TRAIN_STEP_S),
    "cycle2": Scale("paper", DEFAULT_FIGURES, DEFAULT_TRAIN_STEP_S),  # the paper's scale, one generation on
    "demo": Scale("demo", DEMO_FIGURES, DEFAULT_TRAIN_STEP_S, on_gpus=False),
}


def scale_for(preset: str | None) -> Scale:
    """The scale of a preset's own estimate; a custom config (or none) starts from the paper's."""
    return SCALES.get(preset or "", SCALES["paper"])


@dataclass(frozen=True)
class WorkItem:
    """`count` units of one kind (`figures`: a key of DEFAULT_FIGURES) answered by `model`."""

    figures: str
    count: int
    model: str
    episode: bool = False  # an agent episode (else an LLM call)
    on_server: bool = True  # served by our inference server (else an external API)
    chain: int = 1  # units of this item that must run one after another


@dataclass(frozen=True)
class StageWork:
    """The planned work of one stage."""

    stage: str
    items: tuple[WorkItem, ...] = ()
    servers: int = 1  # inference servers up while the stage runs (evaluation serves two generations)
    train_steps: int = 0
    train_gpus: int = 0


@dataclass(frozen=True)
class Capacity:
    """What the cycle runs on: requests in flight per server, GPUs per server, whether we pay for serving by the
    GPU-hour (self-hosted) or per token (an API policy)."""

    concurrency: int
    server_gpus: int
    self_hosted: bool = True


@dataclass(frozen=True)
class StageEstimate(CarriesUsage):
    """The estimate of one stage: its expected `usage` (GPU-hours of serving and training, wall-clock on the
    configured capacity), the units behind it, and `*_sd`, the standard deviations of its token totals (independent
    units)."""

    stage: str
    usage: StageUsage = field(default_factory=StageUsage)
    episodes: int = 0
    llm_calls: int = 0
    prompt_tokens_sd: int = 0
    completion_tokens_sd: int = 0
    source: str = "default"

    def as_dict(self) -> dict[str, Any]:
        """Plain data, flat: the keys `plan --json` prints and the cycle's provenance keeps (the report reads them)."""
        usage = self.usage
        return {
            "stage": self.stage,
            "episodes": self.episodes,
            "llm_calls": self.llm_calls,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "prompt_tokens_sd": self.prompt_tokens_sd,
            "completion_tokens_sd": self.completion_tokens_sd,
            "serving_gpu_hours": usage.serving_gpu_hours,
            "training_gpu_hours": usage.training_gpu_hours,
            "wall_clock_s": usage.wall_clock_s,
            "cost_usd": usage.cost_usd,
            "source": self.source,
        }


@dataclass(frozen=True)
class CycleEstimate:
    """The estimate of a cycle: its stages, their total, and what it was made from."""

    cycle: str
    stages: list[StageEstimate]
    total: StageEstimate
    lineage_cycle: str | None = None  # the parent's cycle the per-unit figures were measured on
    scale: str = "paper"  # whose documented figures stand in for those the lineage has not measured
    unpriced_models: list[str] = field(default_factory=list)  # external API models without a price

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (`plan --json`, XCom, the cycle's provenance)."""
        return {
            "cycle": self.cycle,
            "stages": [stage.as_dict() for stage in self.stages],
            "total": self.total.as_dict(),
            "lineage_cycle": self.lineage_cycle,
            "scale": self.scale,
            "unpriced_models": list(self.unpriced_models),
        }

    def stage(self, name: str) -> StageEstimate | None:
        return next((s for s in self.stages if s.stage == name), None)


def figures_for(key: str, measured: Mapping[str, UnitFigures], scale: Scale | None = None) -> UnitFigures:
    """Measured figures of `key` when the lineage has them, else the scale's (the paper's by default)."""
    return measured.get(key) or (scale or SCALES["paper"]).figures[key]


def estimate_stage(
    work: StageWork,
    capacity: Capacity,
    prices: PricesConfig,
    measured: Mapping[str, UnitFigures] | None = None,
    train_step_s: float = DEFAULT_TRAIN_STEP_S,
    train_source: str = "default",
    scale: Scale | None = None,
) -> StageEstimate:
    """The estimate of one stage's work (see the module docstring for the model of time); a scale that runs on no
    GPU has no GPU-hours."""
    measured = measured or {}
    on_gpus = scale is None or scale.on_gpus
    episodes = calls = 0
    prompt = completion = prompt_var = completion_var = 0.0
    busy = external_busy = path = cost = 0.0
    sources = set()
    for item in work.items:
        if item.count <= 0:
            continue
        figures = figures_for(item.figures, measured, scale)
        sources.add(figures.source)
        if item.episode:
            episodes += item.count
        else:
            calls += item.count
        prompt += item.count * figures.prompt_tokens
        completion += item.count * figures.completion_tokens
        prompt_var += item.count * figures.prompt_sd**2
        completion_var += item.count * figures.completion_sd**2
        seconds = item.count * figures.seconds
        if item.on_server:
            busy += seconds
            path += item.chain * figures.seconds
        else:
            external_busy += seconds
        cost += token_cost(
            prices, item.model, item.count * figures.prompt_tokens, item.count * figures.completion_tokens
        )
    concurrency = max(1, capacity.concurrency)
    server_s = max(busy / concurrency, path) if busy else 0.0
    wall = max(server_s, external_busy / concurrency)
    serving_h = server_s / 3600 * capacity.server_gpus * work.servers if capacity.self_hosted and on_gpus else 0.0
    train_s = work.train_steps * train_step_s
    training_h = train_s / 3600 * work.train_gpus if on_gpus else 0.0
    if work.train_steps:
        sources.add(train_source)
    cost += serving_cost(prices, serving_h) + training_cost(prices, training_h)
    usage = StageUsage(round(prompt), round(completion), cost, serving_h, training_h, wall + train_s)
    return StageEstimate(
        stage=work.stage,
        usage=usage,
        episodes=episodes,
        llm_calls=calls,
        prompt_tokens_sd=round(math.sqrt(prompt_var)),
        completion_tokens_sd=round(math.sqrt(completion_var)),
        source="+".join(sorted(sources)) or "default",
    )


def total_of(stages: Sequence[StageEstimate]) -> StageEstimate:
    """The sum of stage estimates (wall-clock adds up: the stages run one after another; spreads add in variance)."""
    usage = StageUsage(
        prompt_tokens=sum(s.prompt_tokens for s in stages),
        completion_tokens=sum(s.completion_tokens for s in stages),
        cost_usd=sum(s.cost_usd for s in stages),
        serving_gpu_hours=sum(s.serving_gpu_hours for s in stages),
        training_gpu_hours=sum(s.training_gpu_hours for s in stages),
        wall_clock_s=sum(s.wall_clock_s for s in stages),
    )
    return StageEstimate(
        stage="total",
        usage=usage,
        episodes=sum(s.episodes for s in stages),
        llm_calls=sum(s.llm_calls for s in stages),
        prompt_tokens_sd=round(math.sqrt(sum(s.prompt_tokens_sd**2 for s in stages))),
        completion_tokens_sd=round(math.sqrt(sum(s.completion_tokens_sd**2 for s in stages))),
        source="+".join(sorted({part for s in stages for part in s.source.split("+")})),
    )


def estimate_cycle(
    cycle: str,
    work: Sequence[StageWork],
    capacity: Capacity,
    prices: PricesConfig,
    measured: Mapping[str, UnitFigures] | None = None,
    *,
    train_step_s: float | None = None,
    lineage_cycle: str | None = None,
    scale: Scale | str | None = None,
) -> CycleEstimate:
    """The estimate of every stage of `work` and their total; `scale` (a `Scale` or a preset name, default the
    paper's) supplies the figures the lineage has not measured."""
    chosen = scale if isinstance(scale, Scale) else scale_for(scale)
    step_s = train_step_s if train_step_s is not None else chosen.train_step_s
    train_source = "lineage" if train_step_s is not None else "default"
    stages = [estimate_stage(w, capacity, prices, measured, step_s, train_source, chosen) for w in work]
    external = {item.model for w in work for item in w.items if not item.on_server and item.count}
    unpriced = sorted(model for model in external if not is_priced(prices, model))
    return CycleEstimate(
        cycle=cycle,
        stages=stages,
        total=total_of(stages),
        lineage_cycle=lineage_cycle,
        unpriced_models=unpriced,
        scale=chosen.name,
    )


@dataclass(frozen=True)
class BudgetCheck:
    """The estimate against the cycle budget (`budgets.cycle_cost_usd`, `budgets.cycle_tokens`)."""

    estimated_cost_usd: float
    estimated_tokens: int
    cycle_cost_usd: float | None
    cycle_tokens: int | None

    @property
    def problems(self) -> list[str]:
        """One line per budget the estimate exceeds."""
        lines = []
        if self.cycle_cost_usd is not None and self.estimated_cost_usd > self.cycle_cost_usd:
            lines.append(
                f"estimated cost {self.estimated_cost_usd:,.2f} USD exceeds budgets.cycle_cost_usd "
                f"{self.cycle_cost_usd:,.2f} USD"
            )
        if self.cycle_tokens is not None and self.estimated_tokens > self.cycle_tokens:
            lines.append(
                f"estimated tokens {self.estimated_tokens:,} exceed budgets.cycle_tokens {self.cycle_tokens:,}"
            )
        return lines

    @property
    def over_budget(self) -> bool:
        return bool(self.problems)


def check_budget(estimate: CycleEstimate, cycle_cost_usd: float | None, cycle_tokens: int | None) -> BudgetCheck:
    """Compare the estimate's total with the cycle budgets (None = unlimited)."""
    return BudgetCheck(
        estimated_cost_usd=estimate.total.cost_usd,
        estimated_tokens=estimate.total.tokens,
        cycle_cost_usd=cycle_cost_usd,
        cycle_tokens=cycle_tokens,
    )
