"""Per-device choices: the attention implementation and the activation-checkpointing policy, on a tiny Qwen3."""

from __future__ import annotations

import pytest

from mass_ops.train.efficiency import AttentionChoiceError, apply_checkpointing, choose_attention, decoder_layers


def test_auto_attention_is_flash_only_on_cuda_with_the_package() -> None:
    assert choose_attention("auto", "cuda", flash_available=True) == "flash_attention_2"
    assert choose_attention("auto", "cuda", flash_available=False) == "sdpa"
    assert choose_attention("auto", "cpu", flash_available=True) == "sdpa"
    assert choose_attention("eager", "cpu", flash_available=False) == "eager"
    with pytest.raises(AttentionChoiceError, match="the device is cpu") as raised:
        choose_attention("flash_attention_2", "cpu", flash_available=True)
    assert "\n" not in str(raised.value)
    with pytest.raises(AttentionChoiceError, match="flash_attn package is not installed"):
        choose_attention("flash_attention_2", "cuda", flash_available=False)


def _tiny_model(layers: int = 4):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config).train()


@pytest.mark.parametrize(("mode", "expected"), [("full", [True] * 4), ("selective", [True, False] * 2), ("off", [])])
def test_checkpointing_modes_choose_the_layers(mode: str, expected: list[bool]) -> None:
    import torch

    model = _tiny_model()
    assert apply_checkpointing(model, mode) == sum(expected)
    flags = [bool(layer.gradient_checkpointing) for layer in decoder_layers(model)]
    assert flags == (expected or [False] * 4)
    # Checkpointing changes what is kept, never the gradients.
    reference = _tiny_model()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (1, 12))
    for m in (model, reference):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = [(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in grads if a is not None)


def test_an_unknown_checkpointing_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="full, selective or off"):
        apply_checkpointing(_tiny_model(2), "some")
