"""LoRA adapters under ZeRO-3: gathering the fp32 master copies, refusing empty or malformed tensors, writing both
layouts (`lora_state_dict.safetensors` with PEFT parameter names, and PEFT's own `adapter/`) and reading them back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mass_ops.errors import InfrastructureError
from mass_ops.train.checkpoints import ADAPTER_DIR, LORA_STATE_FILE

if TYPE_CHECKING:
    import torch


class Ranks(Protocol):
    """What the gather needs to know of this process: whether it is rank 0."""

    @property
    def is_main(self) -> bool: ...


class AdapterSaveError(InfrastructureError):
    """Saved adapters are empty or malformed (the ZeRO-3 + PEFT save pitfall); the checkpoint is not published."""


def gather_lora_fp32(peft_model: Any, ranks: Ranks) -> dict[str, torch.Tensor]:
    """Full fp32 LoRA tensors (PEFT parameter names) on rank 0; {} elsewhere. Collective: call on every rank."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, torch.Tensor] = {}
    for name, param in peft_model.named_parameters():
        if not param.requires_grad:
            continue
        full = safe_get_full_fp32_param(param)
        if full is None:  # not managed by a ZeRO optimizer (never the case under deepspeed.initialize)
            full = param.detach()
        if ranks.is_main:
            shape = tuple(getattr(param, "ds_shape", param.shape))
            out[name] = full.detach().to("cpu", torch.float32).reshape(shape).contiguous()
    return out


def assert_adapter_non_empty(
    tensors: dict[str, torch.Tensor], *, lora_r: int, where: str, expected_tensors: int | None = None
) -> None:
    """Refuse an adapter hit by the ZeRO-3 + PEFT save pitfalls: raises `AdapterSaveError` (one line) unless every
    tensor is 2-D, non-empty and rank-r shaped, A and B come in pairs (`expected_tensors` of them when given), every
    value is finite and no lora_A is all zeros. lora_B may be zero: PEFT initialises it so (the step-0 adapter is the
    parent), but lora_A is random from the start, so an all-zero A means the save read placeholders, not weights."""
    import torch

    if not tensors:
        raise AdapterSaveError(f"{where}: no LoRA tensors to save")
    problems = []
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        if tensor.numel() == 0 or len(shape) != 2:
            problems.append(f"{name} {shape}")
        elif ".lora_A" in name and shape[0] != lora_r:
            problems.append(f"{name} {shape} (rank {lora_r} expected first)")
        elif ".lora_B" in name and shape[1] != lora_r:
            problems.append(f"{name} {shape} (rank {lora_r} expected last)")
    n_a = sum(".lora_A" in n for n in tensors)
    n_b = sum(".lora_B" in n for n in tensors)
    if n_a == 0 or n_a != n_b:
        problems.append(f"{n_a} lora_A vs {n_b} lora_B tensors")
    if expected_tensors is not None and len(tensors) != expected_tensors:
        problems.append(f"{len(tensors)} tensors where the target pattern adapts {expected_tensors // 2} modules")
    if problems:
        raise AdapterSaveError(f"{where}: empty or malformed adapter tensors: {', '.join(problems[:5])}")
    squares = sum(float(t.detach().double().pow(2).sum()) for t in tensors.values())
    if not math.isfinite(squares):
        raise AdapterSaveError(f"{where}: adapter norm is not finite (NaN or inf in the LoRA tensors)")
    zero_a = sorted(n for n, t in tensors.items() if ".lora_A" in n and not bool(torch.count_nonzero(t)))
    if zero_a:
        raise AdapterSaveError(
            f"{where}: {len(zero_a)} of {n_a} lora_A tensors are all zeros (e.g. {zero_a[0]}); "
            "the save did not read the trained weights"
        )


def write_adapters(
    peft_model: Any,
    tensors: dict[str, torch.Tensor],
    step_dir: Path,
    lora_r: int,
    expected_tensors: int | None = None,
) -> None:
    """Write `lora_state_dict.safetensors` (PEFT parameter names) and `adapter/` (PEFT's layout); read both back.
    Both are checked with `assert_adapter_non_empty` before and after writing."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    assert_adapter_non_empty(tensors, lora_r=lora_r, where=str(step_dir), expected_tensors=expected_tensors)
    save_file(tensors, str(step_dir / LORA_STATE_FILE), metadata={"format": "pt"})
    adapter_dir = step_dir / ADAPTER_DIR
    adapter_dir.mkdir(parents=True, exist_ok=True)
    # PEFT's key convention (adapter name stripped) from PEFT itself, fed the gathered tensors.
    adapter_tensors = get_peft_model_state_dict(peft_model, state_dict=tensors)
    adapter_tensors = {k: v.contiguous() for k, v in adapter_tensors.items()}
    save_file(adapter_tensors, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(adapter_dir))
    for path, expected in (
        (step_dir / LORA_STATE_FILE, tensors),
        (adapter_dir / "adapter_model.safetensors", adapter_tensors),
    ):
        reloaded = load_file(str(path))
        assert_adapter_non_empty(reloaded, lora_r=lora_r, where=str(path), expected_tensors=expected_tensors)
        if len(reloaded) != len(expected):
            raise AdapterSaveError(f"{path}: {len(reloaded)} tensors written, {len(expected)} expected")
