"""What a cycle may spend while it runs (`budgets`) and what things cost (`prices`).

Neither is part of the config hash: raising a budget or changing a price list does not change what the cycle is.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any

from pydantic import Field, model_validator

from mass_ops.config.section import MAX_MAP_ENTRIES, PositiveInt, Section, StrictFloat, UsdAmount


class BudgetsConfig(Section):
    """Spending limits that hold while a cycle runs (ISSUE #15.2); every field is optional, null = unlimited.

    Tokens are prompt + completion tokens as the server reports them (cached prompt tokens count as prompt tokens).
    The episode proxy checks each agent request before forwarding it (prompt estimate + its max tokens against what
    is left); in-loop calls check before each call. Spend per cycle and scope lives in the metadata store, so every
    process and pod of the cycle shares it. Budgets are not part of the config hash: raise one and rerun, and the
    cycle continues where it stopped (finished units are reused).
    """

    episode_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens one episode attempt may use through its proxy (all its requests, subagents included).",
    )
    task_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens all episodes and in-loop calls of one task may use in this cycle.",
    )
    task_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) all episodes and in-loop calls of one task may cost.",
    )
    cycle_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens the whole cycle may use (every episode and in-loop call).",
    )
    cycle_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) the whole cycle may cost.",
    )
    in_loop_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens the in-loop calls of the cycle (judge, optimizer, arbitration, self-judge) may use.",
    )
    in_loop_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) the in-loop calls of the cycle may cost.",
    )
    alert_callback: str | None = Field(
        default=None,
        description=(
            "Dotted path of a callable (`package.module.function` or `package.module:function`) called once with a "
            "`mass_ops.store.budgets.BudgetAlert` when a budget first reaches 50% or 80% of its limit (the alert is "
            "logged and recorded in the store either way); checked importable when the config loads."
        ),
    )

    @model_validator(mode="after")
    def _callback_importable(self) -> BudgetsConfig:
        if self.alert_callback is not None:
            try:
                import_callable(self.alert_callback)
            except ValueError as exc:
                raise ValueError(f"alert_callback: {exc}") from None
        return self


def import_callable(path: str) -> Any:
    """The callable that `path` (``package.module.function`` or ``package.module:function``) names; ValueError saying
    why in one line when there is none. Imports the module: a config names only code its deployment ships."""
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not a dotted path of a callable (package.module.function)")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a config problem, named in one line
        raise ValueError(f"cannot import module {module_name!r} of {path!r} ({type(exc).__name__}: {exc})") from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ValueError(f"{path!r} does not name a callable in module {module_name!r}")
    return target


class ModelPrice(Section):
    """What one API model charges, in US dollars per million tokens (the provider's price list)."""

    prompt_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million prompt (input) tokens not served from the provider's cache."
    )
    completion_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million completion (output) tokens, reasoning tokens included."
    )
    cached_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million prompt tokens the provider served from its prompt cache."
    )


class PricesConfig(Section):
    """The price table of the cost estimate (`mass-ops plan`) and of spend in `status` and the report (ISSUE #15).
    Not part of the config hash: a new price list changes what a cycle costs, not what it is."""

    models: Annotated[dict[str, ModelPrice], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default_factory=dict,
        description=(
            "Per-token prices of API models by model name (an external judge's `model`, or the served name when the "
            "policy itself is an API model). A model not listed costs nothing per token: self-hosted models are "
            "paid by the GPU-hour instead, and the estimate names API judges left unpriced."
        ),
    )
    serving_gpu_hour_usd: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=3.0,
        description=(
            "USD per GPU-hour of the self-hosted inference server (vLLM or `transformers serve`). Default 3.0: a "
            "typical on-demand H100/H200 rate; set your own."
        ),
    )
    training_gpu_hour_usd: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=3.0, description="USD per GPU-hour of training jobs. Default 3.0, as for serving."
    )
