"""Fixtures of the export tests: tiny random Qwen3 checkpoints (sharded safetensors), built once per session from
`tests.support.export`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.export import qwen3_model, save_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_checkpoint(dtype=torch.bfloat16, hidden=256, intermediate=384, head_dim=64)`` → folder.

    Built once per argument set per session; callers must not modify the folder.
    """
    built: dict[tuple, Path] = {}

    def build(
        *, dtype: torch.dtype = torch.bfloat16, hidden: int = 256, intermediate: int = 384, head_dim: int = 64
    ) -> Path:
        key = (dtype, hidden, intermediate, head_dim)
        if key not in built:
            out = tmp_path_factory.mktemp(f"qwen3-{hidden}-{intermediate}-{str(dtype).split('.')[-1]}")
            built[key] = save_checkpoint(
                qwen3_model(hidden=hidden, intermediate=intermediate, head_dim=head_dim), out, dtype
            )
        return built[key]

    return build
