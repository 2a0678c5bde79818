"""Padding-free packing on a tiny random Qwen3: a packed step equals the unpacked one (per-token losses and LoRA
gradients), attention cannot cross windows, shapes are fixed, and a model whose linear-attention layers cannot see
the boundaries is refused with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mass_ops.train.args import TrainArgs
from mass_ops.train.packing import (
    PackingError,
    block_causal_mask,
    model_inputs,
    pack_windows,
    packing_enabled,
    plan_packs,
    window_losses,
)

CHUNK = 16
VOCAB = 512


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3ForCausalLM with a 512-token vocabulary (the real 152k vocabulary costs seconds per step here)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("small-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def windows() -> list[dict]:
    """Three windows of different lengths, each with a masked prefix."""
    rng = np.random.default_rng(7)
    out = []
    for n, masked in ((37, 10), (53, 20), (29, 5)):
        ids = rng.integers(0, VOCAB, n).tolist()
        out.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return out


def test_first_fit_keeps_order_and_gives_a_long_window_its_own_pack() -> None:
    assert plan_packs([30, 50, 20, 60, 10], 100) == [[0, 1, 2], [3, 4]]
    assert plan_packs([120, 10], 100) == [[0], [1]]
    with pytest.raises(ValueError, match="positive"):
        plan_packs([1], 0)


def test_packed_batches_have_one_shape_and_positions_restart() -> None:
    batch = pack_windows([np.arange(3), np.arange(10, 14)], 10, pad_id=0)
    assert batch.tokens == 10 and batch.pad == 3 and batch.spans == ((0, 3), (3, 7))
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 10]
    mask = block_causal_mask(batch)[0, 0]
    assert mask.shape == (10, 10)
    assert mask[4, 3] and not mask[4, 2] and not mask[3, 4] and not mask[8, 6]  # own window, causal, no crossing
    assert pack_windows([np.arange(12)], 10, pad_id=0).tokens == 12  # a longer window is not cut


def _lora_model(model_dir: Path, attention: str):
    import torch

    from mass_ops.train.trainer import build_lora_model

    args = TrainArgs(
        model_dir=str(model_dir),
        train_data="t",
        out_dir="o",
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        zero3_init=False,
        autocast_bf16=False,
        gradient_checkpointing=False,
        attention=attention,  # type: ignore[arg-type]
    )
    model, head, _, _ = build_lora_model(args, {})
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if ".lora_B." in name:  # B starts at zero, which would leave every lora_A gradient zero
            param.data.normal_(0.0, 0.02)
    return model.float().train(), head.float()


def _step(model, head, windows: list[dict], *, packed: bool, attention: str, mask: bool = True):
    """Per-token losses of every window and the LoRA gradients of one step (mean of per-window token means)."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    ids = [np.asarray(w["input_ids"]) for w in windows]
    labels = [np.asarray(w["labels"]) for w in windows]
    if packed:
        batch = pack_windows(ids, sum(len(i) for i in ids) + 17, pad_id=0)  # a padded tail too
        kwargs = model_inputs(batch, attention, device="cpu", dtype=torch.float32)
        if not mask:
            kwargs.pop("attention_mask")
            kwargs["position_ids"] = torch.arange(batch.tokens)[None]  # nothing marks the boundaries
        hidden = model(**kwargs).logits
        losses = window_losses(hidden, batch, labels, head, chunk=CHUNK, recompute=True)
        slices = [hidden[0, a:b] for a, b in batch.spans]
    else:
        from mass_ops.train.loss import chunked_next_token_loss

        losses, slices = [], []
        for i, lab in zip(ids, labels, strict=True):
            hidden = model(input_ids=torch.from_numpy(i)[None], use_cache=False).logits
            losses.append(chunked_next_token_loss(hidden, torch.from_numpy(lab), head, chunk=CHUNK))
            slices.append(hidden[0])
    total = sum(s / c for s, c in losses) / len(losses)
    total.backward()
    per_token = [
        F.cross_entropy(h[:-1].detach() @ head.T, torch.from_numpy(lab[1:]).long(), reduction="none")
        for h, lab in zip(slices, labels, strict=True)
    ]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return per_token, grads, float(total.detach())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_step_equals_the_unpacked_step(small_qwen3: Path, windows: list[dict], attention: str) -> None:
    import torch

    model, head = _lora_model(small_qwen3, attention)
    tokens_a, grads_a, loss_a = _step(model, head, windows, packed=False, attention=attention)
    tokens_b, grads_b, loss_b = _step(model, head, windows, packed=True, attention=attention)
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for a, b in zip(tokens_a, tokens_b, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 28
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-6), name
    assert all(bool(g.abs().sum() > 0) for g in grads_a.values())  # every adapter tensor has a gradient to compare


def test_without_boundaries_windows_would_leak(small_qwen3: Path, windows: list[dict]) -> None:
    """The control: the same packed batch with one causal sequence (no boundaries) changes the later windows."""
    model, head = _lora_model(small_qwen3, "sdpa")
    tokens_a, _, _ = _step(model, head, windows, packed=False, attention="sdpa")
    tokens_b, _, _ = _step(model, head, windows, packed=True, attention="sdpa", mask=False)
    assert float((tokens_a[0] - tokens_b[0]).abs().max()) < 1e-4  # the first window sees nothing before it
    assert float((tokens_a[2] - tokens_b[2]).abs().max()) > 1e-2


def test_linear_attention_that_ignores_boundaries_is_refused_in_one_line() -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1000,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_num_value_heads=2,
        linear_value_head_dim=16,
    )
    model = Qwen3_5ForCausalLM(config)
    # On this machine transformers has no flash-linear-attention kernels: the layer cannot keep windows apart.
    with pytest.raises(PackingError, match="Qwen3_5GatedDeltaNet") as raised:
        packing_enabled(model, "on", grad_accum=3)
    assert "\n" not in str(raised.value)
    assert packing_enabled(model, "auto", grad_accum=3) is False  # auto falls back to one window per micro-batch
    assert packing_enabled(model, "off", grad_accum=3) is False


def test_auto_packs_only_when_a_rank_has_several_windows(small_qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(small_qwen3))
    assert packing_enabled(model, "auto", grad_accum=1) is False
    assert packing_enabled(model, "auto", grad_accum=3) is True
    assert packing_enabled(model, "on", grad_accum=1) is True
    assert TrainArgs(model_dir="m", train_data="t", out_dir="o", packing="on").packing == "on"
