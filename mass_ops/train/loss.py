"""Chunked next-token cross-entropy over final hidden states (MASS_SPEC §8).

A 49k-token window times a 150k–250k vocabulary would need tens of GiB of logits; instead the output projection is
applied `ce_chunk` positions at a time, in fp32, under activation checkpointing (only the chunk's hidden states are
kept; its logits are recomputed in backward). Chunks without a supervised target are skipped entirely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # matmul, not F.linear: ZeRO-3 swaps F.linear for its own autograd function, meant for partitioned weights only.
    logits = torch.matmul(hidden.to(weight.dtype), weight.t()).float()
    return F.cross_entropy(logits, targets.long(), ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_next_token_loss(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, *, chunk: int, recompute: bool = True
) -> tuple[torch.Tensor, int]:
    """Summed CE of predicting labels[t+1] from hidden[t], and the number of supervised targets.

    hidden: [T, H] or [1, T, H] final hidden states; labels: [T] or [1, T] with −100 for masked positions;
    weight: [V, H] output projection, whose dtype sets the GEMM precision. Returns (fp32 scalar loss sum, target
    count). A window without targets returns a zero still attached to `hidden`, so backward works on every rank.
    """
    if chunk <= 0:
        raise ValueError(f"ce_chunk must be positive (got {chunk})")
    if hidden.dim() == 3:
        hidden = hidden.squeeze(0)
    if labels.dim() == 2:
        labels = labels.squeeze(0)
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden states ({hidden.shape[0]}) and labels ({labels.shape[0]}) differ in length")
    states = hidden[:-1]
    targets = labels[1:]
    n = states.shape[0]
    # One host sync per window to learn which chunks carry targets (not one per chunk).
    per_chunk = F.pad(targets.ne(IGNORE_INDEX), (0, (-n) % chunk)).view(-1, chunk).sum(dim=1).tolist()
    total: torch.Tensor | None = None
    count = 0
    for index, supervised in enumerate(per_chunk):
        if not supervised:
            continue
        lo, hi = index * chunk, min(n, (index + 1) * chunk)
        if recompute and torch.is_grad_enabled():
            piece = checkpoint(_chunk_loss_sum, states[lo:hi], targets[lo:hi], weight, use_reentrant=False)
        else:
            piece = _chunk_loss_sum(states[lo:hi], targets[lo:hi], weight)
        total = piece if total is None else total + piece
        count += int(supervised)
    if total is None:
        total = hidden.float().sum() * 0.0
    return total, count
