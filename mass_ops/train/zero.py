"""The DeepSpeed ZeRO-3 config of a LoRA run, including the settings that make a frozen parent + small adapters fast.

ZeRO-3 partitions every parameter and gathers it around each use through per-parameter hooks. A LoRA model has
hundreds of small trainable tensors (A: r × in, B: out × r) and small norm weights; gathering each one per layer
costs a collective and a hook call for a few hundred KiB. `stage3_param_persistence_threshold` keeps every parameter
with fewer elements than the threshold whole on every rank: the default ("auto") is one more than the largest LoRA
tensor of the parent (lora_r × its widest projection), so adapters and norms are never gathered while every large
frozen projection stays partitioned. `overlap_comm` overlaps gradient reduction and parameter gathers with compute;
`stage3_prefetch_bucket_size` bounds how many parameters are gathered ahead of their use (about one decoder layer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mass_ops.train.args import TrainArgs

# Config keys whose value is a projection width in a Qwen3 / Qwen3-MoE / Qwen3.5 text config.
_WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def widest_projection(config: Mapping[str, Any]) -> int:
    """The largest input or output width of a projection LoRA may adapt (0 when the config names none)."""
    nested = config.get("text_config")
    c: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
    widths = [int(c[k]) for k in _WIDTH_KEYS if isinstance(c.get(k), int) and not isinstance(c.get(k), bool)]
    heads, head_dim = c.get("num_attention_heads"), c.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        gate = 2 if c.get("attn_output_gate") else 1  # Qwen3.5's q_proj also emits the output gate
        widths.append(gate * heads * head_dim)  # q_proj out, o_proj in
    if isinstance(c.get("linear_num_value_heads"), int) and isinstance(c.get("linear_key_head_dim"), int):
        keys = c.get("linear_num_key_heads", 0) * c["linear_key_head_dim"]
        values = c["linear_num_value_heads"] * c.get("linear_value_head_dim", 0)
        widths.append(2 * keys + values)  # in_proj_qkv out
    return max(widths, default=0)


def adapter_persistence_threshold(model_dir: str | Path, lora_r: int) -> int | None:
    """One more than the largest LoRA tensor of the parent in `model_dir`; None when its config cannot be read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    width = widest_projection(config) if isinstance(config, dict) else 0
    return lora_r * width + 1 if width else None


def deepspeed_config(args: TrainArgs, world_size: int, *, on_cpu: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a run: ZeRO-3, one window per micro-batch, bf16 with fp32 reduction/accumulation,
    the adapter settings of the module docstring; `deepspeed_overrides` are merged last (ZeRO stays 3).

    `on_cpu`: gloo has no streams to overlap on, so `overlap_comm` is off there whatever the knob says.
    """
    threshold = args.zero3_persistence_threshold
    if threshold is None:
        threshold = adapter_persistence_threshold(args.model_dir, args.lora_r)
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "contiguous_gradients": True,
        "overlap_comm": args.zero3_overlap_comm and not on_cpu,
        "stage3_prefetch_bucket_size": args.zero3_prefetch_bucket_size,
    }
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": world_size * args.grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": args.autocast_bf16},
        # The reference all-reduces LoRA gradients in fp32; keep reduction and accumulation in fp32 here too.
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": zero,
        # torch AdamW is passed in as the client optimizer (identical update rule on CPU and GPU).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    overrides = dict(args.deepspeed_overrides)
    zero.update(overrides.pop("zero_optimization", {}))
    zero["stage"] = 3
    config.update(overrides)
    return config
