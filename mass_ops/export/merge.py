"""Merge a LoRA adapter into its base checkpoint: W' = W + (alpha/r)·B·A, in fp32, cast back to W's dtype.

Streams shard by shard and, inside a tensor, row chunk by row chunk, so memory stays bounded by one chunk however
large the model. Every tensor the adapter does not target (norms, embeddings, vision tower, ``mtp.*``…) is copied byte
for byte; every non-weight file (config, index, tokenizer, chat template…) is copied; shard names and the index are
kept. The output folder appears only once complete (MASS_SPEC §9).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mass_ops.export.safetensors_io import (
    ExportError,
    ScratchBuffers,
    ShardReader,
    ShardWriter,
    TensorEntry,
    TensorSpec,
    copy_side_files,
    read_layout,
    row_chunks,
    staged_output_dir,
)
from mass_ops.export.torch_threads import export_threads

MERGE_INFO_NAME = "merge_info.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# PEFT key of one LoRA factor, with or without the "base_model.model." wrapper and the ".default" adapter name.
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(.*)\.lora_(A|B)\.(?:default\.)?weight$")
# A merged weight is produced in row chunks of whole 128-row FP8 block rows, so the fused merge+FP8 pass can quantize
# each chunk as it comes while splitting the weight exactly as this merge does (see ``row_chunks``).
ROW_ALIGN = 128
# fp32 accumulation is exact enough for these; an fp64 weight would lose precision, so it is refused.
_FLOAT_CODES = {"BF16", "F16", "F32"}


@dataclass(frozen=True)
class LoraAdapter:
    """A parsed adapter: module path in the base checkpoint -> (A key, B key) in ``path``, and its scaling."""

    path: Path
    modules: dict[str, tuple[str, str]]
    r: int
    alpha: float
    scale: float


@dataclass(frozen=True)
class MergeInfo:
    """What a merge did; ``merge_info.json`` holds the same facts."""

    base: str
    lora: str
    out_dir: str
    r: int
    alpha: float
    scale: float
    merged_modules: list[str]


def _adapter_config(config_path: Path, r: int | None, alpha: float | None) -> tuple[int, float, float]:
    """(r, alpha, scale) from a PEFT adapter_config.json, refusing options this merge does not implement."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{config_path}: cannot read adapter config ({exc})") from None
    for option in ("use_dora", "fan_in_fan_out"):
        if config.get(option):
            raise ExportError(f"{config_path}: {option}=true is not supported by the LoRA merge")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise ExportError(f"{config_path}: per-module {option} is not supported by the LoRA merge")
    if config.get("lora_bias"):
        raise ExportError(f"{config_path}: lora_bias=true is not supported by the LoRA merge")
    cfg_r, cfg_alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(cfg_r, int) or not isinstance(cfg_alpha, int | float):
        raise ExportError(f"{config_path}: r and lora_alpha must be numbers")
    if r is not None and r != cfg_r:
        raise ExportError(f"{config_path}: r={cfg_r} but the merge was asked for r={r}")
    if alpha is not None and alpha != cfg_alpha:
        raise ExportError(f"{config_path}: lora_alpha={cfg_alpha} but the merge was asked for alpha={alpha}")
    scale = cfg_alpha / math.sqrt(cfg_r) if config.get("use_rslora") else cfg_alpha / cfg_r
    return cfg_r, float(cfg_alpha), scale


def read_adapter(lora_path: str | Path, *, r: int | None = None, alpha: float | None = None) -> LoraAdapter:
    """Parse a LoRA state-dict file (PEFT key names) or a PEFT adapter folder.

    A bare file needs ``r`` and ``alpha``; a folder's adapter_config.json supplies them (and must agree if both are
    given). Every key must be a LoRA factor, every module must have both factors, and their rank must be ``r``.
    """
    lora_path = Path(lora_path)
    if lora_path.is_dir():
        weights = lora_path / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise ExportError(f"{lora_path}: adapter folder has no {ADAPTER_WEIGHTS}")
        r, alpha, scale = _adapter_config(lora_path / ADAPTER_CONFIG, r, alpha)
    else:
        weights = lora_path
        if r is None or alpha is None:
            raise ExportError(f"{lora_path}: a bare LoRA state dict needs r and alpha")
        scale = alpha / r
    if r <= 0:
        raise ExportError(f"{lora_path}: LoRA rank must be positive, got {r}")

    factors: dict[str, dict[str, TensorEntry]] = {}
    with ShardReader(weights) as reader:
        for key, entry in reader.entries.items():
            match = LORA_KEY.match(key.replace("._fsdp_wrapped_module", ""))
            if match is None:
                raise ExportError(f"{weights}: key {key} is not a LoRA A/B weight (PEFT naming)")
            module, factor = match.groups()
            pair = factors.setdefault(module, {})
            if factor in pair:
                raise ExportError(
                    f"{weights}: module {module} has two lora_{factor} tensors ({pair[factor].name}, {key})"
                )
            pair[factor] = entry
    if not factors:
        raise ExportError(f"{weights}: no LoRA tensors")
    modules = {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise ExportError(f"{weights}: module {module} has lora_{''.join(pair)} but not its partner")
        a, b = pair["A"], pair["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ExportError(f"{weights}: module {module} has A {list(a.shape)}, B {list(b.shape)}; expected rank {r}")
        modules[module] = (a.name, b.name)
    return LoraAdapter(weights, modules, r, float(alpha), scale)


def merged_chunks(
    reader: ShardReader,
    name: str,
    factors: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    scratch: ScratchBuffers,
    *,
    turns: int = 1,
) -> Iterator[torch.Tensor]:
    """W + scale·B·A for weight ``name``, summed in fp32 and cast to W's dtype, in consecutive row chunks of whole
    ``ROW_ALIGN`` rows (``row_chunks``); ``factors`` is (A, B) in fp32.

    Each chunk is a view of ``scratch``, one of ``turns`` buffers used in rotation (``ScratchBuffers.take_turn``):
    it stays valid until ``turns`` more chunks have been merged with that ``scratch``, so a consumer on another
    thread can still be reading it while the next is merged.
    """
    a, b = factors
    entry = reader.entry(name)
    rows, cols = entry.shape
    for start, stop in row_chunks(rows, cols, ROW_ALIGN):
        count = (stop - start) * cols
        raw = scratch.take("merge.raw", (stop - start) * entry.row_bytes, torch.uint8)
        w = reader.read_rows(name, start, stop, into=raw)
        acc = scratch.take("merge.fp32", count, torch.float32).view(stop - start, cols)
        acc.copy_(w)
        acc.addmm_(b[start:stop], a, alpha=scale)
        out = scratch.take_turn("merge.out", count, entry.torch_dtype, turns).view(stop - start, cols)
        out.copy_(acc)
        yield out


def merge_targets(
    adapter: LoraAdapter, entries: dict[str, TensorEntry], lora: ShardReader, base_dir: Path
) -> dict[str, tuple[str, str]]:
    """Base weight name -> (A key, B key) for every adapter module; an error unless each module has a float
    ``<module>.weight`` of the shape B·A has."""
    targets: dict[str, tuple[str, str]] = {}
    for module, (a_key, b_key) in adapter.modules.items():
        weight = f"{module}.weight"
        entry = entries.get(weight)
        if entry is None:
            raise ExportError(f"LoRA module {module} from {adapter.path} has no {weight} in base {base_dir}")
        expected = (lora.entry(b_key).shape[0], lora.entry(a_key).shape[1])
        if entry.shape != expected or entry.dtype not in _FLOAT_CODES:
            raise ExportError(
                f"LoRA module {module}: base {weight} is {entry.dtype}{list(entry.shape)}, "
                f"the adapter needs a float {list(expected)}"
            )
        targets[weight] = (a_key, b_key)
    return targets


def merged_shard_writer(path: Path, reader: ShardReader) -> ShardWriter:
    """The merged counterpart of base shard ``reader``, at ``path``: same tensors, dtypes, shapes and metadata
    (tensors the index assigns elsewhere included: the merge keeps files whole)."""
    specs = [TensorSpec.like(entry) for entry in reader.entries.values()]
    return ShardWriter(path, specs, metadata=reader.metadata)


def read_factors(lora: ShardReader, keys: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one module in fp32."""
    a_key, b_key = keys
    return lora.read(a_key).to(torch.float32), lora.read(b_key).to(torch.float32)


def finish_merge(
    stage: Path, base_dir: Path, shard_files: list[str], adapter: LoraAdapter, lora_path: Path, out_dir: str | Path
) -> MergeInfo:
    """Copy the base's side files into ``stage`` and write merge_info.json there."""
    copy_side_files(base_dir, stage, skip=set(shard_files) | {MERGE_INFO_NAME})
    info = MergeInfo(
        base=str(base_dir.resolve()),
        lora=str(lora_path.resolve()),
        out_dir=str(Path(out_dir).resolve()),
        r=adapter.r,
        alpha=adapter.alpha,
        scale=adapter.scale,
        merged_modules=sorted(adapter.modules),
    )
    record = {
        "base": info.base,
        "lora": info.lora,
        "r": info.r,
        "alpha": info.alpha,
        "scale": info.scale,
        "merged_modules": info.merged_modules,
    }
    (stage / MERGE_INFO_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return info


@export_threads()
def merge_lora(
    base_dir: str | Path,
    lora_path: str | Path,
    out_dir: str | Path,
    *,
    r: int | None = None,
    alpha: float | None = None,
) -> MergeInfo:
    """Merge the adapter at ``lora_path`` into the safetensors checkpoint ``base_dir``, writing ``out_dir``.

    Errors (before writing anything) if an adapter module has no ``<module>.weight`` of matching shape in the base or
    if ``out_dir`` has content.
    """
    base_dir = Path(base_dir)
    adapter = read_adapter(lora_path, r=r, alpha=alpha)
    layout = read_layout(base_dir)
    with ShardReader(adapter.path) as lora:
        targets = merge_targets(adapter, layout.entries(), lora, base_dir)
        with staged_output_dir(out_dir) as stage:
            scratch = ScratchBuffers()
            for shard in layout.shard_files:
                with ShardReader(base_dir / shard) as reader, merged_shard_writer(stage / shard, reader) as writer:
                    for name in reader.entries:
                        if layout.weight_map.get(name) == shard and name in targets:
                            factors = read_factors(lora, targets[name])
                            for rows in merged_chunks(reader, name, factors, adapter.scale, scratch):
                                writer.write(name, rows)
                        else:
                            writer.copy_from(reader, name)
            info = finish_merge(stage, base_dir, layout.shard_files, adapter, Path(lora_path), out_dir)
    return info
