"""The one record of what a stage uses: prompt and completion tokens, cost in USD, GPU-hours (serving and training)
and wall-clock seconds. The estimate (`cost.estimate.StageEstimate`: expected), the report
(`evaluation.report.model.StageCost`: measured) and the status (`ops.status.StageStatus`: so far) each carry one as
`usage` and compute it where they stand; their own breakdowns (units, spreads, busy time, progress) sit beside it.
A `StageUsage` holds figures only: what they mean for a stage (a span, an estimate) is said by the record holding it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StageUsage:
    """A stage's tokens, cost, GPU-hours and wall-clock. `a + b` adds every figure (stages that run one after another,
    or a stage's rows one by one)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    serving_gpu_hours: float = 0.0
    training_gpu_hours: float = 0.0
    wall_clock_s: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def gpu_hours(self) -> float:
        return self.serving_gpu_hours + self.training_gpu_hours

    def __add__(self, other: StageUsage) -> StageUsage:
        return StageUsage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cost_usd + other.cost_usd,
            self.serving_gpu_hours + other.serving_gpu_hours,
            self.training_gpu_hours + other.training_gpu_hours,
            self.wall_clock_s + other.wall_clock_s,
        )


class CarriesUsage:
    """Read-through properties for a record that carries a `usage`: its figures read as the record's own
    (`record.prompt_tokens` is `record.usage.prompt_tokens`)."""

    usage: StageUsage

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens

    @property
    def tokens(self) -> int:
        return self.usage.tokens

    @property
    def cost_usd(self) -> float:
        return self.usage.cost_usd

    @property
    def serving_gpu_hours(self) -> float:
        return self.usage.serving_gpu_hours

    @property
    def training_gpu_hours(self) -> float:
        return self.usage.training_gpu_hours

    @property
    def gpu_hours(self) -> float:
        return self.usage.gpu_hours

    @property
    def wall_clock_s(self) -> float:
        return self.usage.wall_clock_s


def total_usage(records: Iterable[CarriesUsage]) -> StageUsage:
    """The sum of the records' usages (a zero usage for none)."""
    return sum((record.usage for record in records), StageUsage())
