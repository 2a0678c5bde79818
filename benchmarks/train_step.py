"""Packed vs padded training micro-batches on CPU (issue #28): tokens/s of the same LoRA forward + chunked-loss +
backward over the same windows, batched two ways, in one run; the ratio is the packing gain, visible without a GPU.

- padded: one window per micro-batch, padded to the token budget (fixed shapes, as a compiled or CUDA-graphed step
  needs); the padding is computed and thrown away.
- packed: the windows of a step (grad_accum of them) laid end to end in budget-sized micro-batches with per-window
  boundaries (mass_ops.train.packing), padded only at the tail.
- unpadded, for reference: one window per micro-batch at its own length (the trainer without packing; shapes vary).

Window lengths: the demo preset trains on `training.window` = 32768-token windows, but its episodes are short; the
lengths here are a seeded log-uniform draw between budget/16 and the budget, the budget scaled to what a CPU step
can take (1024 tokens; 256 with --tiny). Tokens/s count window tokens only, never padding.

    .venv/bin/python benchmarks/train_step.py [--budget 1024 --windows 24 --grad-accum 4] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mass_ops.train.loss import chunked_next_token_loss  # noqa: E402
from mass_ops.train.packing import model_inputs, pack_windows, plan_packs, window_losses  # noqa: E402


@dataclass(frozen=True)
class Figures:
    """Tokens/s of the three batchings over the same windows, and the padding each computed."""

    windows: int
    tokens: int
    padded_tps: float
    packed_tps: float
    unpadded_tps: float
    padded_pad: int
    packed_pad: int

    @property
    def ratio(self) -> float:
        return self.packed_tps / self.padded_tps

    def lines(self) -> list[str]:
        return [
            f"padded: {self.padded_tps:.0f} tokens/s ({self.windows} windows, {self.tokens} tokens, "
            f"{self.padded_pad} padding tokens computed)",
            f"packed: {self.packed_tps:.0f} tokens/s ({self.packed_pad} padding tokens computed)",
            f"ratio packed/padded: {self.ratio:.2f}",
            f"unpadded (one window per micro-batch, shapes vary): {self.unpadded_tps:.0f} tokens/s",
        ]


def window_lengths(count: int, budget: int, seed: int = 0) -> list[int]:
    """Seeded log-uniform lengths between budget/16 and budget."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(math.log(budget / 16), math.log(budget), count)).round()]


def build_model(*, hidden: int, layers: int, vocab: int, lora_r: int):  # type: ignore[no-untyped-def]
    """A random Qwen3 with LoRA on every projection (fp32, SDPA), and its output projection as a frozen matrix."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
    )
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config)
    model.requires_grad_(False)
    head = model.get_output_embeddings().weight.detach().clone()
    model.set_output_embeddings(torch.nn.Identity())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, lora).train(), head


def _run(model, head, batches, labels, *, chunk: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds for forward + loss + backward of every micro-batch (each a PackedBatch or a plain id array)."""
    import torch

    started = time.perf_counter()
    for batch, window_labels in zip(batches, labels, strict=True):
        if isinstance(batch, np.ndarray):
            hidden = model(input_ids=torch.from_numpy(batch)[None], use_cache=False).logits
            lab = torch.from_numpy(window_labels[0])
            losses = [chunked_next_token_loss(hidden, lab, head, chunk=chunk)]
        else:
            hidden = model(**model_inputs(batch, "sdpa", device="cpu", dtype=torch.float32)).logits
            losses = window_losses(hidden, batch, window_labels, head, chunk=chunk, recompute=True)
        loss = losses[0][0] / losses[0][1]
        for total, count in losses[1:]:
            loss = loss + total / count
        loss.backward()
    return time.perf_counter() - started


def measure(
    *, budget: int, windows: int, grad_accum: int, hidden: int, layers: int, vocab: int, chunk: int = 256
) -> Figures:
    """Time the three batchings of the same seeded windows (one warm-up micro-batch first, untimed)."""
    lengths = window_lengths(windows, budget)
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, vocab, n) for n in lengths]
    labs = [np.where(np.arange(n) < n // 2, -100, i) for n, i in zip(lengths, ids, strict=True)]
    model, head = build_model(hidden=hidden, layers=layers, vocab=vocab, lora_r=8)

    padded = [pack_windows([i], budget, pad_id=0) for i in ids]
    packed, packed_labels = [], []
    for start in range(0, windows, grad_accum):
        step = list(range(start, min(start + grad_accum, windows)))
        for pack in plan_packs([lengths[k] for k in step], budget):
            packed.append(pack_windows([ids[step[k]] for k in pack], budget, pad_id=0))
            packed_labels.append([labs[step[k]] for k in pack])
    _run(model, head, padded[:1], [[labs[0]]], chunk=chunk)  # warm-up: allocator, kernels
    padded_s = _run(model, head, padded, [[lab] for lab in labs], chunk=chunk)
    packed_s = _run(model, head, packed, packed_labels, chunk=chunk)
    unpadded_s = _run(model, head, ids, [[lab] for lab in labs], chunk=chunk)
    tokens = sum(lengths)
    return Figures(
        windows=windows,
        tokens=tokens,
        padded_tps=tokens / padded_s,
        packed_tps=tokens / packed_s,
        unpadded_tps=tokens / unpadded_s,
        padded_pad=sum(b.pad for b in padded),
        packed_pad=sum(b.pad for b in packed),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=1024, help="Tokens per micro-batch (default 1024).")
    parser.add_argument("--windows", type=int, default=24, help="Windows timed in each batching (default 24).")
    parser.add_argument("--grad-accum", type=int, default=4, help="Windows per step that may share a pack.")
    parser.add_argument("--tiny", action="store_true", help="A tiny model, 256-token budget, 8 windows (the tests).")
    args = parser.parse_args(argv)
    if args.tiny:
        figures = measure(budget=256, windows=8, grad_accum=4, hidden=64, layers=2, vocab=512)
    else:
        figures = measure(
            budget=args.budget, windows=args.windows, grad_accum=args.grad_accum, hidden=128, layers=4, vocab=4096
        )
    for line in figures.lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
