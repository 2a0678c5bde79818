"""The tiny random Qwen3 model: loadable by transformers, generating, FP8-shaped, built once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mass_ops.models.tiny import MANIFEST_NAME, QWEN3_VOCAB_SIZE, TinyModelError, build_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


def test_loads_and_generates_with_transformers(tiny_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)
    assert out[0, -4:].max().item() < QWEN3_VOCAB_SIZE


def test_size_vocabulary_and_fp8_friendly_shapes(tiny_dir: Path):
    from safetensors import safe_open

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == QWEN3_VOCAB_SIZE
    assert config["tie_word_embeddings"] is True
    manifest = json.loads((tiny_dir / MANIFEST_NAME).read_text())
    assert 18_000_000 < manifest["n_parameters"] < 22_000_000
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as weights:
        projections = [name for name in weights.keys() if name.endswith("_proj.weight")]  # noqa: SIM118
        assert len(projections) == 2 * 7
        for name in projections:
            rows, cols = weights.get_slice(name).get_shape()
            assert rows % 128 == 0 and cols % 128 == 0, name
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_ships_the_real_tokenizer_and_template(tiny_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == 151669
    assert "<think>" in (tiny_dir / "chat_template.jinja").read_text()
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645


def test_building_again_reuses_the_model(tiny_dir: Path):
    weights = tiny_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_qwen3(tiny_dir) == tiny_dir
    assert weights.stat().st_mtime_ns == before
    with pytest.raises(TinyModelError, match="already holds a tiny model"):
        build_tiny_qwen3(tiny_dir, num_layers=3)


def test_bad_shapes_and_foreign_directories_are_refused(tmp_path: Path):
    with pytest.raises(TinyModelError, match="hidden_size=100 must be a positive multiple of 128"):
        build_tiny_qwen3(tmp_path / "a", hidden_size=100)
    with pytest.raises(TinyModelError, match="heads=4 must be a multiple of kv_heads=3"):
        build_tiny_qwen3(tmp_path / "b", kv_heads=3)
    foreign = tmp_path / "c"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(TinyModelError, match="not empty"):
        build_tiny_qwen3(foreign)
