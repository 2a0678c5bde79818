"""Padding-free packing: the windows one rank draws for an optimizer step, several to a micro-batch.

A rank's `grad_accum` windows are laid end to end (first fit, in draw order) in micro-batches padded to exactly
`budget` tokens. Position ids restart per window and attention never crosses one (block-diagonal mask, or varlen
boundaries for flash_attention_2); the padding tail's labels are masked. The loss is unchanged: each window's loss
is its own token mean, as unpacked. `linear_attention_refusal` refuses a model whose linear-attention layers let
state cross a window boundary. Details: docs/training.md (`mass_ops.train.packing`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mass_ops.errors import InputError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("mass_ops.train")

FLASH = "flash_attention_2"


class PackingError(InputError):
    """Packing asked for (`training.packing: on`) on a model that cannot see window boundaries; says why."""


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch: windows end to end, padded to `tokens`; `spans` are the windows' [start, end) offsets."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    spans: tuple[tuple[int, int], ...]
    tokens: int

    @property
    def pad(self) -> int:
        return self.tokens - self.spans[-1][1]

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Segment boundaries [0, end₁, end₂, …, tokens], the padding tail counted as a segment of its own."""
        ends = [0] + [end for _, end in self.spans] + ([self.tokens] if self.pad else [])
        return np.asarray(ends, dtype=np.int32)


def plan_packs(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most `budget` tokens: first fit in order (deterministic, so a
    resumed run packs identically). A window longer than the budget gets a pack to itself."""
    if budget <= 0:
        raise ValueError(f"pack budget must be positive (got {budget})")
    packs: list[list[int]] = []
    room: list[int] = []
    for index, n in enumerate(lengths):
        for p, free in enumerate(room):
            if n <= free:
                packs[p].append(index)
                room[p] -= n
                break
        else:
            packs.append([index])
            room.append(max(budget - n, 0))
    return packs


def split_to(packs: list[list[int]], count: int) -> list[list[int]]:
    """`packs` split into exactly `count` packs (never merged): the pack with most windows gives up its last one
    until there are enough. Every rank must run as many micro-batches as the others (ZeRO-3 gathers parameters
    collectively), so a rank whose windows pack into fewer micro-batches splits instead of idling."""
    out = [list(p) for p in packs]
    if count < len(out) or count > sum(len(p) for p in out):
        raise ValueError(f"cannot split {len(out)} packs of {sum(len(p) for p in out)} windows into {count}")
    while len(out) < count:
        largest = max(range(len(out)), key=lambda i: (len(out[i]), -i))
        out.insert(largest + 1, [out[largest].pop()])
    return out


def pack_windows(token_ids: Sequence[np.ndarray], budget: int, pad_id: int) -> PackedBatch:
    """Lay `token_ids` end to end and pad to max(budget, their total) tokens; positions restart per window (and in
    the padding tail)."""
    lengths = [int(ids.shape[0]) for ids in token_ids]
    used = sum(lengths)
    tokens = max(budget, used)
    ids = np.full(tokens, pad_id, dtype=np.int64)
    positions = np.zeros(tokens, dtype=np.int64)
    spans = []
    start = 0
    for window, n in zip(token_ids, lengths, strict=True):
        ids[start : start + n] = window
        positions[start : start + n] = np.arange(n)
        spans.append((start, start + n))
        start += n
    positions[used:] = np.arange(tokens - used)
    return PackedBatch(input_ids=ids, position_ids=positions, spans=tuple(spans), tokens=tokens)


def block_causal_mask(batch: PackedBatch, *, device: Any = None, additive_dtype: Any = None) -> torch.Tensor:
    """[1, 1, T, T] mask: position q sees k ≤ q of its own segment only. Boolean (True = attend) for SDPA; with
    `additive_dtype`, 0 / dtype-min floats for eager attention."""
    import torch

    segment = torch.repeat_interleave(
        torch.arange(len(batch.cu_seqlens) - 1, device=device),
        torch.from_numpy(np.diff(batch.cu_seqlens).astype(np.int64)).to(device),
    )
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(
        batch.tokens, batch.tokens, dtype=torch.bool, device=device
    ).tril()
    if additive_dtype is not None:
        mask = torch.zeros(allowed.shape, dtype=additive_dtype, device=device)
        allowed = mask.masked_fill(~allowed, torch.finfo(additive_dtype).min)
    return allowed[None, None]


def model_inputs(
    batch: PackedBatch, attention: str, *, device: Any, dtype: Any, linear_attention: bool = False
) -> dict[str, Any]:
    """Forward kwargs of a packed micro-batch for the parent loaded with `attention`."""
    import torch

    cu = torch.from_numpy(batch.cu_seqlens).to(device)
    kwargs: dict[str, Any] = {
        "input_ids": torch.from_numpy(batch.input_ids).to(device)[None],
        "position_ids": torch.from_numpy(batch.position_ids).to(device)[None],
        "use_cache": False,
    }
    mask = None
    if attention == FLASH:
        longest = int(np.diff(batch.cu_seqlens).max())
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    else:
        mask = block_causal_mask(batch, device=device, additive_dtype=dtype if attention == "eager" else None)
    if linear_attention:
        # Hybrid models take one mask per layer kind; the recurrent layers read the boundaries from cu_seq_lens_q.
        kwargs["cu_seq_lens_q"] = cu
        kwargs["attention_mask"] = {"full_attention": mask, "linear_attention": None}
    elif mask is not None:
        kwargs["attention_mask"] = mask
    return kwargs


def has_linear_attention(model: Any) -> bool:
    """Whether the parent's text config declares linear-attention layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def _linear_layer(model: Any) -> Any | None:
    return next((m for m in model.modules() if hasattr(m, "in_proj_qkv") and hasattr(m, "A_log")), None)


def linear_attention_refusal(model: Any, *, device: Any = "cpu", dtype: Any = None) -> str | None:
    """Why packing cannot train this model (None: it can). Runs a small copy of its first linear-attention layer
    on two 24-token windows, packed with `cu_seq_lens_q` and one at a time; any difference means state crosses."""
    import torch

    layer = _linear_layer(model)
    if layer is None:
        return None
    config = copy.deepcopy(model.config.get_text_config())
    small = {
        "hidden_size": 32,
        "linear_num_key_heads": 1,
        "linear_key_head_dim": 16,
        "linear_num_value_heads": 2,
        "linear_value_head_dim": 16,
        "num_hidden_layers": 1,
        "layer_types": ["linear_attention"],
    }
    for key, value in small.items():
        setattr(config, key, value)
    dtype = dtype or torch.float32
    name = type(layer).__name__
    try:
        torch.manual_seed(0)
        probe = type(layer)(config, 0).to(device=device, dtype=dtype).eval()
        x = torch.randn(1, 48, 32, device=device, dtype=dtype)
        cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
        with torch.no_grad():
            packed = probe(hidden_states=x, cu_seq_lens_q=cu)
            apart = torch.cat([probe(hidden_states=x[:, :24]), probe(hidden_states=x[:, 24:])], dim=1)
    except Exception as exc:  # any failure of the probe means the boundaries cannot be trusted
        return f"{name} failed on packed windows ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(packed.float(), apart.float(), rtol=tolerance, atol=tolerance):
        return (
            f"the installed transformers' {name} ignores window boundaries (cu_seq_lens_q) on {torch.device(device)}: "
            "its recurrent state would flow from one packed window into the next"
        )
    return None


def packing_enabled(model: Any, mode: str, grad_accum: int, *, device: Any = "cpu", dtype: Any = None) -> bool:
    """Resolve `training.packing` for this parent: off never packs; auto packs when a rank has several windows per
    step and the layers see boundaries; on packs or raises `PackingError` naming why it cannot."""
    if mode == "off" or (mode == "auto" and grad_accum == 1):
        return False
    reason = linear_attention_refusal(model, device=device, dtype=dtype) if has_linear_attention(model) else None
    if reason is None:
        return True
    if mode == "on":
        raise PackingError(f"training.packing: on cannot be honoured: {reason}; set training.packing to auto or off")
    log.warning("packing off: %s", reason)
    return False


def window_losses(
    hidden: torch.Tensor,
    batch: PackedBatch,
    labels: Sequence[np.ndarray],
    weight: torch.Tensor,
    *,
    chunk: int,
    recompute: bool,
) -> list[tuple[torch.Tensor, int]]:
    """(loss sum, supervised targets) of every window of a packed forward, from its own slice of `hidden` [1, T, H]:
    the same chunked CE an unpacked window gets (nothing predicts across a boundary)."""
    import torch

    from mass_ops.train.loss import chunked_next_token_loss

    out = []
    for (start, end), window_labels in zip(batch.spans, labels, strict=True):
        target = torch.from_numpy(np.asarray(window_labels, dtype=np.int64)).to(hidden.device)
        out.append(chunked_next_token_loss(hidden[0, start:end], target, weight, chunk=chunk, recompute=recompute))
    return out
