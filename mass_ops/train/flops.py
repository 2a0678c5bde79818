"""Model FLOPs of a training step, from the architecture in `config.json`, and model FLOPs utilisation (MFU).

    step FLOPs = Σ over windows of  6 · N · T  +  12 · L_attn · H · d · T²

(the PaLM paper's convention): `N` the parameters a token passes through in matrix multiplies (active ones for a
mixture of experts, embeddings excluded), `T` the window length, `L_attn` full-attention layers of `H` query heads
of width `d`. NeMo AutoModel's LoRA convention (`FlopsModel.lora_causal_sequence_flops`) is reported beside it.
MFU = achieved model FLOP/s per GPU ÷ `training.peak_tflops_per_gpu`.
Each term's derivation and conventions: docs/training.md (`mass_ops.train.flops`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.errors import InputError

# Dense BF16 tensor-core peaks (no 2:4 sparsity), TFLOP/s per GPU, from NVIDIA's datasheets.
H100_SXM_BF16_TFLOPS = 989.0
H200_BF16_TFLOPS = 989.0
H100_PCIE_BF16_TFLOPS = 756.0


class ArchitectureError(InputError):
    """A model config that does not describe a decoder we can count FLOPs for; the message names the key."""


@dataclass(frozen=True)
class FlopsModel:
    """What the FLOPs of a token depend on; `active_params` = N of the module docstring."""

    active_params: int
    attention_layers: int
    attention_heads: int
    head_dim: int

    def sequence_flops(self, tokens: int) -> float:
        """Forward + backward model FLOPs of one sequence (window) of `tokens` tokens."""
        return 6.0 * self.active_params * tokens + 12.0 * self.attention_layers * self.attention_heads * (
            self.head_dim * float(tokens) ** 2
        )

    def step_flops(self, window_tokens: Iterable[int]) -> float:
        """Model FLOPs of one optimizer step: the sum over the windows every rank processed."""
        return sum(self.sequence_flops(t) for t in window_tokens)

    def lora_causal_sequence_flops(self, tokens: int, adapter_params: int) -> float:
        """NeMo AutoModel's LoRA convention, for comparison with their published MFU: frozen weights compute no
        weight gradients (4 · N · T: forward and input gradient), the `adapter_params` count in full (6 · N_lora · T),
        the causal mask halves attention (6 · L_attn · H · d · T²); recomputation is not counted."""
        return (
            4.0 * self.active_params * tokens
            + 6.0 * adapter_params * tokens
            + 6.0 * self.attention_layers * self.attention_heads * self.head_dim * float(tokens) ** 2
        )

    def lora_causal_step_flops(self, window_tokens: Iterable[int], adapter_params: int) -> float:
        """`lora_causal_sequence_flops` summed over the windows of one optimizer step."""
        return sum(self.lora_causal_sequence_flops(t, adapter_params) for t in window_tokens)


def _need(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ArchitectureError(f"model config: {key!r} must be a positive integer (got {value!r})")
    return value


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal checkpoints (Qwen3.5/3.6) keep the language model's keys under `text_config`."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def _layer_kinds(config: Mapping[str, Any], layers: int) -> list[str]:
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        return [str(k) for k in kinds]
    return ["full_attention"] * layers


def _is_moe_layer(config: Mapping[str, Any], index: int) -> bool:
    if not config.get("num_experts") or not config.get("num_experts_per_tok"):
        return False
    if index in (config.get("mlp_only_layers") or []):
        return False
    step = config.get("decoder_sparse_step") or 1
    return (index + 1) % step == 0


def flops_model(config: Mapping[str, Any]) -> FlopsModel:
    """The FLOPs model of a Hugging Face decoder config (Qwen3, Qwen3-MoE, Qwen3-Next/3.5 style keys)."""
    c = _text_config(config)
    hidden = _need(c, "hidden_size")
    layers = _need(c, "num_hidden_layers")
    heads = _need(c, "num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    vocab = _need(c, "vocab_size")

    full_attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    linear_attention = 0
    if "linear_num_key_heads" in c:
        key_dim = _need(c, "linear_num_key_heads") * _need(c, "linear_key_head_dim")
        value_heads = _need(c, "linear_num_value_heads")
        value_dim = value_heads * _need(c, "linear_value_head_dim")
        # q, k, v and the output gate z in; the per-head decay/beta inputs; the output projection.
        linear_attention = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads + value_dim * hidden

    params = vocab * hidden  # output projection (tied or not, it is a matmul per token)
    attention_layers = 0
    for index, kind in enumerate(_layer_kinds(c, layers)):
        if kind == "linear_attention":
            params += linear_attention
        else:
            params += full_attention
            attention_layers += 1
        if _is_moe_layer(c, index):
            experts = _need(c, "num_experts")
            params += hidden * experts  # router
            params += _need(c, "num_experts_per_tok") * 3 * hidden * _need(c, "moe_intermediate_size")
            shared = c.get("shared_expert_intermediate_size") or 0
            if shared:
                params += 3 * hidden * shared + hidden  # shared expert and its sigmoid gate
        else:
            params += 3 * hidden * _need(c, "intermediate_size")  # gate, up, down
    return FlopsModel(active_params=params, attention_layers=attention_layers, attention_heads=heads, head_dim=head_dim)


def read_flops_model(model_dir: str | Path) -> FlopsModel:
    """`flops_model` of the `config.json` in a model directory."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArchitectureError(f"{path}: cannot read the model config ({exc})") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"{path}: not a JSON object")
    return flops_model(config)


def mfu(flops: float, seconds: float, gpus: int, peak_tflops_per_gpu: float | None) -> float | None:
    """Model FLOPs utilisation of `flops` done in `seconds` on `gpus` devices; None without a peak or a duration."""
    if not peak_tflops_per_gpu or seconds <= 0 or gpus <= 0:
        return None
    return flops / seconds / gpus / (peak_tflops_per_gpu * 1e12)


def step_throughput(
    window_tokens_by_rank: Mapping[int, list[int]],
    supervised_tokens: int,
    step_s: float,
    model: FlopsModel | None,
    *,
    world_size: int,
    peak_tflops_per_gpu: float | None,
    adapter_params: int = 0,
) -> dict[str, Any]:
    """The throughput fields of one logged training step (one rank = one GPU).

    `window_tokens_by_rank`: the token count of every window each rank processed in the step; `supervised_tokens`:
    the loss tokens of the step over all ranks. Tokens/s count every token of a window (context included), the
    supervised rate only the trained ones. Without an architecture (`model` None) the FLOPs fields are None.
    `*_lora_causal` fields use NeMo's convention with `adapter_params` LoRA parameters.
    """
    per_rank = [sum(window_tokens_by_rank.get(rank, [])) for rank in range(world_size)]
    total = sum(per_rank)
    seconds = step_s if step_s > 0 else float("nan")
    windows = [t for tokens in window_tokens_by_rank.values() for t in tokens]
    flops = model.step_flops(windows) if model else None
    lora_flops = model.lora_causal_step_flops(windows, adapter_params) if model else None
    return {
        "tokens_per_s": round(total / seconds, 3),
        "tokens_per_s_per_rank": [round(t / seconds, 3) for t in per_rank],
        "supervised_tokens_per_s": round(supervised_tokens / seconds, 3),
        "model_tflops_per_gpu": None if flops is None else round(flops / seconds / world_size / 1e12, 6),
        "mfu": None if flops is None else mfu(flops, step_s, world_size, peak_tflops_per_gpu),
        "model_tflops_per_gpu_lora_causal": None
        if lora_flops is None
        else round(lora_flops / seconds / world_size / 1e12, 6),
        "mfu_lora_causal": None if lora_flops is None else mfu(lora_flops, step_s, world_size, peak_tflops_per_gpu),
    }
