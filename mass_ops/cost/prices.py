"""The price table's arithmetic: per-million token prices of API models and per-GPU-hour prices of our own GPUs
(`config.prices`, every field described there)."""

from __future__ import annotations

from mass_ops.config import PricesConfig

MILLION = 1_000_000


def is_priced(prices: PricesConfig, model: str) -> bool:
    """Whether `model` has a per-token price (an API model); unlisted models are self-hosted or unpriced."""
    return model in prices.models


def token_cost(
    prices: PricesConfig, model: str, prompt_tokens: float, completion_tokens: float, cached_tokens: float = 0.0
) -> float:
    """USD of the tokens of `model` (0 for a model without a per-token price). `cached_tokens` are the part of
    `prompt_tokens` the provider served from its cache, charged at the cached rate instead."""
    price = prices.models.get(model)
    if price is None:
        return 0.0
    fresh = max(0.0, prompt_tokens - cached_tokens)
    return (
        fresh * price.prompt_per_million
        + cached_tokens * price.cached_per_million
        + completion_tokens * price.completion_per_million
    ) / MILLION


def serving_cost(prices: PricesConfig, gpu_hours: float) -> float:
    """USD of `gpu_hours` of the self-hosted inference server."""
    return gpu_hours * prices.serving_gpu_hour_usd


def training_cost(prices: PricesConfig, gpu_hours: float) -> float:
    """USD of `gpu_hours` of training."""
    return gpu_hours * prices.training_gpu_hour_usd
