"""Whether a block-FP8 checkpoint loads under tensor parallelism: every quantized weight's slice must hold whole blocks.

vLLM splits a column-parallel linear (q/k/v, gate/up, the linear-attention input projections) along its output rows
and a row-parallel one (o_proj, down_proj, out_proj) along its input columns, then requires each rank's slice of a
block-FP8 weight to be a multiple of the block (128): a 384-row projection loads on 1 or 3 GPUs but not on 2 (192
rows each), and vLLM fails at start-up, after the whole cycle has run. The export stage asks this module before it
writes anything. Key/value projections with fewer heads than ranks are replicated one head per rank, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mass_ops.export.fp8 import BLOCK, SCALE_SUFFIX, auto_quantizable
from mass_ops.export.safetensors_io import ExportError, read_layout

# Linears vLLM shards along their input dimension; every other quantized linear is sharded along its output.
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj"})
_KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})


@dataclass(frozen=True)
class SplitProblem:
    """One quantized weight whose per-rank slice is not made of whole blocks."""

    name: str
    dimension: str  # "output rows" or "input columns"
    size: int
    ranks: int
    block: int

    def describe(self) -> str:
        share = self.size / self.ranks
        shown = f"{share:g}" if share == int(share) else f"{share:.1f}"
        return f"{self.name} {self.size} {self.dimension} / {self.ranks} = {shown}, not a multiple of {self.block}"


def split_problems(
    shapes: Mapping[str, tuple[int, int]],
    tensor_parallel_size: int,
    *,
    kv_heads: int | None = None,
    block: tuple[int, int] = BLOCK,
) -> list[SplitProblem]:
    """The quantized weights (name → [out, in]) whose slice on `tensor_parallel_size` ranks is not whole blocks."""
    problems = []
    for name, (rows, cols) in sorted(shapes.items()):
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if module in ROW_PARALLEL:
            size, ranks, side, dimension = cols, tensor_parallel_size, block[1], "input columns"
        else:
            size, ranks, side, dimension = rows, tensor_parallel_size, block[0], "output rows"
            if module in _KV_PROJECTIONS and kv_heads and kv_heads < tensor_parallel_size:
                ranks = kv_heads  # replicated: each rank holds one whole head
        if size % ranks or (size // ranks) % side:
            problems.append(SplitProblem(name, dimension, size, ranks, side))
    return problems


def quantized_weight_shapes(
    src_dir: str | Path, *, reference_dir: str | Path | None = None
) -> dict[str, tuple[int, int]]:
    """Shapes of the weights an FP8 export of `src_dir` quantizes (the reference's selection when one is given)."""
    entries = read_layout(src_dir).entries()
    if reference_dir is not None:
        names = [n.removesuffix(SCALE_SUFFIX) for n in read_layout(reference_dir).entries() if n.endswith(SCALE_SUFFIX)]
        return {
            n: (entries[n].shape[0], entries[n].shape[1]) for n in names if n in entries and len(entries[n].shape) == 2
        }
    return {n: (e.shape[0], e.shape[1]) for n, e in entries.items() if auto_quantizable(e, BLOCK)}


def _kv_heads(src_dir: Path) -> int | None:
    try:
        config = json.loads((src_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("num_key_value_heads") if isinstance(text, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def summarize(problems: Iterable[SplitProblem], *, shown: int = 3) -> str:
    problems = list(problems)
    head = "; ".join(p.describe() for p in problems[:shown])
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return head + more


def check_fp8_tensor_parallel(
    src_dir: str | Path, tensor_parallel_size: int, *, reference_dir: str | Path | None = None
) -> None:
    """Raise `ExportError` (one line) when the FP8 export of `src_dir` would not load on `tensor_parallel_size` GPUs."""
    src = Path(src_dir)
    shapes = quantized_weight_shapes(src, reference_dir=reference_dir)
    problems = split_problems(shapes, tensor_parallel_size, kv_heads=_kv_heads(src))
    if problems:
        raise ExportError(
            f"export: the FP8 model of {src} would not load with inference.tensor_parallel_size "
            f"{tensor_parallel_size} (vLLM needs whole {BLOCK[0]}-wide blocks per GPU): {summarize(problems)}; choose "
            "a tensor-parallel size that splits them evenly or set export.formats=[bf16]"
        )
