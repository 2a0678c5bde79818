"""Block-wise FP8 (e4m3) export of a BF16 checkpoint, in the format vLLM and transformers load as ``quant_method: fp8``.

Each quantized ``<module>.weight`` [out, in] becomes ``weight`` (float8_e4m3fn) plus ``weight_scale_inv`` (bf16,
[ceil(out/128), ceil(in/128)]), the dequantisation multiplier of each 128×128 block, computed per block as the
reference quantiser does (MASS_SPEC §9). Every element: |w − q·scale_bf16| ≤ (2^-4 + 2^-8)·|w| + 2^-10·scale.
Quantized tensors: with a reference FP8 checkpoint exactly those it quantizes, in its shard layout; without one every
2-D linear decoder weight whose dimensions are whole blocks (the rest stay BF16, in ``modules_to_not_convert``).
Error bound derivation and tensor selection: docs/export.md (`mass_ops.export.fp8`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from mass_ops.export.merge import MERGE_INFO_NAME  # a merged reference's record: never copied into the FP8 folder
from mass_ops.export.safetensors_io import (
    DTYPE_CODES,
    INDEX_NAME,
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
    write_index,
)
from mass_ops.export.torch_threads import export_threads

FP8_DTYPE = torch.float8_e4m3fn
# Stored scales are bf16 always (MASS_SPEC §9), also when a reference checkpoint keeps fp32 ones.
SCALE_DTYPE = torch.bfloat16
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero block still gets a finite, non-zero scale
# Below this, float8_e4m3fn conversion (round to nearest even) already lands on ±448 or less: the next e4m3 step
# above 448 would be 480, so 464 is the rounding midpoint. Quotients known to stay below it need no clamp.
_ROUNDS_WITHIN_RANGE = 464.0
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
QUANT_INFO_NAME = "quant_info.json"

_FLOAT_CODES = {"BF16", "F16", "F32"}
# Module path segments that are not decoder linears worth quantizing (embeddings, output head, vision, MTP).
_KEEP_SEGMENTS = {
    "embed_tokens",
    "embeddings",
    "embed",
    "wte",
    "wpe",
    "lm_head",
    "visual",
    "vision_tower",
    "vision_model",
    "mtp",
}
# MoE routers are 2-D but tiny and precision-critical; official FP8 releases keep them in BF16.
_ROUTER_NAMES = {"gate", "router", "shared_expert_gate"}
_NORM = re.compile(r"norm", re.IGNORECASE)


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _bf16_block_amax(tiles: torch.Tensor, scratch: ScratchBuffers) -> torch.Tensor:
    """Per-block max|w| of bf16 ``tiles`` [n_rows, b0, n_cols, b1], as fp32, read from the bit patterns.

    Clearing the sign bit leaves, for every bf16 value, an int16 that orders exactly as its magnitude does (NaN and
    inf patterns sort above every finite one, so they still surface as a non-finite amax). Two passes over the
    2-byte values cost ~25% less than an fp32 max and min over the converted weight.
    """
    magnitude = scratch.take("fp8.bits", tiles.numel(), torch.int16).view(tiles.shape)
    torch.bitwise_and(tiles.view(torch.int16), 0x7FFF, out=magnitude)
    return magnitude.amax(dim=3).amax(dim=1).view(torch.bfloat16).to(torch.float32)


def quantize_blockwise(
    w: torch.Tensor,
    *,
    block: tuple[int, int] = BLOCK,
    scratch: ScratchBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to (q float8_e4m3fn [out, in], scale_inv bf16 [ceil(out/b0), ceil(in/b1)]).

    q = e4m3(clamp(w / (amax/448 in fp32), ±448)); the returned scale is that fp32 scale rounded to bf16.

    ``w`` is not modified. With ``scratch`` the returned ``q`` is a view of a reused buffer (consume it before the
    next call); without it both results are fresh tensors. Errors on non-finite weights (a NaN would silently poison
    a whole block's scale).
    """
    if w.ndim != 2:
        raise ExportError(f"block-wise FP8 needs a 2-D weight, got shape {list(w.shape)}")
    rows, cols = w.shape
    n_rows, n_cols = _blocks(rows, cols, block)
    buffers = scratch or ScratchBuffers()
    padded = (n_rows * block[0], n_cols * block[1])
    x = buffers.take("fp8.work", padded[0] * padded[1], torch.float32).view(padded)
    if padded != (rows, cols):
        x.zero_()  # zero padding never raises a block's amax: partial blocks get the amax of their real elements
    x[:rows, :cols].copy_(w)
    tiles = x.view(n_rows, block[0], n_cols, block[1])
    if padded == (rows, cols) and w.dtype == torch.bfloat16 and w.is_contiguous():
        amax = _bf16_block_amax(w.view(tiles.shape), buffers)  # the common case: a BF16 weight of whole blocks
    else:
        # Reducing the contiguous innermost axis first is ~2x faster than one reduction over (1, 3), and max is
        # exact in any order, so the result is the same.
        amax = torch.maximum(tiles.amax(dim=3).amax(dim=1), tiles.amin(dim=3).amin(dim=1).neg_())
    if not torch.isfinite(amax).all():
        raise ExportError("weight contains NaN or infinite values; refusing to quantize it")
    # The reference divides by the fp32 scale, not by the bf16 number it stores: bytes differ where the two differ.
    divisor = amax.clamp_(min=AMAX_FLOOR) / FP8_MAX
    tiles.div_(divisor[:, None, :, None])
    # Division is monotonic, so no quotient exceeds its block's amax/divisor = 448 up to fp32 rounding, which the
    # conversion rounds to 448 exactly as clamping first would, so the clamp pass is skipped. Should a divisor ever
    # lose precision the clamp runs: torch 2.13 saturates on conversion, earlier releases turned ≥ 480 into NaN.
    if not bool((amax / divisor < _ROUNDS_WITHIN_RANGE).all()):
        x.clamp_(-FP8_MAX, FP8_MAX)
    scale = divisor.to(SCALE_DTYPE)
    q = buffers.take("fp8.q", x.numel(), FP8_DTYPE).view(padded)
    q.copy_(x)
    q = q[:rows, :cols]
    return (q if scratch is not None else q.contiguous()), scale


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, *, block: tuple[int, int] = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w ≈ q · scale_inv broadcast over blocks (partial edge blocks included), returned in ``dtype``."""
    rows, cols = q.shape
    expected = _blocks(rows, cols, block)
    if tuple(scale_inv.shape) != expected:
        raise ExportError(
            f"scale grid {list(scale_inv.shape)} does not fit weight {[rows, cols]} in {list(block)} blocks "
            f"(expected {list(expected)})"
        )
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], dim=0)[:rows]
    scale = scale.repeat_interleave(block[1], dim=1)[:, :cols]
    return (q.to(torch.float32) * scale).to(dtype)


def _module_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def auto_quantizable(entry: TensorEntry, block: tuple[int, int]) -> bool:
    """Whether a tensor is a whole-block decoder linear weight (the default selection without a reference)."""
    if not entry.name.endswith(".weight") or len(entry.shape) != 2 or entry.dtype not in _FLOAT_CODES:
        return False
    segments = _module_of(entry.name).split(".")
    if _KEEP_SEGMENTS.intersection(segments) or segments[-1] in _ROUTER_NAMES or _NORM.search(segments[-1]):
        return False
    rows, cols = entry.shape
    return rows > 0 and cols > 0 and rows % block[0] == 0 and cols % block[1] == 0


def fp8_quantization_config(modules_to_not_convert: list[str], block: tuple[int, int] = BLOCK) -> dict[str, object]:
    """`quantization_config` for config.json: block FP8 as vLLM and transformers (FineGrainedFP8) read it."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        # transformers adds no default skips (not even lm_head) once this list is given, so it must be complete.
        "modules_to_not_convert": modules_to_not_convert,
    }


@dataclass(frozen=True)
class Fp8Info:
    """What an FP8 export did; ``quant_info.json`` holds the same facts."""

    src: str
    ref: str | None
    out_dir: str
    quantized: list[str]
    copied: list[str]
    modules_to_not_convert: list[str]


@dataclass(frozen=True)
class _Plan:
    """Where every output tensor goes and how it is produced."""

    shards: dict[str, list[TensorSpec]]  # output shard file -> tensors it holds
    quantized: dict[str, str]  # weight name -> scale tensor name
    copied: list[str]
    block: tuple[int, int]
    config: dict[str, object] | None  # the reference's config.json, used verbatim when present
    not_converted: list[str]


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


def _block_from_config(config: dict[str, object], where: Path) -> tuple[int, int]:
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("weight_block_size") is None:
        return BLOCK
    size = quant["weight_block_size"]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise ExportError(f"{where}: quantization_config.weight_block_size {size!r} is not two positive integers")
    return size[0], size[1]


def _plan_auto(src_entries: dict[str, TensorEntry], src_map: dict[str, str]) -> _Plan:
    shards: dict[str, list[TensorSpec]] = {}
    quantized: dict[str, str] = {}
    copied = []
    not_converted = {"lm_head"}  # tied heads are absent from the shards but still must stay unconverted
    for name, entry in src_entries.items():
        specs = shards.setdefault(src_map[name], [])
        if auto_quantizable(entry, BLOCK):
            scale_name = name + SCALE_SUFFIX
            quantized[name] = scale_name
            specs.append(TensorSpec(name, DTYPE_CODES[FP8_DTYPE], entry.shape))
            specs.append(
                TensorSpec(scale_name, DTYPE_CODES[SCALE_DTYPE], _blocks(entry.shape[0], entry.shape[1], BLOCK))
            )
        else:
            copied.append(name)
            specs.append(TensorSpec.like(entry))
            if name.endswith(".weight") and len(entry.shape) >= 2:
                not_converted.add(_module_of(name))
    return _Plan(shards, quantized, sorted(copied), BLOCK, None, sorted(not_converted))


def _plan_from_reference(src_entries: dict[str, TensorEntry], reference_dir: Path) -> _Plan:
    ref_layout = read_layout(reference_dir)
    ref_entries = ref_layout.entries()
    ref_config_path = reference_dir / "config.json"
    ref_config = _read_json(ref_config_path) if ref_config_path.is_file() else None
    block = _block_from_config(ref_config, ref_config_path) if ref_config else BLOCK
    quantized: dict[str, str] = {}
    for scale_name, scale_entry in ref_entries.items():
        if not scale_name.endswith(SCALE_SUFFIX):
            continue
        name = scale_name.removesuffix(SCALE_SUFFIX)
        src, ref = src_entries.get(name), ref_entries.get(name)
        if src is None:
            raise ExportError(f"{reference_dir}: reference quantizes {name}, which the source checkpoint lacks")
        if ref is None or ref.dtype != DTYPE_CODES[FP8_DTYPE]:
            raise ExportError(f"{reference_dir}: {scale_name} has no float8_e4m3fn {name} beside it")
        if ref.shape != src.shape or len(src.shape) != 2:
            raise ExportError(f"{reference_dir}: {name} is {list(ref.shape)} there but {list(src.shape)} in the source")
        if scale_entry.shape != _blocks(*src.shape, block):
            raise ExportError(
                f"{reference_dir}: {scale_name} grid {list(scale_entry.shape)} is not {list(block)} blocks of {name}"
            )
        quantized[name] = scale_name
    produced = set(src_entries) | set(quantized.values())
    for name in sorted(set(ref_entries) - produced):
        raise ExportError(f"{reference_dir}: reference tensor {name} has no counterpart in the source checkpoint")
    for name in sorted(set(src_entries) - set(ref_entries)):
        raise ExportError(f"{reference_dir}: source tensor {name} is not in the reference layout")
    shards: dict[str, list[TensorSpec]] = {}
    copied = []
    for name, entry in src_entries.items():
        if name in quantized:
            scale_name = quantized[name]
            shards.setdefault(ref_layout.weight_map[name], []).append(
                TensorSpec(name, DTYPE_CODES[FP8_DTYPE], entry.shape)
            )
            shards.setdefault(ref_layout.weight_map[scale_name], []).append(
                TensorSpec(scale_name, DTYPE_CODES[SCALE_DTYPE], ref_entries[scale_name].shape)
            )
        else:
            if ref_entries[name].shape != entry.shape:
                raise ExportError(
                    f"{reference_dir}: {name} is {list(ref_entries[name].shape)} there, "
                    f"{list(entry.shape)} in the source"
                )
            copied.append(name)
            shards.setdefault(ref_layout.weight_map[name], []).append(TensorSpec.like(entry))
    not_converted = sorted(
        {"lm_head"} | {_module_of(n) for n in copied if n.endswith(".weight") and len(src_entries[n].shape) >= 2}
    )
    return _Plan(shards, quantized, sorted(copied), block, ref_config, not_converted)


def _output_config(plan: _Plan, config_dir: Path, ref_dir: Path | None) -> dict[str, object]:
    """The config.json of the FP8 checkpoint: the reference's verbatim, else the source's (in ``config_dir``) with a
    quantization_config added."""
    src_config_path = config_dir / "config.json"
    if plan.config is not None:
        config = plan.config
        quant = config.get("quantization_config")
        if not isinstance(quant, dict) or "fp8" not in str(quant.get("quant_method", "")):
            raise ExportError(f"{ref_dir}/config.json: no fp8 quantization_config; is this an FP8 checkpoint?")
        src_type = _read_json(src_config_path).get("model_type") if src_config_path.is_file() else None
        if src_type is not None and src_type != config.get("model_type"):
            raise ExportError(
                f"{ref_dir}/config.json: model_type {config.get('model_type')!r} is not the source's {src_type!r}"
            )
        return config
    if not src_config_path.is_file():
        raise ExportError(f"{config_dir}: no config.json to carry the quantization_config")
    config = _read_json(src_config_path)
    config["quantization_config"] = fp8_quantization_config(plan.not_converted, plan.block)
    return config


class WeightQuantizer:
    """Quantizes one weight fed as consecutive row chunks of whole block rows (only the last may be partial): FP8
    rows are written as they come, only the (small) scale grid is held until ``close`` writes it."""

    def __init__(
        self,
        name: str,
        scale_name: str,
        block: tuple[int, int],
        writers: tuple[ShardWriter, ShardWriter],
        where: Path,
        scratch: ScratchBuffers,
    ) -> None:
        self.name, self._scale_name, self._block = name, scale_name, block
        self._writer, self._scale_writer = writers
        self._where, self._scratch = where, scratch
        self._scales: list[torch.Tensor] = []

    def add(self, w: torch.Tensor) -> None:
        """Quantize and write the next rows."""
        try:
            q, scale = quantize_blockwise(w, block=self._block, scratch=self._scratch)
        except ExportError as exc:
            raise ExportError(f"{self._where} [{self.name}]: {exc}") from None
        self._writer.write(self.name, q)
        self._scales.append(scale)

    def close(self) -> None:
        self._scale_writer.write(self._scale_name, torch.cat(self._scales))


class Fp8Output:
    """An FP8 checkpoint being written: planned from the source's tensor headers before any output exists (so every
    refusal comes first), then fed tensor by tensor, in any order, while all its shards are open, then finished.

    Every output shard is planned up front, so all can be open at once and each source shard is read once, front to
    back, even when a reference layout scatters a weight and its scale over different files.
    """

    def __init__(
        self, src_entries: dict[str, TensorEntry], weight_map: dict[str, str], config_dir: Path, ref_dir: Path | None
    ) -> None:
        """``src_entries`` in the source shards' storage order (it decides the output header order); ``config_dir``
        holds the source's config.json."""
        self.ref_dir = ref_dir
        self._plan = _plan_from_reference(src_entries, ref_dir) if ref_dir else _plan_auto(src_entries, weight_map)
        self.config = _output_config(self._plan, config_dir, ref_dir)
        self._destination = {spec.name: shard for shard, specs in self._plan.shards.items() for spec in specs}
        self._writers: dict[str, ShardWriter] = {}

    @property
    def block(self) -> tuple[int, int]:
        return self._plan.block

    def quantizes(self, name: str) -> bool:
        return name in self._plan.quantized

    @contextmanager
    def shards_open(self, stage: Path) -> Iterator[None]:
        """Every output shard open in ``stage``; each must be complete when the block ends."""
        with ExitStack() as stack:
            self._writers = {
                shard: stack.enter_context(ShardWriter(stage / shard, specs))
                for shard, specs in self._plan.shards.items()
            }
            try:
                yield
            finally:
                self._writers = {}

    def quantizer(self, name: str, where: Path, scratch: ScratchBuffers) -> WeightQuantizer:
        """A quantizer for weight ``name`` to feed chunk by chunk (``where`` names its source in errors)."""
        scale_name = self._plan.quantized[name]
        writers = self._writers[self._destination[name]], self._writers[self._destination[scale_name]]
        return WeightQuantizer(name, scale_name, self.block, writers, where, scratch)

    def quantize(self, name: str, chunks: Iterable[torch.Tensor], where: Path, scratch: ScratchBuffers) -> None:
        """Quantize weight ``name`` given as consecutive row chunks of whole block rows (only the last may be
        partial)."""
        quantizer = self.quantizer(name, where, scratch)
        for w in chunks:
            quantizer.add(w)
        quantizer.close()

    def write(self, name: str, rows: torch.Tensor) -> None:
        """Append the next rows of an unquantized tensor."""
        self._writers[self._destination[name]].write(name, rows)

    def copy(self, reader: ShardReader, name: str) -> None:
        """Copy an unquantized tensor byte for byte."""
        self._writers[self._destination[name]].copy_from(reader, name)

    def finish(self, stage: Path, src_dir: Path, src_shards: list[str], out_dir: str | Path) -> Fp8Info:
        """Side files (the source's, then the reference's), config.json, index and quant_info.json in ``stage``."""
        plan, ref_dir = self._plan, self.ref_dir
        copy_side_files(src_dir, stage, skip=set(src_shards) | {INDEX_NAME, "config.json", QUANT_INFO_NAME})
        if ref_dir is not None:
            # Tokenizer, chat template, generation config: the reference's, so servers treat it like the official FP8.
            ref_skip = set(read_layout(ref_dir).shard_files) | {
                INDEX_NAME,
                "config.json",
                QUANT_INFO_NAME,
                MERGE_INFO_NAME,
            }
            for item in ref_dir.iterdir():
                if item.name not in ref_skip and item.is_file():
                    (stage / item.name).write_bytes(item.read_bytes())
        (stage / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        quant_config = cast(dict[str, Any], self.config["quantization_config"])
        total = sum(spec.nbytes for specs in plan.shards.values() for spec in specs)
        write_index(stage, self._destination, total)
        info = Fp8Info(
            src=str(src_dir.resolve()),
            ref=str(ref_dir.resolve()) if ref_dir else None,
            out_dir=str(Path(out_dir).resolve()),
            quantized=sorted(plan.quantized),
            copied=plan.copied,
            modules_to_not_convert=list(quant_config.get("modules_to_not_convert") or []),
        )
        record = {"src": info.src, "ref": info.ref, "quantized": info.quantized, "copied": info.copied}
        (stage / QUANT_INFO_NAME).write_text(json.dumps(record, indent=2) + "\n")
        return info


@export_threads()
def export_fp8(src_dir: str | Path, out_dir: str | Path, *, reference_dir: str | Path | None = None) -> Fp8Info:
    """Quantize the BF16 checkpoint in ``src_dir`` to block FP8 in ``out_dir``, shard by shard.

    ``out_dir`` must be absent or empty; it appears only when complete. With ``reference_dir`` (an FP8 checkpoint of
    the same architecture) the selection, block size, shard layout and config.json follow it (scales stay bf16).
    """
    src_dir = Path(src_dir)
    ref_dir = Path(reference_dir) if reference_dir is not None else None
    src_layout = read_layout(src_dir)
    output = Fp8Output(src_layout.entries(), src_layout.weight_map, src_dir, ref_dir)
    with staged_output_dir(out_dir) as stage:
        scratch = ScratchBuffers()
        with output.shards_open(stage):
            for src_shard in src_layout.shard_files:
                with ShardReader(src_dir / src_shard) as reader:
                    for name in (n for n in reader.entries if src_layout.weight_map.get(n) == src_shard):
                        if output.quantizes(name):
                            chunks = reader.read_chunks(name, output.block[0], scratch, "fp8.raw")
                            output.quantize(name, chunks, reader.path, scratch)
                        else:
                            output.copy(reader, name)
        info = output.finish(stage, src_dir, src_layout.shard_files, out_dir)
    return info


@dataclass(frozen=True)
class TensorCheck:
    """Stored FP8 vs its BF16 source, and vs a fresh re-quantisation of that source."""

    name: str
    max_rel_error: float  # max|w − deq| / max|w|
    mean_rel_error: float  # mean|w − deq| / mean|w|
    identical_fp8_share: float  # share of FP8 bytes equal to the re-quantisation's
    identical_scale_share: float  # share of scales equal to the re-quantisation's


@dataclass(frozen=True)
class Fp8Verification:
    tensors: list[TensorCheck]
    max_rel_error: float
    identical_fp8_share: float
    identical_scale_share: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def verify_fp8(src_dir: str | Path, fp8_dir: str | Path, *, max_tensors: int | None = None) -> Fp8Verification:
    """Re-quantize the BF16 source of every FP8 weight in ``fp8_dir`` (the first ``max_tensors`` if given) and report
    dequantisation error and the share of identical FP8 bytes and scales."""
    src_dir, fp8_dir = Path(src_dir), Path(fp8_dir)
    src_layout, fp8_layout = read_layout(src_dir), read_layout(fp8_dir)
    fp8_entries = fp8_layout.entries()
    config_path = fp8_dir / "config.json"
    block = _block_from_config(_read_json(config_path), config_path) if config_path.is_file() else BLOCK
    names = sorted(
        n for n, e in fp8_entries.items() if e.dtype == DTYPE_CODES[FP8_DTYPE] and n + SCALE_SUFFIX in fp8_entries
    )
    if not names:
        raise ExportError(f"{fp8_dir}: no float8_e4m3fn weight with a {SCALE_SUFFIX} tensor to verify")
    checks, same_q, same_s, count_q, count_s = [], 0, 0, 0, 0
    for name in names[:max_tensors]:
        if name not in src_layout.weight_map:
            raise ExportError(f"{src_dir}: FP8 weight {name} has no source tensor here")
        with (
            ShardReader(src_dir / src_layout.weight_map[name]) as src,
            ShardReader(fp8_dir / fp8_layout.weight_map[name]) as fp8,
            ShardReader(fp8_dir / fp8_layout.weight_map[name + SCALE_SUFFIX]) as scales,
        ):
            rows, cols = src.entry(name).shape
            if fp8.entry(name).shape != (rows, cols):
                raise ExportError(f"{fp8_dir}: {name} is {list(fp8.entry(name).shape)}, source is {[rows, cols]}")
            scale_all = scales.read(name + SCALE_SUFFIX)
            max_err = max_w = sum_err = sum_w = 0.0
            eq_q = eq_s = 0
            for start, stop in row_chunks(rows, cols, block[0]):
                w = src.read_rows(name, start, stop).to(torch.float32)
                q = fp8.read_rows(name, start, stop)
                s = scale_all[start // block[0] : math.ceil(stop / block[0])]
                err = (w - dequantize_blockwise(q, s, block=block)).abs_()
                max_err, sum_err = max(max_err, err.max().item()), sum_err + err.sum().item()
                max_w, sum_w = max(max_w, w.abs().max().item()), sum_w + w.abs().sum().item()
                q_new, s_new = quantize_blockwise(w, block=block)
                eq_q += int((q_new.view(torch.uint8) == q.view(torch.uint8)).sum().item())
                eq_s += int((s_new == s).sum().item())
        n_q, n_s = rows * cols, scale_all.numel()
        checks.append(
            TensorCheck(
                name, max_err / max(max_w, AMAX_FLOOR), sum_err / max(sum_w, AMAX_FLOOR), eq_q / n_q, eq_s / n_s
            )
        )
        same_q, same_s, count_q, count_s = same_q + eq_q, same_s + eq_s, count_q + n_q, count_s + n_s
    return Fp8Verification(
        tensors=checks,
        max_rel_error=max(c.max_rel_error for c in checks),
        identical_fp8_share=same_q / count_q,
        identical_scale_share=same_s / count_s,
    )
