"""The FP8 export loads in transformers' fine-grained FP8 loader and computes what its stored numbers say.

transformers reads a `quant_method: fp8` checkpoint with block scales through its FineGrainedFP8 quantizer; on a CPU
it dequantises the weights at load. The reference here is independent of the project's own dequantiser: a BF16 copy
of the source model whose quantized weights are replaced by the exported FP8 values times their block scales
(`weight_scale_inv`, one per 128 x 128 block), computed in this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mass_ops.export import export_fp8
from mass_ops.models.tiny import build_tiny_qwen3

BLOCK_SIDE = 128
TOKENS = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 42]])


def exported_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def by_hand(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 weight x its block's scale, block by block, in float32, then BF16 (what a BF16 model would hold)."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(0, rows, BLOCK_SIDE):
        for j in range(0, cols, BLOCK_SIDE):
            scale = scale_inv[i // BLOCK_SIDE, j // BLOCK_SIDE].float()
            out[i : i + BLOCK_SIDE, j : j + BLOCK_SIDE] = weight[i : i + BLOCK_SIDE, j : j + BLOCK_SIDE].float() * scale
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen3 (BF16) and its FP8 export by the project's exporter."""
    root = tmp_path_factory.mktemp("fp8-load")
    src = build_tiny_qwen3(root / "bf16", seed=3)
    export_fp8(src, root / "fp8")
    return src, root / "fp8"


def test_transformers_fine_grained_fp8_load_matches_hand_dequantised_bf16_logits(exported, monkeypatch):
    from transformers import AutoModelForCausalLM

    src, fp8_dir = exported
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [BLOCK_SIDE, BLOCK_SIDE]

    from transformers.quantizers import quantizer_finegrained_fp8

    # The checkpoint must go through transformers' fine-grained FP8 quantizer (which, on a CPU, dequantises at load):
    # record each one made (its log line is printed once per process, and the model drops it after dequantising).
    made: list[object] = []
    quantizer = quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer
    real_init = quantizer.__init__

    def recording_init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(quantizer, "__init__", recording_init)
    fp8_model = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map="cpu").eval()
    assert len(made) == 1

    stored = exported_tensors(fp8_dir)
    scaled = sorted(name.removesuffix("_scale_inv") for name in stored if name.endswith("_scale_inv"))
    assert len(scaled) == 2 * 7, "every projection of both layers is FP8"
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cpu").eval()
    with torch.no_grad():
        original_logits = reference(TOKENS).logits.float()
        parameters = dict(reference.named_parameters())
        for name in scaled:
            assert stored[name].dtype == torch.float8_e4m3fn, name
            parameters[name].copy_(by_hand(stored[name], stored[name + "_scale_inv"]))
        expected = reference(TOKENS).logits.float()
        got = fp8_model(TOKENS).logits.float()

    assert got.shape == expected.shape == (1, TOKENS.shape[1], fp8_model.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    # Not vacuous: FP8 rounding moved the logits away from the source model's, and the hand copy followed it; yet
    # they stay near the source's (the scales are the right ones, not merely read the same way twice).
    assert not torch.allclose(original_logits, expected, rtol=1e-2, atol=1e-2)
    assert ((expected - original_logits).norm() / original_logits.norm()).item() < 0.1
