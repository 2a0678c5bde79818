"""Tiny random Qwen3 models, their sharded safetensors checkpoints and PEFT adapters, for the export tests (and the
vLLM contract test); `tests/export/conftest.py` builds its session fixture from them."""

from __future__ import annotations

import re
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def qwen3_model(*, hidden: int = 256, intermediate: int = 384, head_dim: int = 64, seed: int = 0):
    """A 2-layer Qwen3 with random weights, in fp32, on CPU (vocab 1024, 4 heads, 2 KV heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # The default init leaves norms at exactly 1.0; random values make a byte-for-byte copy check meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def save_checkpoint(model, out_dir: Path, dtype: torch.dtype) -> Path:
    """Save ``model`` in ``dtype`` as several small shards plus the side files a real release carries."""
    model.to(dtype).save_pretrained(out_dir, max_shard_size="400KB")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out_dir / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    assert len(list(out_dir.glob("*.safetensors"))) >= 2, "fixture must produce a sharded checkpoint"
    return out_dir


def peft_lora(model, *, r: int = 8, alpha: int = 16, seed: int = 1):
    """Wrap ``model`` in a PEFT LoRA on every attention/MLP projection, with non-zero B so the merge matters."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none")
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def lora_state_dict(peft_model, *, fsdp_wrapped: bool = False) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT names with the ``.default`` adapter name, as a training checkpoint stores them."""
    tensors = {k: v.detach().clone().float() for k, v in peft_model.state_dict().items() if ".lora_" in k}
    if fsdp_wrapped:  # how FSDP-1 names parameters of wrapped decoder layers
        tensors = {re.sub(r"(\.layers\.\d+)\.", r"\1._fsdp_wrapped_module.", k): v for k, v in tensors.items()}
    return tensors
