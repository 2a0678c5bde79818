"""Model FLOPs from the architecture, checked against hand computations for one dense and one MoE config."""

from __future__ import annotations

import json

import pytest

from mass_ops.train.flops import ArchitectureError, FlopsModel, flops_model, mfu, read_flops_model, step_throughput

TINY_QWEN3 = {  # the embedded profile's tiny model
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 384,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3_30B_A3B = {  # the released Qwen3-30B-A3B's published shape
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
}


def test_dense_qwen3_by_hand():
    # per layer: q 128·256 + o 256·128 + k 128·128 + v 128·128 = 98 304; MLP 3·128·384 = 147 456
    # N = 2·(98 304 + 147 456) + LM head 151 936·128 = 491 520 + 19 447 808 = 19 939 328
    model = flops_model(TINY_QWEN3)
    assert model.active_params == 19_939_328
    # one 1000-token window: 6·N·T + 12·layers·heads·head_dim·T² = 119 635 968 000 + 6 144 000 000
    assert model.sequence_flops(1000) == 125_779_968_000
    assert model.step_flops([1000, 1000]) == 2 * 125_779_968_000


def test_moe_counts_only_active_experts_by_hand():
    # per layer: attention 2·2048·4096 + 2·2048·512 = 18 874 368; router 2048·128 = 262 144;
    # 8 active experts · 3·2048·768 = 37 748 736 → 56 885 248; × 48 layers = 2 730 491 904; LM head 311 164 928
    model = flops_model(QWEN3_30B_A3B)
    assert model.active_params == 3_041_656_832  # + 0.31 B input embeddings = the published 3.3 B activated
    assert model.attention_layers == 48
    t = 4096
    assert model.sequence_flops(t) == 6 * 3_041_656_832 * t + 12 * 48 * 32 * 128 * t * t


def test_dense_layers_of_a_sparse_model_use_the_dense_mlp():
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "mlp_only_layers": [0]}
    dense_layer = 18_874_368 + 3 * 2048 * 6144
    moe_layer = 18_874_368 + 262_144 + 37_748_736
    assert flops_model(config).active_params == dense_layer + moe_layer + 311_164_928


def test_hybrid_linear_attention_layers_have_no_quadratic_term():
    config = {
        "text_config": {
            **TINY_QWEN3,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 64,
            "linear_num_value_heads": 4,
            "linear_value_head_dim": 64,
        }
    }
    model = flops_model(config)
    assert model.attention_layers == 1
    # linear layer: 128·(2·128 + 2·256) + 128·2·4 + 256·128 = 98 304 + 1 024 + 32 768 = 132 096
    assert model.active_params == 3 * 132_096 + 98_304 + 4 * 147_456 + 19_447_808


def test_mfu_against_the_peak():
    # 989 TFLOP/s peak, 8 GPUs, 3.956e15 FLOPs in 1 s → 0.5
    assert mfu(8 * 989e12 * 0.5, 1.0, 8, 989.0) == pytest.approx(0.5)
    assert mfu(1e12, 1.0, 1, None) is None
    assert mfu(1e12, 0.0, 1, 989.0) is None


def test_a_config_without_the_shape_is_one_clear_error(tmp_path):
    with pytest.raises(ArchitectureError, match="'hidden_size' must be a positive integer"):
        flops_model({"num_hidden_layers": 2})
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    assert read_flops_model(tmp_path).active_params == 19_939_328
    with pytest.raises(ArchitectureError, match="cannot read the model config"):
        read_flops_model(tmp_path / "missing")


def test_step_throughput_of_two_ranks():
    model = flops_model(TINY_QWEN3)
    fields = step_throughput({0: [1000], 1: [600, 400]}, 500, 2.0, model, world_size=2, peak_tflops_per_gpu=989.0)
    assert fields["tokens_per_s"] == 1000.0
    assert fields["tokens_per_s_per_rank"] == [500.0, 500.0]
    assert fields["supervised_tokens_per_s"] == 250.0
    flops = model.sequence_flops(1000) + model.sequence_flops(600) + model.sequence_flops(400)
    assert fields["model_tflops_per_gpu"] == round(flops / 2.0 / 2 / 1e12, 6)
    assert fields["mfu"] == pytest.approx(flops / 2.0 / 2 / 989e12)
    cpu = step_throughput({0: [10]}, 5, 1.0, model, world_size=1, peak_tflops_per_gpu=None)
    assert cpu["mfu"] is None and cpu["tokens_per_s_per_rank"] == [10.0]
    unknown = step_throughput({0: [10]}, 5, 1.0, None, world_size=1, peak_tflops_per_gpu=989.0)
    assert unknown["model_tflops_per_gpu"] is None and unknown["mfu"] is None


def test_nemo_lora_causal_convention_by_hand():
    # N = 1000 frozen, 10 adapter parameters, 2 attention layers × 2 heads × width 4, an 8-token window:
    # frozen 4·1000·8 = 32 000; adapters 6·10·8 = 480; causal attention 6·2·2·4·8² = 6 144 → 38 624.
    # Ours on the same window: 6·1000·8 + 12·2·2·4·8² = 48 000 + 12 288 = 60 288.
    model = FlopsModel(active_params=1000, attention_layers=2, attention_heads=2, head_dim=4)
    assert model.lora_causal_sequence_flops(8, adapter_params=10) == 38_624
    assert model.sequence_flops(8) == 60_288
    assert model.lora_causal_step_flops([8, 8], adapter_params=10) == 2 * 38_624
    fields = step_throughput({0: [8]}, 4, 1e-9, model, world_size=1, peak_tflops_per_gpu=1.0, adapter_params=10)
    assert fields["mfu_lora_causal"] == pytest.approx(38_624 / 1e-9 / 1e12)
    assert fields["mfu"] / fields["mfu_lora_causal"] == pytest.approx(60_288 / 38_624)
