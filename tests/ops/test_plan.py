"""`mass-ops plan`: the planned totals of the paper preset, the training command and the resource plan."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.config import load_config
from mass_ops.ops.plan import build_plan, count_checkpoints, count_validations, next_cycle_config
from mass_ops.train.plan import train_args_for, training_command_for

runner = CliRunner()


def _plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_paper_plan_reports_the_reference_totals():
    totals = _plan_json("--config", "paper")["plan"]["totals"]
    assert totals["rhi_episodes"] == 117  # 9 tasks × (1 reference + 12 versions)
    assert totals["collection_episodes"] == 144  # 8 × 18
    assert totals["comparisons_per_ranked_task"] == 54
    assert totals["train_trajectories"] == 120
    assert totals["val_trajectories"] == 8


def test_paper_plan_counts_judge_and_optimizer_calls():
    stages = {s["stage"]: s["counts"] for s in _plan_json("--config", "paper")["plan"]["stages"]}
    assert stages["search"]["baseline_judge_calls"] == 9 * 12
    assert stages["search"]["optimizer_calls"] == 9 * 11
    assert stages["rank"]["self_judge_calls"] == 8 * 54
    assert stages["train"]["windows_per_step"] == 3
    assert stages["train"]["validations"] == 12  # 0, 150, …, 1500, 1624
    assert stages["train"]["checkpoints"] == 33  # 50, …, 1600, 1624


def test_plan_follows_overrides():
    totals = _plan_json("--config", "paper", "--set", "search.iterations=3")["plan"]["totals"]
    assert totals["rhi_episodes"] == 9 * (1 + 4)


def test_plan_prints_the_training_command_in_text_mode():
    result = runner.invoke(app, ["plan", "--config", "paper"])
    assert result.exit_code == 0, result.output
    assert "--nproc_per_node=3" in result.output and "mass_ops.train.trainer" in result.output
    assert "117" in result.output and "144" in result.output


def test_multi_node_launch_reads_the_node_rank_from_the_indexed_job():
    config = load_config(
        "demo",
        ["training.replicas=16", "training.nnodes=2", "training.gpus_per_node=8", "training.steps=20"],
        environ={},
    )
    command = training_command_for(config)
    script = command[-1]
    assert command[:2] == ["sh", "-c"]
    assert "--nnodes=2" in script and "--nproc_per_node=8" in script
    assert "JOB_COMPLETION_INDEX" in script
    plan = build_plan(config, command)
    assert plan.resources.training_gpus == 16 and plan.resources.training_nodes == 2


def test_counting_helpers():
    assert count_validations(10, 4, True) == 4  # 0, 4, 8, 10
    assert count_validations(8, 4, False) == 2
    assert count_checkpoints(10, 5) == 2


def test_bad_config_exits_2_with_one_line_per_problem():
    result = runner.invoke(
        app, ["plan", "--config", "paper", "--set", "search.iterations=0", "--set", "ranking.seed=-1"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "config: search.iterations: Input should be greater than 0 (got 0)",
        "config: ranking.seed: Input should be greater than or equal to 0 (got -1)",
    ]


def test_the_cycle_after_paper_is_cycle2():
    paper = load_config("paper", ["tasks.catalogue=builtin"], environ={})
    cycle2 = load_config("cycle2", ["tasks.catalogue=builtin"], environ={})
    following = next_cycle_config(paper)
    assert following.model_dump(exclude={"preset", "name"}) == cycle2.model_dump(exclude={"preset", "name"})
    assert following.cycle_name == "paper-L1" != paper.cycle_name
    assert next_cycle_config(following).search.seed_base == 2_450_000


def test_plan_next_of_reads_the_frozen_cycle_and_prints_how_to_start_the_next(tmp_path):
    from mass_ops.ops import api as ops

    storage = [f"storage.metadata_url=sqlite:///{tmp_path}/m.db", f"storage.artifact_url={tmp_path}/a"]
    demo = load_config("demo", storage, environ={})
    ops.validate_config(demo)
    args = ["plan", "--config", "demo", *(x for s in storage for x in ("--set", s))]
    result = runner.invoke(app, [*args, "--next-of", demo.cycle_name])
    assert result.exit_code == 0, result.output
    assert f"next cycle of {demo.cycle_name}: demo-L1" in result.output
    assert "--set models.parent_bf16=" in result.output and "--set search.seed_base=" in result.output
    missing = runner.invoke(app, [*args, "--next-of", "no-such-cycle"])
    assert missing.exit_code == 2 and "no cycle of that name" in missing.stderr


def test_plan_names_the_lora_pattern_with_the_linear_attention_projections():
    plan = _plan_json("--config", "paper")["plan"]
    for name in ("q_proj", "down_proj", "in_proj_qkv", "in_proj_z", "out_proj"):
        assert name in plan["lora_target_pattern"]
    assert "LoRA targets:" in runner.invoke(app, ["plan", "--config", "paper"]).output


def test_the_training_args_carry_the_gpu_peak_for_mfu():
    config = load_config("paper", ["training.peak_tflops_per_gpu=756"], environ={})
    args = train_args_for(config, model_dir="model", train_data="train.jsonl", val_data="val.jsonl", out_dir="out")
    assert args.peak_tflops_per_gpu == 756


def test_the_estimate_has_one_line_per_cost_category_of_the_registry_in_its_order():
    """The estimate's lines are what the report sets its actuals beside: the registry's cost categories."""
    from mass_ops.ops.plan import cycle_work
    from mass_ops.stage_registry import COST_CATEGORIES

    config = load_config("paper")
    lines = [work.stage for work in cycle_work(config, build_plan(config, training_command_for(config)))]
    assert lines == [category for category in COST_CATEGORIES if category in lines]
    assert set(COST_CATEGORIES) - set(lines) == {"benchmark"}  # benchmark trials run outside a cycle
    estimate = _plan_json("--config", "paper")["estimate"]
    assert [stage["stage"] for stage in estimate["stages"]] == lines
