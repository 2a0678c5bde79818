"""An FP8 export must load under the configured tensor parallelism: whole 128-wide blocks on every rank."""

from __future__ import annotations

import pytest

from mass_ops.export import ExportError, export_fp8
from mass_ops.export.tensor_parallel import (
    check_fp8_tensor_parallel,
    quantized_weight_shapes,
    split_problems,
)


def test_column_parallel_weights_split_their_rows_and_row_parallel_their_columns():
    shapes = {
        "m.layers.0.self_attn.q_proj.weight": (512, 256),  # 512 / 2 = 256 rows: fine
        "m.layers.0.self_attn.o_proj.weight": (256, 512),  # input 512 / 2 = 256: fine
        "m.layers.0.mlp.gate_proj.weight": (384, 256),  # 384 / 2 = 192 rows
        "m.layers.0.mlp.down_proj.weight": (256, 384),  # input 384 / 2 = 192
        "m.layers.0.linear_attn.out_proj.weight": (256, 384),  # row-parallel too
    }
    problems = split_problems(shapes, 2)
    assert [(p.name.split(".")[-2], p.dimension) for p in problems] == [
        ("out_proj", "input columns"),
        ("down_proj", "input columns"),
        ("gate_proj", "output rows"),
    ]
    assert (
        problems[1].describe() == "m.layers.0.mlp.down_proj.weight 384 input columns / 2 = 192, not a multiple of 128"
    )
    assert split_problems(shapes, 1) == []


def test_a_size_that_does_not_divide_is_a_problem_and_said_so():
    (problem,) = split_problems({"x.up_proj.weight": (256, 128)}, 3)
    assert problem.describe() == "x.up_proj.weight 256 output rows / 3 = 85.3, not a multiple of 128"


def test_kv_heads_fewer_than_ranks_are_replicated_one_head_per_rank():
    shapes = {"a.self_attn.k_proj.weight": (256, 512), "a.self_attn.v_proj.weight": (256, 512)}
    assert split_problems(shapes, 4, kv_heads=2) == []  # 2 heads of 128 rows, each on 2 ranks
    assert len(split_problems(shapes, 4, kv_heads=4)) == 2  # 4 heads of 64 rows


def test_the_checkpoint_check_names_the_offenders_in_one_line(tiny_checkpoint):
    src = tiny_checkpoint()  # hidden 256, intermediate 384, 4 heads / 2 KV heads of 64
    check_fp8_tensor_parallel(src, 1)
    with pytest.raises(ExportError) as caught:
        check_fp8_tensor_parallel(src, 2)
    message = str(caught.value)
    assert "\n" not in message
    assert "would not load with inference.tensor_parallel_size 2" in message
    assert "model.layers.0.mlp.down_proj.weight 384 input columns / 2 = 192, not a multiple of 128" in message
    assert "and 7 more" in message  # 2 layers × (gate, up, down, k, v) = 10 offenders, 3 shown


def test_a_checkpoint_of_whole_blocks_per_rank_passes(tiny_checkpoint):
    src = tiny_checkpoint(hidden=256, intermediate=512, head_dim=128)  # q 512, kv 256, MLP 512
    for tp in (1, 2, 4):
        check_fp8_tensor_parallel(src, tp)


def test_the_reference_chooses_which_weights_count(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint()
    auto = quantized_weight_shapes(src)
    assert "model.layers.0.mlp.down_proj.weight" in auto
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in auto)
    export_fp8(src, tmp_path / "reference")
    assert quantized_weight_shapes(src, reference_dir=tmp_path / "reference") == auto
