"""Block-wise FP8: the e4m3 error bound, partial blocks, the export format transformers loads, reference layouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mass_ops.export import ExportError, dequantize_blockwise, export_fp8, merge_lora, quantize_blockwise, verify_fp8
from tests.support.export import lora_state_dict, peft_lora, qwen3_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def naive_block_amax(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per-block max|w| by explicit loops over (possibly partial) blocks: an independent reference."""
    rows, cols = w.shape
    out = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max()
    return out


def expand(scale: torch.Tensor, shape: tuple[int, int], block: int = 128) -> torch.Tensor:
    return scale.float().repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


@pytest.mark.parametrize("shape", [(256, 384), (200, 333), (130, 128), (1, 5)])
def test_quantize_dequantize_error_is_within_the_e4m3_bound(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=generator)
    # Blocks of very different magnitude (as real weights have), and one all-zero block.
    w *= torch.logspace(-4, 2, shape[1]).unsqueeze(0)
    w[:128, :128] = 0
    w = w.to(torch.bfloat16).float()

    q, scale = quantize_blockwise(w)
    deq = dequantize_blockwise(q, scale)

    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (
        math.ceil(shape[0] / 128),
        math.ceil(shape[1] / 128),
    )
    amax = naive_block_amax(w)
    assert torch.equal(scale, (amax.clamp(min=1e-12) / 448).to(torch.bfloat16))
    # e4m3 has 3 mantissa bits: normal values round within 2^-4 relative, subnormals (< 2^-6) within 2^-10 absolute;
    # dequantising with the bf16-rounded scale (≤ 2^-9 off the fp32 one used to divide) adds 2^-9·|q·scale|; the
    # small slack covers the fp32 division that precedes the rounding.
    s = expand(scale, w.shape)
    bound = ((2**-4 + 2**-8) * w.abs() + s * 2**-10) * (1 + 2**-20)
    assert ((w - deq).abs() <= bound).all()
    # Per block: never worse than amax/15, and the all-zero block comes back exactly.
    assert ((w - deq).abs() <= expand(amax, w.shape) / 15 * (1 + 2**-20) + 1e-30).all()
    assert not deq[:128, :128].any()


def test_values_on_the_fp8_grid_round_trip_exactly():
    generator = torch.Generator().manual_seed(7)
    q = (torch.rand(256, 200, generator=generator) * 896 - 448).to(torch.float8_e4m3fn)
    q[::128, ::128] = 448.0  # each block's amax is exactly 448·scale
    scale = torch.tensor([[2.0**-8, 3.0 * 2**-12], [0.5, 1.0]], dtype=torch.bfloat16)

    q2, scale2 = quantize_blockwise(dequantize_blockwise(q, scale))

    assert torch.equal(scale2, scale)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_refuses_non_finite_weights(dtype, bad):
    w = torch.ones(128, 256, dtype=dtype)
    w[3, 200] = bad
    with pytest.raises(ExportError, match="NaN"):
        quantize_blockwise(w)


def spec_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """MASS_SPEC §9 written out block by block: amax over the block's own elements clamped ≥ 1e-12, scale = amax/448
    in fp32, q = e4m3(clamp(w/scale, ±448)) with that fp32 scale, the scale then stored as bf16."""
    x = w.float()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block), dtype=torch.bfloat16)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale = torch.clamp(tile.abs().max(), min=1e-12) / torch.tensor(448.0, dtype=torch.float32)
            assert scale.dtype == torch.float32
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = torch.clamp(tile / scale, -448, 448).to(
                torch.float8_e4m3fn
            )
            scales[i, j] = scale.to(torch.bfloat16)
    return q, scales


def divided_by_stored_scale(w: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """The other reading of the formula (divide by the bf16 number stored): what the spec rules out."""
    return torch.clamp(w.float() / expand(stored, w.shape), -448, 448).to(torch.float8_e4m3fn)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", [(384, 512), (200, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantization_is_byte_for_byte_the_spec_formula(shape, dtype):
    generator = torch.Generator().manual_seed(3)
    # Magnitudes from 1e-9 (e4m3 subnormals and zeros after scaling) to 1e3, signed zeros and an all-zero block.
    w = torch.randn(shape, generator=generator) * torch.logspace(-9, 3, shape[1]).unsqueeze(0)
    w[:, 7] = -0.0
    w[128:, 128:256] = 0
    # Blocks whose amax/448 lies far from a bf16 value (a bf16 scale 2^-9 off): there dividing by the fp32 or by the
    # bf16-rounded scale gives different FP8 bytes.
    w[:128, :128] = torch.randn(128, 128, generator=generator)
    w[0, 0] = 448 * (1 + 3 * 2**-9)
    w = w.to(dtype)

    q, scale = quantize_blockwise(w)  # BF16 of whole blocks takes the bit-pattern amax; the others the fp32 route
    expected_q, expected_scale = spec_quantize(w)

    assert scale.dtype == torch.bfloat16 and torch.equal(scale, expected_scale)
    assert torch.equal(bits(q), bits(expected_q))
    # The test tells the two readings apart: the fp32 scale differs from the bf16 one stored, and so do the bytes.
    fp32_scale = naive_block_amax(w.float()).clamp(min=1e-12) / 448
    assert (fp32_scale != scale.float()).any()
    assert not torch.equal(bits(divided_by_stored_scale(w, scale)), bits(expected_q))


def test_scales_are_bf16_whatever_the_input_dtype():
    w = torch.randn(256, 128, dtype=torch.float16)
    q, scale = quantize_blockwise(w)
    assert scale.dtype == torch.bfloat16 and torch.equal(bits(q), bits(spec_quantize(w)[0]))


def test_e4m3_conversion_rounds_quotients_below_464_to_448():
    """The clamp-free path relies on this: 480 would be the next e4m3 step, and float8_e4m3fn has no 480."""
    x = torch.tensor([448.0, 449.75, 463.9, 464.0, -450.0, -463.9])
    assert x.to(torch.float8_e4m3fn).float().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]


def test_export_is_loaded_by_transformers_which_generates(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(dtype=torch.bfloat16)
    info = export_fp8(src, tmp_path / "fp8")
    out = tmp_path / "fp8"

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    source, exported = load_checkpoint(src), load_checkpoint(out)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(exported)
    assert sorted(set(weight_map.values())) == sorted(p.name for p in src.glob("*.safetensors"))
    assert len(info.quantized) == 2 * len(LINEARS)
    for name, tensor in source.items():
        if name in info.quantized:
            q, scale = quantize_blockwise(tensor)  # the whole-tensor result; export streams row chunks
            assert exported[name].dtype == torch.float8_e4m3fn
            assert torch.equal(exported[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(exported[name + "_scale_inv"], scale), name
            assert weight_map[name] == weight_map[name + "_scale_inv"]
        else:  # embeddings, lm_head, norms
            assert any(k in name for k in ("embed_tokens", "lm_head", "norm")), name
            assert torch.equal(exported[name], tensor), name
    assert (out / "chat_template.jinja").read_bytes() == (src / "chat_template.jinja").read_bytes()
    record = json.loads((out / "quant_info.json").read_text())
    assert record["quantized"] == info.quantized and record["copied"] == info.copied and record["ref"] is None

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    reference = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    params = dict(model.named_parameters())
    for name in info.quantized:
        expected = dequantize_blockwise(exported[name], exported[name + "_scale_inv"], dtype=params[name].dtype)
        assert torch.equal(params[name].detach(), expected), name
    input_ids = torch.tensor([[1, 17, 42, 99, 5]])
    with torch.no_grad():
        logits, ref_logits = model(input_ids).logits.float(), reference(input_ids).logits.float()
        generated = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 9) and torch.equal(generated[:, :5], input_ids)
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 0.1


def test_partial_blocks_stay_bf16_by_default_and_follow_a_reference(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(dtype=torch.bfloat16, intermediate=320)  # MLP dims 320: not whole 128-blocks
    info = export_fp8(src, tmp_path / "auto")

    assert all(("mlp." in n) == (n in info.copied) for n in load_checkpoint(src) if any(k in n for k in LINEARS))
    skip = json.loads((tmp_path / "auto" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.gate_proj" in skip and "model.layers.0.self_attn.q_proj" not in skip

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "auto", device_map="cpu")
    assert model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False).shape == (1, 5)

    # A reference that does quantize a partial-block weight is followed, with a ceil-divided scale grid.
    ref = tmp_path / "ref"
    ref.mkdir()
    tensors = load_checkpoint(src)
    name = "model.layers.0.mlp.down_proj.weight"  # [256, 320]
    tensors[name] = torch.zeros(256, 320, dtype=torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones(2, 3, dtype=torch.bfloat16)
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (ref / "config.json").write_text(json.dumps(config))

    info = export_fp8(src, tmp_path / "with-ref", reference_dir=ref)

    assert info.quantized == [name]
    exported = load_file(tmp_path / "with-ref" / "model.safetensors")
    w = load_checkpoint(src)[name].float()
    deq = dequantize_blockwise(exported[name], exported[name + "_scale_inv"])
    assert exported[name + "_scale_inv"].shape == (2, 3)
    assert ((w - deq).abs() <= w.abs() * 2**-4 + 2**-10 * w.abs().max() / 448).all()


def test_reference_selection_and_layout_are_mirrored_scales_always_bf16(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(dtype=torch.bfloat16)
    source = load_checkpoint(src)
    picked = {
        "model.layers.0.self_attn.q_proj.weight": torch.bfloat16,
        "model.layers.1.mlp.down_proj.weight": torch.float32,
    }
    # Hand-made reference: two shards split differently from the source, a subset quantized, one scale in fp32.
    ref = tmp_path / "ref"
    ref.mkdir()
    layer0 = {n: t for n, t in source.items() if ".layers.1." not in n}
    rest = {n: t for n, t in source.items() if n not in layer0}
    for part in (layer0, rest):
        for name in [n for n in part if n in picked]:
            rows, cols = part[name].shape
            part[name] = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
            part[name + "_scale_inv"] = torch.ones(rows // 128, cols // 128, dtype=picked[name])
    files = {"ref-a.safetensors": layer0, "ref-b.safetensors": rest}
    for file, part in files.items():
        save_file(part, ref / file, metadata={"format": "pt"})
    weight_map = {n: f for f, part in files.items() for n in part}
    (ref / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (ref / "config.json").write_text(json.dumps(config))
    (ref / "chat_template.jinja").write_text("official template")

    info = export_fp8(src, tmp_path / "fp8", reference_dir=ref)

    out = tmp_path / "fp8"
    assert info.quantized == sorted(picked)
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(files)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == weight_map
    exported = load_checkpoint(out)
    for name in picked:  # the fp32 reference scale too: MASS_SPEC §9 stores bf16 whatever the reference keeps
        q, scale = spec_quantize(source[name])
        assert torch.equal(exported[name].view(torch.uint8), q.view(torch.uint8))
        assert exported[name + "_scale_inv"].dtype == torch.bfloat16
        assert torch.equal(exported[name + "_scale_inv"], scale)
    assert torch.equal(
        exported["model.layers.0.self_attn.k_proj.weight"], source["model.layers.0.self_attn.k_proj.weight"]
    )
    assert json.loads((out / "config.json").read_text()) == config
    assert (out / "chat_template.jinja").read_text() == "official template"
    assert json.loads((out / "quant_info.json").read_text())["ref"] == str(ref.resolve())

    # A reference that names a tensor the source lacks is refused without writing anything.
    extra = {
        "model.layers.5.mlp.up_proj.weight": torch.zeros(128, 128, dtype=torch.float8_e4m3fn),
        "model.layers.5.mlp.up_proj.weight_scale_inv": torch.ones(1, 1, dtype=torch.bfloat16),
    }
    save_file(extra, ref / "ref-c.safetensors", metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(extra, "ref-c.safetensors"))
    (ref / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ExportError, match=r"model\.layers\.5\.mlp\.up_proj\.weight"):
        export_fp8(src, tmp_path / "fp8-bad", reference_dir=ref)
    assert not (tmp_path / "fp8-bad").exists()


def test_verify_reports_error_and_identical_bytes(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(dtype=torch.bfloat16)
    export_fp8(src, tmp_path / "fp8")

    report = verify_fp8(src, tmp_path / "fp8")

    assert len(report.tensors) == 2 * len(LINEARS)
    assert report.identical_fp8_share == 1.0 and report.identical_scale_share == 1.0
    assert 0 < report.max_rel_error <= 2**-4
    assert all(0 < t.mean_rel_error < t.max_rel_error for t in report.tensors)

    # Against a different BF16 parent (LoRA-merged) the bytes mostly differ and the error grows.
    save_file(lora_state_dict(peft_lora(qwen3_model())), tmp_path / "lora.safetensors")
    merge_lora(src, tmp_path / "lora.safetensors", tmp_path / "merged", r=8, alpha=16)
    other = verify_fp8(tmp_path / "merged", tmp_path / "fp8", max_tensors=3)
    assert len(other.tensors) == 3
    assert other.identical_fp8_share < 0.5 and other.max_rel_error > report.max_rel_error


def test_export_refuses_populated_output_and_truncated_shards(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(dtype=torch.bfloat16)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="not empty"):
        export_fp8(src, tmp_path / "fp8")

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in src.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ExportError, match=shard.name):
        export_fp8(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
