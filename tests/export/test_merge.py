"""LoRA merge: equal to PEFT's own merge_and_unload, streaming shard by shard, strict about bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mass_ops.export import ExportError, merge_lora, read_adapter
from tests.support.export import TARGETS, lora_state_dict, peft_lora, qwen3_model


def load_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, read with the reference safetensors library (not ours)."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize(
    ("hidden", "intermediate", "head_dim", "fsdp_wrapped"),
    [(256, 384, 64, False), (192, 320, 48, True)],
    ids=["multiple-of-128", "odd-dims-fsdp-keys"],
)
def test_fp32_merge_equals_peft_merge_and_unload(
    tiny_checkpoint, tmp_path, hidden, intermediate, head_dim, fsdp_wrapped
):
    base = tiny_checkpoint(dtype=torch.float32, hidden=hidden, intermediate=intermediate, head_dim=head_dim)
    peft_model = peft_lora(qwen3_model(hidden=hidden, intermediate=intermediate, head_dim=head_dim))
    lora_file = tmp_path / "lora_state_dict.safetensors"
    save_file(lora_state_dict(peft_model, fsdp_wrapped=fsdp_wrapped), lora_file)

    info = merge_lora(base, lora_file, tmp_path / "merged", r=8, alpha=16)

    expected = {k: v.detach() for k, v in peft_model.merge_and_unload().state_dict().items()}
    merged = load_checkpoint(tmp_path / "merged")
    original = load_checkpoint(base)
    assert set(merged) == set(expected) == set(original)
    for name, tensor in merged.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6, msg=name)
        targeted = any(f".{t}." in name for t in TARGETS)
        # Untouched tensors are copied byte for byte; targeted ones really changed.
        assert torch.equal(tensor, original[name]) != targeted, name
    assert len(info.merged_modules) == 2 * len(TARGETS)
    assert info.scale == 2.0


def test_merge_keeps_layout_side_files_and_writes_merge_info(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.float32)
    peft_model = peft_lora(qwen3_model())
    save_file(lora_state_dict(peft_model), tmp_path / "lora.safetensors")

    out = tmp_path / "merged"
    out.mkdir()  # an existing empty folder is acceptable and is replaced atomically
    merge_lora(base, tmp_path / "lora.safetensors", out, r=8, alpha=16)

    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in base.iterdir()), "merge_info.json"])
    for side in ("model.safetensors.index.json", "config.json", "chat_template.jinja", "tokenizer_config.json"):
        assert (out / side).read_bytes() == (base / side).read_bytes(), side
    record = json.loads((out / "merge_info.json").read_text())
    assert record["r"] == 8 and record["alpha"] == 16
    assert record["base"] == str(base.resolve()) and record["lora"].endswith("lora.safetensors")
    assert "model.layers.1.mlp.down_proj" in record["merged_modules"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")], "staging folder left behind"


def test_bf16_merge_sums_in_fp32_and_casts_back(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    peft_model = peft_lora(qwen3_model().to(torch.bfloat16))
    peft_model.save_pretrained(tmp_path / "adapter")  # PEFT adapter folder: r and alpha come from its config

    info = merge_lora(base, tmp_path / "adapter", tmp_path / "merged")

    assert (info.r, info.alpha) == (8, 16.0)
    merged, original = load_checkpoint(tmp_path / "merged"), load_checkpoint(base)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    peft_merged = peft_model.merge_and_unload().state_dict()
    one_ulp = 2.0**-7  # bf16 keeps 8 significant bits
    for module in info.merged_modules:
        name = f"{module}.weight"
        a = adapter[f"base_model.model.{module}.lora_A.weight"].double()
        b = adapter[f"base_model.model.{module}.lora_B.weight"].double()
        exact = original[name].double() + 2.0 * (b @ a)
        got = merged[name]
        assert got.dtype == torch.bfloat16
        # One rounding of the exact sum: within half an ulp, up to fp32 accumulation noise at ties.
        assert ((got.double() - exact).abs() <= exact.abs() * one_ulp * 0.5 + 1e-7).all(), name
        # PEFT rounds the delta to bf16 before adding, so it is only close, not equal.
        torch.testing.assert_close(got, peft_merged[name], rtol=2 * one_ulp, atol=1e-3, msg=name)


def test_missing_module_is_one_line_error_and_writes_nothing(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    tensors = lora_state_dict(peft_lora(qwen3_model()))
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(8, 256)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.default.weight"] = torch.zeros(256, 8)
    save_file(tensors, tmp_path / "lora.safetensors")

    with pytest.raises(ExportError, match=r"model\.layers\.7\.self_attn\.q_proj") as excinfo:
        merge_lora(base, tmp_path / "lora.safetensors", tmp_path / "merged", r=8, alpha=16)
    assert "\n" not in str(excinfo.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "lora.safetensors"]


def test_refuses_a_populated_output_folder(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    save_file(lora_state_dict(peft_lora(qwen3_model())), tmp_path / "lora.safetensors")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("earlier export")

    with pytest.raises(ExportError, match="not empty"):
        merge_lora(base, tmp_path / "lora.safetensors", out, r=8, alpha=16)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    ("mutate", "kwargs", "message"),
    [
        (lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(4)}), {}, "not a LoRA A/B weight"),
        (lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"), {}, "not its partner"),
        (lambda t: None, {"r": 4}, "expected rank 4"),
        (lambda t: None, {"alpha": None}, "needs r and alpha"),
    ],
    ids=["foreign-key", "missing-B", "wrong-rank", "no-alpha"],
)
def test_adapter_file_is_validated(tmp_path, mutate, kwargs, message):
    tensors = lora_state_dict(peft_lora(qwen3_model()))
    mutate(tensors)
    save_file(tensors, tmp_path / "lora.safetensors")
    with pytest.raises(ExportError, match=message):
        read_adapter(tmp_path / "lora.safetensors", **{"r": 8, "alpha": 16, **kwargs})


def test_adapter_folder_config_must_agree(tmp_path):
    peft_lora(qwen3_model()).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ExportError, match="lora_alpha=16"):
        read_adapter(tmp_path / "adapter", alpha=32)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ExportError, match="use_dora"):
        read_adapter(tmp_path / "adapter")


def test_shape_mismatch_names_the_module(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(dtype=torch.bfloat16)
    tensors = lora_state_dict(peft_lora(qwen3_model()))
    tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight"] = torch.zeros(8, 100)
    save_file(tensors, tmp_path / "lora.safetensors")
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.down_proj: base .*\[256, 384\]"):
        merge_lora(base, tmp_path / "lora.safetensors", tmp_path / "merged", r=8, alpha=16)
