"""The export stage refuses, before writing anything, an FP8 model vLLM could not load at the configured TP size."""

from __future__ import annotations

from pathlib import Path

import pytest

from mass_ops.export import ExportError
from mass_ops.stages.api import export, render
from mass_ops.store.model_folders import read_manifest
from tests.stages.test_post_training import hand_made_training, seed_cycle


@pytest.fixture(scope="module")
def tiny_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded profile's tiny Qwen3 (hidden 128, MLP 384, 2 layers, bf16)."""
    from mass_ops.models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("parent") / "L0-bf16")


def test_export_refuses_an_fp8_model_that_does_not_split_over_the_tensor_parallel_gpus(
    tmp_path: Path, tiny_parent: Path
) -> None:
    # The tiny parent's MLP is 384 wide: 192 columns per GPU on 2 GPUs, not whole 128-wide FP8 blocks.
    cycle = seed_cycle(tmp_path, tiny_parent, "inference.tensor_parallel_size=2")
    render(cycle.config)
    hand_made_training(cycle, {0: 2.0, 2: 1.4})
    with pytest.raises(ExportError, match=r"tensor_parallel_size 2 .*down_proj\.weight 384 input columns / 2 = 192"):
        export(cycle.config)
    assert read_manifest(cycle.ctx.artifacts, "models/L1-bf16") is None
    assert read_manifest(cycle.ctx.artifacts, "models/L1-fp8") is None
