"""From the cycle config to a training run: the `TrainArgs` file and the launcher command.

The paper preset keeps 3 windows per optimizer step whatever the GPU count (`training.replicas` ranks ×
`training.grad_accum`); a node runs `replicas / nnodes` ranks, one GPU each. On Kubernetes the node rank comes from an
indexed Job's `JOB_COMPLETION_INDEX` and the master is pod 0 behind the training job's headless Service.
"""

from __future__ import annotations

from pathlib import Path

from mass_ops.config import CycleConfig
from mass_ops.train.args import TrainArgs
from mass_ops.train.launch import build_launch_command

ARGS_FILE = "train_args.json"
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"


def train_args_for(
    config: CycleConfig,
    *,
    model_dir: str | Path,
    train_data: str | Path,
    val_data: str | Path | None,
    out_dir: str | Path,
    accelerator: str = "auto",
    resume_from: str | Path | None = None,
) -> TrainArgs:
    """The TrainArgs of this cycle: every knob from `config.training`, paths from the caller."""
    t = config.training
    return TrainArgs(
        model_dir=str(model_dir),
        train_data=str(train_data),
        val_data=str(val_data) if val_data is not None else None,
        out_dir=str(out_dir),
        steps=t.steps,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        min_lr_ratio=t.min_lr_ratio,
        lora_r=t.lora_r,
        lora_alpha=t.lora_alpha,
        lora_dropout=t.lora_dropout,
        target_modules=list(t.lora_target_modules),
        grad_accum=t.grad_accum,
        ce_chunk=t.ce_chunk,
        seed=t.seed,
        sampler=t.sampler,
        p_orch=t.p_orch,
        save_every=t.save_every,
        val_every=t.val_every,
        val_at_start=t.val_at_start,
        autocast_bf16=t.autocast_bf16,
        gradient_checkpointing=t.gradient_checkpointing,
        accelerator=accelerator,  # type: ignore[arg-type]
        resume_from=str(resume_from) if resume_from is not None else None,
    )


def training_command_for(
    config: CycleConfig,
    args_path: str | Path = ARGS_FILE,
    *,
    master_addr: str | None = None,
    python: str = "python",
) -> list[str]:
    """The launcher argv for the configured topology (torchrun; multi-node reads the node rank from the env)."""
    t = config.training
    master = master_addr or ("127.0.0.1" if t.nnodes == 1 else f"{config.cycle_name.lower()}-train-0.train-headless")
    return build_launch_command(
        args_path,
        nproc_per_node=t.ranks_per_node,
        nnodes=t.nnodes,
        node_rank_env=NODE_RANK_ENV,
        master_addr=master,
        python=python,
    )
