"""One-pass merge + FP8 export: the same bytes as merge_lora then export_fp8, refusals before anything is written."""

from __future__ import annotations

import json
import shutil
import struct
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mass_ops.export import (
    ExportError,
    export_fp8,
    merge_and_export_fp8,
    merge_lora,
    quantize_blockwise,
    safetensors_io,
)
from tests.support.export import lora_state_dict, peft_lora, qwen3_model

INDEX = "model.safetensors.index.json"


def load_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor the index (or the single file) assigns, read with the reference safetensors library."""
    index = folder / INDEX
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = {file: load_file(folder / file) for file in set(weight_map.values())}
    return {name: shards[file][name] for name, file in weight_map.items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def save_with_names_sorted(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Save like ``safetensors`` (data grouped by dtype) but list the header's tensors by name, as other writers do:
    JSON key order carries no meaning, so a reader must not assume the header follows the data."""
    save_file(tensors, path, metadata={"format": "pt"})
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header = {"__metadata__": header.pop("__metadata__"), **dict(sorted(header.items()))}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def rearranged_base(src: Path, out: Path) -> Path:
    """``src``'s tensors in two shards split by layer, norms in fp32 and listed by name (so a shard's header order
    is not its storage order) and a stray copy of one tensor in the shard the index does not assign it to."""
    tensors = load_checkpoint(src)
    tensors = {n: t.float() if "norm" in n else t for n, t in tensors.items()}
    parts = {
        "a.safetensors": {n: t for n, t in tensors.items() if ".layers.1." not in n},
        "b.safetensors": {n: t for n, t in tensors.items() if ".layers.1." in n},
    }
    weight_map = {n: file for file, part in parts.items() for n in part}
    stray = "model.layers.1.input_layernorm.weight"
    parts["a.safetensors"][stray] = torch.zeros_like(tensors[stray])
    out.mkdir()
    for file, part in parts.items():
        save_with_names_sorted(part, out / file)
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for side in ("config.json", "chat_template.jinja", "tokenizer_config.json"):
        (out / side).write_bytes((src / side).read_bytes())
    return out


def fp8_reference(src: Path, out: Path, picked: dict[str, torch.dtype], block: int = 128) -> Path:
    """An FP8 checkpoint of ``src``'s architecture quantizing only ``picked`` (name -> scale dtype) in ``block``-sized
    square blocks, in one file."""
    tensors = load_checkpoint(src)
    for name, scale_dtype in picked.items():
        rows, cols = tensors[name].shape
        tensors[name] = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(-(-rows // block), -(-cols // block), dtype=scale_dtype)
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text("official template")
    return out


def assert_same_folder(separate: Path, fused: Path, paths: dict[str, str]) -> None:
    """Same files; every shard byte-identical (checked tensor by tensor first, for a readable failure); side files
    identical except the folder paths a record names, which are mapped through ``paths``."""
    assert sorted(p.name for p in fused.iterdir()) == sorted(p.name for p in separate.iterdir())
    for path in sorted(separate.iterdir()):
        other = fused / path.name
        if path.suffix == ".safetensors":
            expected, got = load_file(path), load_file(other)
            assert list(got) == list(expected), path.name
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
                assert torch.equal(bits(got[name]), bits(tensor)), name
            assert other.read_bytes() == path.read_bytes(), path.name
        elif path.name.endswith("_info.json"):
            record = json.loads(path.read_text())
            record = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in record.items()}
            assert json.loads(other.read_text()) == record, path.name
        else:
            assert other.read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("case", ["auto-partial-blocks", "reference-subset"])
def test_one_pass_writes_exactly_what_merge_then_fp8_writes(tiny_checkpoint, tmp_path, monkeypatch, case):
    # 128-row chunks: every weight is streamed in several chunks, the last one partial where rows % 128 != 0.
    monkeypatch.setattr(safetensors_io, "CHUNK_ELEMENTS", 128 * 128)
    intermediate = 320 if case == "auto-partial-blocks" else 384
    peft_model = peft_lora(qwen3_model(intermediate=intermediate))
    adapter = lora_state_dict(peft_model)
    base = rearranged_base(tiny_checkpoint(dtype=torch.bfloat16, intermediate=intermediate), tmp_path / "base")
    reference = None
    if case == "reference-subset":
        # Layer 1's MLP has no adapter: quantized straight from the base. k_proj is merged but the reference keeps it.
        # The fp32 scale shares the reference's one shard with the fp32 norms: their header order must match too.
        adapter = {k: v for k, v in adapter.items() if ".layers.1.mlp." not in k}
        picked = {
            "model.layers.0.self_attn.q_proj.weight": torch.bfloat16,
            "model.layers.0.mlp.up_proj.weight": torch.float32,
            "model.layers.1.mlp.down_proj.weight": torch.bfloat16,
            "model.layers.1.self_attn.o_proj.weight": torch.bfloat16,
        }
        reference = fp8_reference(base, tmp_path / "ref", picked)
    # else: MLP dims of 320 are merged but stay BF16; attention is merged and quantized; norms (fp32) are copied.
    save_file(adapter, tmp_path / "lora.safetensors")
    lora = tmp_path / "lora.safetensors"

    merge_info = merge_lora(base, lora, tmp_path / "merged", r=8, alpha=16)
    fp8_info = export_fp8(tmp_path / "merged", tmp_path / "fp8", reference_dir=reference)
    fused_merge, fused_fp8 = merge_and_export_fp8(
        base, lora, tmp_path / "one-bf16", tmp_path / "one-fp8", r=8, alpha=16, reference_dir=reference
    )

    merged_path, one_path = str((tmp_path / "merged").resolve()), str((tmp_path / "one-bf16").resolve())
    assert_same_folder(tmp_path / "merged", tmp_path / "one-bf16", {})
    assert_same_folder(tmp_path / "fp8", tmp_path / "one-fp8", {merged_path: one_path})
    assert fused_merge == replace(merge_info, out_dir=one_path)
    assert fused_fp8 == replace(fp8_info, src=one_path, out_dir=str((tmp_path / "one-fp8").resolve()))
    # The comparison is not vacuous: weights were merged, some quantized, and FP8 equals a whole-tensor quantization.
    merged = load_checkpoint(tmp_path / "one-bf16")
    fp8 = load_checkpoint(tmp_path / "one-fp8")
    assert fused_fp8.quantized and fused_merge.merged_modules
    for name in fused_fp8.quantized:
        q, scale = quantize_blockwise(merged[name])
        assert torch.equal(bits(fp8[name]), bits(q)) and torch.equal(fp8[name + "_scale_inv"], scale), name
    original = load_checkpoint(base)
    assert not torch.equal(
        merged["model.layers.0.self_attn.k_proj.weight"], original["model.layers.0.self_attn.k_proj.weight"]
    )
    if case == "reference-subset":
        assert torch.equal(
            merged["model.layers.1.mlp.down_proj.weight"], original["model.layers.1.mlp.down_proj.weight"]
        )
        assert "model.layers.1.mlp.down_proj.weight" in fused_fp8.quantized
        assert (tmp_path / "one-fp8" / "chat_template.jinja").read_text() == "official template"
    else:
        assert "model.layers.0.mlp.down_proj.weight" in fused_fp8.copied
        assert fp8["model.layers.0.input_layernorm.weight"].dtype == torch.float32


def test_one_pass_refuses_before_writing_anything(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    save_file(lora_state_dict(peft_lora(qwen3_model())), tmp_path / "lora.safetensors")
    lora = tmp_path / "lora.safetensors"
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "keep.txt").write_text("earlier export")

    with pytest.raises(ExportError, match="not empty"):
        merge_and_export_fp8(base, lora, tmp_path / "bf16", tmp_path / "fp8", r=8, alpha=16)
    # Also on the two-step route a reference with other block heights takes: checked before the merge runs.
    odd = fp8_reference(base, tmp_path / "odd", {"model.layers.0.self_attn.q_proj.weight": torch.bfloat16}, block=96)
    with pytest.raises(ExportError, match="not empty"):
        merge_and_export_fp8(base, lora, tmp_path / "bf16", tmp_path / "fp8", r=8, alpha=16, reference_dir=odd)
    shutil.rmtree(odd)
    with pytest.raises(ExportError, match="different output folders"):
        merge_and_export_fp8(base, lora, tmp_path / "both", tmp_path / "both", r=8, alpha=16)
    # A reference naming a tensor the base lacks is refused at planning time, before either folder is staged.
    reference = fp8_reference(base, tmp_path / "ref", {"model.layers.0.self_attn.q_proj.weight": torch.bfloat16})
    tensors = load_file(reference / "model.safetensors")
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    tensors["model.layers.9.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1, dtype=torch.bfloat16)
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        merge_and_export_fp8(base, lora, tmp_path / "bf16", tmp_path / "out", r=8, alpha=16, reference_dir=reference)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "lora.safetensors", "ref"]
    assert [p.name for p in (tmp_path / "fp8").iterdir()] == ["keep.txt"]


def test_a_reference_whose_blocks_do_not_tile_the_row_chunks_runs_the_two_steps(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    save_file(lora_state_dict(peft_lora(qwen3_model())), tmp_path / "lora.safetensors")
    lora = tmp_path / "lora.safetensors"
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    picked = dict.fromkeys(names, torch.bfloat16)
    reference = fp8_reference(base, tmp_path / "ref", picked, block=96)  # 96-row blocks straddle 128-row chunks

    merge_lora(base, lora, tmp_path / "merged", r=8, alpha=16)
    export_fp8(tmp_path / "merged", tmp_path / "fp8", reference_dir=reference)
    _, info = merge_and_export_fp8(
        base, lora, tmp_path / "one-bf16", tmp_path / "one-fp8", r=8, alpha=16, reference_dir=reference
    )

    assert info.quantized == sorted(picked)
    assert_same_folder(tmp_path / "merged", tmp_path / "one-bf16", {})
    merged_path, one_path = str((tmp_path / "merged").resolve()), str((tmp_path / "one-bf16").resolve())
    assert_same_folder(tmp_path / "fp8", tmp_path / "one-fp8", {merged_path: one_path})


def test_a_weight_failing_to_quantize_aborts_both_outputs(tiny_checkpoint, tmp_path):
    tensors = load_checkpoint(tiny_checkpoint(dtype=torch.bfloat16))
    tensors["model.layers.1.self_attn.o_proj.weight"][200, 3] = float("nan")
    base = tmp_path / "base"
    base.mkdir()
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    (base / "config.json").write_bytes((tiny_checkpoint(dtype=torch.bfloat16) / "config.json").read_bytes())
    save_file(lora_state_dict(peft_lora(qwen3_model())), tmp_path / "lora.safetensors")
    threads = threading.active_count()

    # The NaN is found on the FP8 worker thread, after the merged rows before it were written.
    with pytest.raises(ExportError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight.*NaN"):
        merge_and_export_fp8(base, tmp_path / "lora.safetensors", tmp_path / "bf16", tmp_path / "fp8", r=8, alpha=16)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "lora.safetensors"]
    assert threading.active_count() == threads
