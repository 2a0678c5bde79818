"""A tiny random-weight Qwen3-architecture model for the embedded profile (laptop, CI).

It has the real Qwen3 tokenizer, vocabulary and chat template, so every stage that touches a model — `transformers
serve` behind qwen-code, rendering, LoRA training, merge and FP8 export — runs the production code paths on CPU in
seconds. The weights are random: its outputs are noise, which the scripted test policy replaces where content matters.

Every projection dimension is a multiple of 128 so block-wise FP8 quantization (128×128 blocks) applies unchanged.
Embeddings are tied to the LM head, which keeps the real 151 936-row vocabulary at about 20 M parameters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mass_ops.errors import InputError
from mass_ops.models.tokenizer import ensure_qwen3_tokenizer, tokenizer_files

MANIFEST_NAME = "mass_tiny_model.json"
# Rows of Qwen3's embedding matrix: the tokenizer's 151 669 ids padded to a multiple of 128, as in released Qwen3.
QWEN3_VOCAB_SIZE = 151936
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
PAD_TOKEN_ID = 151643
_FP8_BLOCK = 128
_DTYPES = ("bfloat16", "float16", "float32")
# The weights and files that make a saved model directory complete.
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors")


class TinyModelError(InputError):
    """The requested tiny model cannot be built, or a different one already occupies the directory."""


def build_tiny_qwen3(
    out_dir: Path | str,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int = 384,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_position_embeddings: int = 262144,
    runtime_dir: Path | str | None = None,
) -> Path:
    """Write a random-weight `Qwen3ForCausalLM` with the real Qwen3 tokenizer to `out_dir` and return it.

    Idempotent: a complete model built with the same arguments is left untouched; a complete model built with other
    arguments raises `TinyModelError` rather than being overwritten. The directory appears atomically (staging
    folder renamed into place). `runtime_dir` locates the tokenizer install (see `ensure_qwen3_tokenizer`).
    """
    spec = {
        "architecture": "Qwen3ForCausalLM",
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "intermediate_size": intermediate_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seed": seed,
        "dtype": dtype,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": QWEN3_VOCAB_SIZE,
    }
    _check_spec(spec)
    target = Path(out_dir).expanduser().resolve()
    existing = _read_manifest(target)
    if existing is not None:
        if existing.get("spec") != spec:
            raise TinyModelError(
                f"{target} already holds a tiny model built with {existing.get('spec')}; requested {spec} "
                "(use another directory)"
            )
        return target
    if target.exists() and any(target.iterdir()):
        raise TinyModelError(f"{target} exists, is not empty and holds no complete tiny model: refusing to overwrite")

    tokenizer_dir = ensure_qwen3_tokenizer(runtime_dir)
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    n_params = _save_random_model(staging, spec)
    for path in tokenizer_files(tokenizer_dir):
        shutil.copyfile(path, staging / path.name)
    manifest = {"spec": spec, "n_parameters": n_params, "tokenizer": str(tokenizer_dir.name)}
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in staging.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; servers and training pods may run as another user
    if target.exists():
        target.rmdir()  # empty (checked above); rename needs the name free
    staging.rename(target)
    return target


def _check_spec(spec: dict[str, Any]) -> None:
    problems = []
    for name in ("hidden_size", "intermediate_size"):
        if spec[name] <= 0 or spec[name] % _FP8_BLOCK:
            problems.append(f"{name}={spec[name]} must be a positive multiple of {_FP8_BLOCK} (FP8 blocks)")
    for name in ("num_layers", "heads", "kv_heads", "head_dim", "max_position_embeddings"):
        if spec[name] <= 0:
            problems.append(f"{name}={spec[name]} must be positive")
    if spec["kv_heads"] > 0 and spec["heads"] % spec["kv_heads"]:
        problems.append(f"heads={spec['heads']} must be a multiple of kv_heads={spec['kv_heads']}")
    for name, width in (
        ("heads×head_dim", spec["heads"] * spec["head_dim"]),
        ("kv_heads×head_dim", spec["kv_heads"] * spec["head_dim"]),
    ):
        if width % _FP8_BLOCK:
            problems.append(f"{name}={width} must be a multiple of {_FP8_BLOCK} (FP8 blocks)")
    if spec["dtype"] not in _DTYPES:
        problems.append(f"dtype={spec['dtype']!r} must be one of {', '.join(_DTYPES)}")
    if problems:
        raise TinyModelError("tiny Qwen3 spec rejected: " + "; ".join(problems))


def _read_manifest(target: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((target / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not all((target / name).is_file() for name in _REQUIRED_FILES):
        return None
    return manifest


def _save_random_model(out: Path, spec: dict[str, Any]) -> int:
    """Initialise the model in float32 from `seed`, cast to the requested dtype, save safetensors + configs."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        use_cache=True,
    )
    torch.manual_seed(spec["seed"])
    model = Qwen3ForCausalLM(config)
    model = model.to(getattr(torch, spec["dtype"]))
    model.config.dtype = spec["dtype"]
    # Sampling defaults of the released Qwen3 thinking models, so `transformers serve` behaves like the real thing.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=[EOS_TOKEN_ID, BOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    )
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())
