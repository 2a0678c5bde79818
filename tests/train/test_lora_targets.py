"""Which modules the paper preset's LoRA adapts, on real transformers architectures built on the meta device.

The reference (MASS_SPEC §8) adapts every module matching its regex on `Qwen3_5ForConditionalGeneration`: attention,
MLP and linear-attention projections of the language model, never the vision tower. The installed transformers has
the hybrid Qwen3.5 classes, so the models here are the real module trees (tiny sizes, no weights allocated).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from mass_ops.config import DEFAULT_LORA_TARGETS, load_config
from mass_ops.train.args import TrainArgs
from mass_ops.train.lora_targets import (
    REFERENCE_TARGET_MODULES,
    REFERENCE_TARGET_PATTERN,
    LoraTargetError,
    lora_target_pattern,
    summarize_lora_targets,
)

try:  # the stage layer is being moved: training_plan.py -> train/plan.py
    from mass_ops.train.plan import train_args_for
except ImportError:  # pragma: no cover - before the move lands
    from mass_ops.training_plan import train_args_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 8 decoder layers, full attention every 4th (the Qwen3.5/3.6 rhythm): 6 linear-attention + 2 full-attention layers.
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2


def _small_text(config: Any) -> Any:
    config.num_hidden_layers = len(LAYER_TYPES)
    config.layer_types = list(LAYER_TYPES)
    config.hidden_size, config.intermediate_size = 64, 128
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    config.linear_num_key_heads, config.linear_num_value_heads = 2, 4
    config.linear_key_head_dim = config.linear_value_head_dim = 8
    config.vocab_size = 256
    return config


def qwen3_5_multimodal() -> Any:
    config = transformers.Qwen3_5Config()
    _small_text(config.text_config)
    vision = config.vision_config
    vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 2, 32, 64, 2
    vision.out_hidden_size = 64
    with torch.device("meta"):
        return transformers.Qwen3_5ForConditionalGeneration(config)


def qwen3_5_text_only() -> Any:
    with torch.device("meta"):
        return transformers.Qwen3_5ForCausalLM(_small_text(transformers.Qwen3_5TextConfig()))


def qwen3_dense() -> Any:
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    with torch.device("meta"):
        return transformers.Qwen3ForCausalLM(config)


def linear_names(model: Any) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def matched(model: Any, pattern: str) -> set[str]:
    return {name for name in linear_names(model) if re.fullmatch(pattern, name)}


def paper_pattern(preset: str = "paper") -> str:
    config = load_config(preset)
    return train_args_for(config, model_dir="m", train_data="t", val_data=None, out_dir="o").target_pattern()


@pytest.mark.parametrize("preset", ["paper", "cycle2"])
def test_paper_presets_adapt_exactly_the_reference_set_on_qwen3_5(preset: str) -> None:
    model = qwen3_5_multimodal()
    reference = matched(model, REFERENCE_TARGET_PATTERN)
    ours = matched(model, paper_pattern(preset))
    print(f"{preset}: reference regex adapts {len(reference)} Linear modules, the preset's pattern {len(ours)}")
    assert len(reference) == 50  # 6 × (in_proj_qkv, in_proj_z, out_proj + MLP) + 2 × (q, k, v, o + MLP)
    assert ours == reference
    assert not any(".visual." in name for name in ours)


def test_text_only_qwen3_family_models_adapt_the_same_projections() -> None:
    hybrid = qwen3_5_text_only()
    ours = matched(hybrid, paper_pattern())
    # The same 50 projections as the multimodal model, under `model.layers` instead of `model.language_model.layers`.
    multimodal = matched(qwen3_5_multimodal(), REFERENCE_TARGET_PATTERN)
    expected = {name.replace("model.language_model.", "model.") for name in multimodal}
    assert ours == expected and len(ours) == 50
    dense = qwen3_dense()
    assert matched(dense, paper_pattern()) == {n for n in linear_names(dense) if n != "lm_head"}


def test_vision_towers_and_mtp_heads_never_match() -> None:
    pattern = lora_target_pattern()
    for name in (
        "model.visual.blocks.0.attn.qkv",
        "model.visual.blocks.0.mlp.down_proj",
        "model.visual.merger.linear_fc1",
        "mtp.layers.0.self_attn.q_proj",
        "mtp.layers.0.mlp.gate_proj",
        "model.mtp.layers.0.mlp.up_proj",
        "lm_head",
        "model.language_model.layers.0.linear_attn.in_proj_a",
        "model.language_model.layers.0.linear_attn.in_proj_b",
    ):
        assert not re.fullmatch(pattern, name), name


def test_summary_counts_modules_by_kind_and_adapter_parameters() -> None:
    model = qwen3_5_multimodal()
    summary = summarize_lora_targets(model, paper_pattern(), lora_r=64)
    print(summary.describe())
    assert summary.modules == 50 and summary.lora_tensors == 100
    assert summary.by_kind == {
        "q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 8, "up_proj": 8, "down_proj": 8,
        "in_proj_qkv": 6, "in_proj_z": 6, "out_proj": 6,
    }  # fmt: skip
    assert list(summary.by_kind) == list(REFERENCE_TARGET_MODULES)
    expected = sum(
        64 * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if name in matched(model, REFERENCE_TARGET_PATTERN)
    )
    assert summary.adapter_parameters == expected
    assert summary.linear_not_adapted == {"in_proj_a": 6, "in_proj_b": 6, "lm_head": 1, "visual": 10}
    assert summary.linear_modules == summary.modules + sum(summary.linear_not_adapted.values())
    # PEFT itself creates exactly the tensors and parameters the summary announces.
    peft = pytest.importorskip("peft")
    with torch.device("meta"):
        adapted = peft.get_peft_model(
            model, peft.LoraConfig(r=64, lora_alpha=128, target_modules=summary.pattern, bias="none")
        )
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    assert len(trainable) == summary.lora_tensors
    assert sum(p.numel() for p in trainable) == summary.adapter_parameters


def test_a_pattern_that_matches_a_non_linear_module_is_refused() -> None:
    with pytest.raises(LoraTargetError, match="not a Linear"):
        summarize_lora_targets(qwen3_5_multimodal(), r".*layers\.0\.linear_attn\.conv1d$", lora_r=8)
    summary = summarize_lora_targets(qwen3_5_multimodal(), r"nothing\.here", lora_r=8)
    assert summary.modules == 0 and summary.adapter_parameters == 0


def test_config_defaults_and_train_args_name_the_reference_projections() -> None:
    assert set(DEFAULT_LORA_TARGETS) == {
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        *("in_proj_qkv", "in_proj_z", "out_proj"),  # MASS_SPEC §8: the linear-attention projections too
    }
    assert TrainArgs(model_dir="m", train_data="t", out_dir="o").target_pattern() == lora_target_pattern()
    with pytest.raises(LoraTargetError):
        lora_target_pattern([])
