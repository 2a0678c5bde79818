"""From the cycle config to a training run: the `TrainArgs` file and the launcher command.

The paper preset keeps 3 windows per optimizer step whatever the GPU count (`training.replicas` ranks ×
`training.grad_accum`); a node runs `replicas / nnodes` ranks, one GPU each. On Kubernetes the node rank comes from
`JOB_COMPLETION_INDEX` (an indexed Job, or the indexed Jobs of a Kubeflow TrainJob's JobSet) and the master address
from the pod's environment: `MASTER_ADDR`, which the indexed Job sets to node 0 behind its headless Service, or
`PET_MASTER_ADDR`, which Kubeflow Trainer's torch runtime sets to node 0 of its JobSet. The names are decided where
the workloads are built (`mass_ops.compute.kubernetes`, Trainer), never guessed here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mass_ops.config import CycleConfig, TrainerSettings
from mass_ops.train.args import TrainArgs
from mass_ops.train.launch import build_launch_command

ARGS_FILE = "train_args.json"
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"
# Where node 0 is, in the order they are read: ours (indexed Job), then Kubeflow Trainer's torch runtime.
MASTER_ADDR_ENVS = ("MASTER_ADDR", "PET_MASTER_ADDR")
# What a multi-node command names when neither variable is set (e.g. `mass-ops plan` off-cluster): printed, it says
# where the address comes from; run, torchrun fails naming it instead of waiting for a master that does not exist.
UNSET_MASTER_ADDR = "$MASTER_ADDR"


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
    """The TrainArgs of this cycle: every trainer setting from `config.training`, paths and machine from the caller."""
    settings = config.training.model_dump(include=set(TrainerSettings.model_fields))
    return TrainArgs(
        **settings,
        model_dir=str(model_dir),
        train_data=str(train_data),
        val_data=str(val_data) if val_data is not None else None,
        out_dir=str(out_dir),
        accelerator=accelerator,  # type: ignore[arg-type]
        resume_from=str(resume_from) if resume_from is not None else None,
    )


def master_address(config: CycleConfig, environ: Mapping[str, str] | None = None) -> str:
    """Node 0's address: loopback on one node; else the first of `MASTER_ADDR_ENVS` set in `environ` (default: this
    process's environment), or `UNSET_MASTER_ADDR` when none is."""
    if config.training.nnodes == 1:
        return "127.0.0.1"
    env = os.environ if environ is None else environ
    return next((env[name] for name in MASTER_ADDR_ENVS if env.get(name)), UNSET_MASTER_ADDR)


def training_command_for(
    config: CycleConfig,
    args_path: str | Path = ARGS_FILE,
    *,
    master_addr: str | None = None,
    python: str = "python",
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The launcher argv for the configured topology (torchrun; multi-node reads the node rank from the env when the
    command starts, and takes the master address from `master_addr`, else from the pod: `master_address`)."""
    t = config.training
    master = master_addr or master_address(config, environ)
    return build_launch_command(
        args_path,
        nproc_per_node=t.ranks_per_node,
        nnodes=t.nnodes,
        node_rank_env=NODE_RANK_ENV,
        master_addr=master,
        python=python,
    )
