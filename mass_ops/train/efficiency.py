"""Per-device compute choices of the trainer: the attention kernel and how much activation checkpointing to do.

- attention (`training.attention`): `auto` picks flash_attention_2 on CUDA when the `flash_attn` package imports (it
  skips masked blocks and takes packed windows as varlen boundaries, no T × T mask), else PyTorch SDPA; an explicit
  `flash_attention_2` where it cannot run is one clear error instead of a late kernel failure.
- activation checkpointing (`training.gradient_checkpointing`): `full` recomputes every decoder layer in backward
  (least memory; about one extra forward), `selective` only every other layer (layers 0, 2, 4, …: half the recompute,
  half the activation savings), `off` keeps every layer's activations (fastest where memory allows: short windows,
  small models, or many GPUs sharing the parameters).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from mass_ops.errors import InputError

FLASH = "flash_attention_2"


class AttentionChoiceError(InputError):
    """An attention implementation that cannot run on this device; the message says why."""


def flash_attention_importable() -> bool:
    """Whether the `flash_attn` package is installed (transformers' flash_attention_2 needs it)."""
    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(requested: str, device_type: str, *, flash_available: bool | None = None) -> str:
    """The attention implementation to load the parent with on `device_type` ("cuda", "cpu", …)."""
    available = flash_attention_importable() if flash_available is None else flash_available
    if requested == "auto":
        return FLASH if device_type == "cuda" and available else "sdpa"
    if requested == FLASH and (device_type != "cuda" or not available):
        why = "the flash_attn package is not installed" if device_type == "cuda" else f"the device is {device_type}"
        raise AttentionChoiceError(f"training.attention: flash_attention_2 cannot run here ({why}); use auto or sdpa")
    if requested not in ("sdpa", "eager", FLASH):
        raise AttentionChoiceError(f"training.attention: unknown implementation {requested!r}")
    return requested


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers transformers checkpoints (its `GradientCheckpointingLayer`s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_checkpointing(model: Any, mode: str) -> int:
    """Enable non-reentrant activation checkpointing per `mode` (full, selective, off); returns the number of
    checkpointed layers. Non-reentrant: the reentrant variant loses LoRA gradients when inputs carry none."""
    if mode == "off":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be full, selective or off (got {mode!r})")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    layers = decoder_layers(model)
    if mode == "selective":
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index % 2 == 0
    return sum(bool(layer.gradient_checkpointing) for layer in layers)
