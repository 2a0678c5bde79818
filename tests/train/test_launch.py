"""Launch topology (batch geometry, torchrun / deepspeed command lines, multi-node by environment) and TrainArgs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mass_ops.train.args import PAPER_TARGET_MODULES, TrainArgs, TrainArgsError
from mass_ops.train.launch import (
    TRAINER_MODULE,
    LaunchError,
    build_launch_command,
    fit_data_parallel,
    render_hostfile,
    windows_per_step,
)


def test_windows_per_step_and_fitting_a_fixed_batch_to_the_gpus() -> None:
    assert windows_per_step(3, 1) == 3 and windows_per_step(8, 4) == 32
    # The paper keeps 3 windows per step whatever the GPU count.
    assert fit_data_parallel(3, 8) == (3, 1)
    assert fit_data_parallel(3, 2) == (1, 3)
    assert fit_data_parallel(3, 1) == (1, 3)
    assert fit_data_parallel(16, 8) == (8, 2)
    assert fit_data_parallel(6, 4) == (3, 2)
    for target, gpus in ((3, 8), (12, 5), (7, 3)):
        ranks, accum = fit_data_parallel(target, gpus)
        assert windows_per_step(ranks, accum) == target and ranks <= gpus
    with pytest.raises(LaunchError):
        windows_per_step(0, 1)
    with pytest.raises(LaunchError):
        fit_data_parallel(3, 0)


def test_single_node_torchrun_command_parses_with_torchruns_own_parser() -> None:
    from torch.distributed.run import get_args_parser

    argv = build_launch_command("/runs/a/args.json", nproc_per_node=8, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(argv[3:])
    assert parsed.standalone and parsed.nproc_per_node == "8" and parsed.nnodes == "1"
    assert parsed.module and parsed.training_script == TRAINER_MODULE
    assert parsed.training_script_args == ["--args", "/runs/a/args.json"]


def _fake_python(tmp_path: Path) -> str:
    """An 'interpreter' that prints the argv it was given as JSON, to see what the shell expanded."""
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return str(fake)


def _run_script(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    assert argv[:2] == ["sh", "-c"]
    return subprocess.run(argv, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, check=False)


def test_multi_node_torchrun_takes_the_node_rank_from_the_environment(tmp_path: Path) -> None:
    from torch.distributed.run import get_args_parser

    argv = build_launch_command(
        "/data/args with space.json",
        nproc_per_node=8,
        nnodes=4,
        node_rank_env="JOB_COMPLETION_INDEX",
        master_addr="train-0.train-headless",
        master_port=29400,
        python=_fake_python(tmp_path),
    )
    done = _run_script(argv, {"JOB_COMPLETION_INDEX": "3"})
    assert done.returncode == 0, done.stderr
    expanded = json.loads(done.stdout)
    assert expanded[:2] == ["-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(expanded[2:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.node_rank) == ("4", "8", 3)
    assert (parsed.master_addr, parsed.master_port) == ("train-0.train-headless", 29400)
    assert parsed.training_script_args == ["--args", "/data/args with space.json"]

    unset = _run_script(argv, {})
    assert unset.returncode != 0 and "JOB_COMPLETION_INDEX must hold the node rank" in unset.stderr


def test_deepspeed_launcher_commands(tmp_path: Path) -> None:
    from deepspeed.launcher.runner import parse_args

    single = build_launch_command("a.json", nproc_per_node=2, launcher="deepspeed", python="py", master_port=29511)
    parsed = parse_args(single[3:])
    assert single[:3] == ["py", "-m", "deepspeed.launcher.runner"]
    assert (parsed.num_gpus, parsed.master_port, parsed.module, parsed.no_local_rank) == (2, 29511, True, True)
    assert parsed.user_script == TRAINER_MODULE and parsed.user_args == ["--args", "a.json"]

    with pytest.raises(LaunchError, match="hostfile"):
        build_launch_command("a.json", nproc_per_node=8, nnodes=2, launcher="deepspeed")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(render_hostfile(["train-0.svc", "train-1.svc"], 8))
    assert hostfile.read_text() == "train-0.svc slots=8\ntrain-1.svc slots=8\n"
    multi = build_launch_command(
        "a.json",
        nproc_per_node=8,
        nnodes=2,
        launcher="deepspeed",
        hostfile=hostfile,
        master_addr="train-0.svc",
        python=_fake_python(tmp_path),
    )
    done = _run_script(multi, {"NODE_RANK": "1"})
    assert done.returncode == 0, done.stderr
    parsed = parse_args(json.loads(done.stdout)[2:])
    assert (parsed.no_ssh, parsed.node_rank, parsed.num_nodes, parsed.num_gpus) == (True, 1, 2, 8)
    assert parsed.hostfile == str(hostfile) and parsed.master_addr == "train-0.svc"


def test_bad_topologies_are_refused() -> None:
    with pytest.raises(LaunchError, match="must be positive"):
        build_launch_command("a.json", nproc_per_node=0)
    with pytest.raises(LaunchError, match="environment variable name"):
        build_launch_command("a.json", nproc_per_node=8, nnodes=2, node_rank_env="$(rm -rf /)")
    with pytest.raises(LaunchError, match="TCP port"):
        build_launch_command("a.json", nproc_per_node=8, master_port=70000)
    with pytest.raises(LaunchError, match="launcher must be"):
        build_launch_command("a.json", nproc_per_node=8, launcher="mpirun")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------------
# TrainArgs: the file the launched processes read


def test_defaults_are_the_paper_constants() -> None:
    args = TrainArgs(model_dir="m", train_data="t", out_dir="o")
    assert (args.steps, args.lr, args.warmup_steps, args.min_lr_ratio) == (1624, 3e-5, 5, 0.1)
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_scale) == (64, 128, 0.05, 2.0)
    assert (args.save_every, args.val_every, args.grad_accum, args.ce_chunk, args.seed) == (50, 150, 1, 512, 1234)
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay, args.max_grad_norm) == (
        0.9,
        0.95,
        1e-8,
        0.0,
        1.0,
    )
    assert args.p_orch == pytest.approx(1 / 3) and args.sampler == "task_role" and args.val_at_start
    assert args.zero_stage == 3 and args.zero3_init and args.autocast_bf16 and args.gradient_checkpointing


def test_target_modules_adapt_only_the_language_model() -> None:
    names = {
        "model.layers.0.self_attn.q_proj": True,
        "model.layers.11.mlp.down_proj": True,
        "model.language_model.layers.3.linear_attn.in_proj_qkv": True,
        "model.language_model.layers.3.linear_attn.out_proj": True,
        "model.visual.blocks.0.attn.qkv": False,
        "model.visual.blocks.0.mlp.down_proj": False,
        "model.layers.0.self_attn.q_norm": False,
        "lm_head": False,
    }
    default = TrainArgs(model_dir="m", train_data="t", out_dir="o").target_pattern()
    listed = TrainArgs(
        model_dir="m",
        train_data="t",
        out_dir="o",
        lora_target_modules=["q_proj", "down_proj", "in_proj_qkv", "out_proj"],
    ).target_pattern()
    for name, adapted in names.items():
        assert bool(re.fullmatch(default, name)) is adapted, name
        assert bool(re.fullmatch(listed, name)) is adapted, name
    # The reference's own regex (Qwen3.5/3.6 layout) is accepted as is.
    paper = TrainArgs(model_dir="m", train_data="t", out_dir="o", lora_target_regex=PAPER_TARGET_MODULES)
    assert re.fullmatch(paper.target_pattern(), "model.language_model.layers.3.mlp.up_proj")
    assert not re.fullmatch(paper.target_pattern(), "model.visual.blocks.0.mlp.linear_fc1")


def test_args_round_trip_through_json(tmp_path: Path) -> None:
    args = TrainArgs(
        model_dir="m",
        train_data="t",
        out_dir="o",
        val_data="v",
        steps=30,
        lora_target_modules=["q_proj"],
        deepspeed_overrides={"zero_optimization": {"reduce_bucket_size": 5}},
    )
    path = args.write(tmp_path / "args.json")
    assert TrainArgs.read(path) == args
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, "steps: Input should be greater than 0 (got 0)"),
        ({"steps": True}, "steps: Input should be a valid integer (got True)"),
        ({"lr": -1.0}, "lr: Input should be greater than 0"),
        ({"lr": 1.0}, "lr: Input should be less than 1"),  # the config's rule, now the only one
        ({"lr": float("nan")}, "lr: Input should be greater than 0 (got nan)"),
        ({"warmup_steps": 10, "steps": 10}, "warmup_steps: 10 must be below steps (10)"),
        ({"p_orch": 1.5}, "p_orch: Input should be less than or equal to 1"),
        ({"lora_dropout": 1.0}, "lora_dropout: Input should be less than 1"),
        ({"zero_stage": 2}, "zero_stage: Input should be 3"),
        ({"sampler": "condition"}, "sampler: Input should be 'task_role'"),
        ({"lora_target_regex": "(["}, "lora_target_regex: not a valid regex"),
        ({"target_modules": "(["}, "lora_target_regex: not a valid regex"),  # an old file's key
        ({"lora_target_modules": ["q_proj", "a.b"]}, "lora_target_modules: ['a.b'] are not module names"),
        ({"lora_target_modules": []}, "lora_target_modules: must name at least one module"),
        ({"deepspeed_overrides": {"bf16": {"enabled": False}}}, "deepspeed_overrides: keys ['bf16']"),
        ({"gradient_checkpointing": "some"}, "Input should be 'full', 'selective' or 'off'"),
        ({"attention": "flash"}, "attention: Input should be 'auto', 'sdpa', 'eager' or 'flash_attention_2'"),
        ({"packing": "yes"}, "packing: Input should be 'auto', 'on' or 'off'"),
        ({"pack_tokens": 0}, "pack_tokens: Input should be greater than 0"),
        ({"warmup_measure_steps": -1}, "warmup_measure_steps: Input should be greater than or equal to 0"),
        ({"zero3_persistence_threshold": 1.5}, "zero3_persistence_threshold: Input should be a valid integer"),
        ({"adam_beta2": 1.0}, "adam_beta2: Input should be less than 1"),
        ({"adam_eps": float("inf")}, "adam_eps: Input should be a finite number"),
        ({"max_grad_norm": -1.0}, "max_grad_norm: Input should be greater than or equal to 0"),
        ({"dist_timeout_s": 0}, "dist_timeout_s: Input should be greater than 0"),
        ({"accelerator": "tpu"}, "accelerator: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"model_dir": ""}, "model_dir: String should have at least 1 character"),
    ],
)
def test_bad_args_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(TrainArgsError, match=re.escape(message)):
        TrainArgs(**{"model_dir": "m", "train_data": "t", "out_dir": "o", **change})


def test_args_files_with_unknown_or_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"model_dir": "m", "train_data": "t", "out_dir": "o", "stpes": 3}))
    with pytest.raises(TrainArgsError, match=r"args\.json: unknown keys \['stpes'\]"):
        TrainArgs.read(path)
    path.write_text(json.dumps({"model_dir": "m"}))
    with pytest.raises(TrainArgsError, match=r"missing keys \['out_dir', 'train_data'\]"):
        TrainArgs.read(path)
    path.write_text("{")
    with pytest.raises(TrainArgsError, match="not valid JSON"):
        TrainArgs.read(path)


def test_the_throughput_knobs_travel_from_the_config_to_the_args() -> None:
    from mass_ops.config import load_config
    from mass_ops.train.plan import train_args_for

    config = load_config("paper")
    args = train_args_for(config, model_dir="m", train_data="t", val_data=None, out_dir="o")
    t = config.training
    assert (args.attention, args.packing, args.pack_tokens) == (t.attention, t.packing, t.pack_tokens)
    assert (args.warmup_measure_steps, args.zero3_overlap_comm, args.zero3_prefetch_bucket_size) == (
        t.warmup_measure_steps,
        t.zero3_overlap_comm,
        t.zero3_prefetch_bucket_size,
    )
    assert args.zero3_persistence_threshold == t.zero3_persistence_threshold
    assert args.checkpointing == "full"  # 49k-token windows: recompute every layer
    assert TrainArgs(model_dir="m", train_data="t", out_dir="o", gradient_checkpointing=False).checkpointing == "off"


def test_an_args_file_written_before_the_shared_names_still_reads(tmp_path: Path) -> None:
    old = {
        "model_dir": "m",
        "train_data": "t",
        "out_dir": "o",
        "target_modules": ["q_proj", "v_proj"],
        "attn_implementation": "sdpa",
        "gradient_checkpointing": True,
        "peak_tflops_per_gpu": None,
    }
    path = tmp_path / "args.json"
    path.write_text(json.dumps(old))
    args = TrainArgs.read(path)
    assert (args.lora_target_modules, args.attention, args.checkpointing) == (["q_proj", "v_proj"], "sdpa", "full")
    assert args.peak_tflops_per_gpu is None and args.lora_target_regex is None
    path.write_text(json.dumps({**old, "target_modules": PAPER_TARGET_MODULES}))
    assert TrainArgs.read(path).target_pattern() == PAPER_TARGET_MODULES


def test_every_trainer_setting_is_defined_once_and_documented() -> None:
    from mass_ops.config import TrainerSettings, TrainingConfig

    shared = set(TrainerSettings.model_fields)
    assert shared <= set(TrainingConfig.model_fields) and shared <= set(TrainArgs.model_fields)
    job_local = {"model_dir", "train_data", "val_data", "out_dir", "accelerator", "resume_from", "lora_target_regex"}
    assert set(TrainArgs.model_fields) - shared == job_local
    for name, field in TrainArgs.model_fields.items():
        assert field.description and len(field.description) > 20, f"{name} has no help text"


def test_the_trainer_settings_travel_from_the_config_to_the_args() -> None:
    from mass_ops.config import read_config_source, validate_config
    from mass_ops.train.plan import train_args_for

    changes = {
        "adam_beta1": 0.8,
        "adam_beta2": 0.98,
        "adam_eps": 1e-6,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,
        "zero3_init": False,
        "dist_timeout_s": 600,
        "deepspeed_overrides": {"zero_optimization": {"reduce_bucket_size": 5}},
        "lr": 1e-4,
        "lora_target_modules": ["q_proj"],
        "attention": "eager",
    }
    data = read_config_source("paper")
    data["training"].update(changes)
    config = validate_config(data)
    args = train_args_for(config, model_dir="m", train_data="t", val_data=None, out_dir="o")
    assert {key: getattr(args, key) for key in changes} == changes


def test_the_paper_preset_trains_with_the_reference_constants() -> None:
    from mass_ops.config import load_config
    from mass_ops.train.plan import train_args_for

    args = train_args_for(load_config("paper"), model_dir="m", train_data="t", val_data="v", out_dir="o")
    reference = {  # MASS_SPEC §1 train, §2 training, §8 optimizer and schedule
        "steps": 1624,
        "lr": 3e-5,
        "warmup_steps": 5,
        "min_lr_ratio": 0.1,
        "lora_r": 64,
        "lora_alpha": 128,
        "lora_dropout": 0.05,
        "save_every": 50,
        "val_every": 150,
        "grad_accum": 1,
        "ce_chunk": 512,
        "seed": 1234,
        "sampler": "task_role",
        "val_at_start": True,
        "autocast_bf16": True,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
    }
    assert {key: getattr(args, key) for key in reference} == reference
    assert args.p_orch == pytest.approx(1 / 3)
