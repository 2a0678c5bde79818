"""Launch topology of a training run as data: batch geometry and the launcher command line.

One process per GPU (one data-parallel ZeRO-3 rank each). Multi-node runs start the same command on every node;
the node's rank comes from an environment variable read when the command starts (for a Kubernetes indexed Job:
`JOB_COMPLETION_INDEX`; torchrun itself also honours `PET_NODE_RANK`, which a Kubeflow TrainJob sets), and the
master address is node 0's stable DNS name (e.g. `<job>-0.<headless service>`). The command therefore holds no
per-node values and one pod template serves every node.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from mass_ops.errors import InputError

TRAINER_MODULE = "mass_ops.train.trainer"
DEFAULT_MASTER_PORT = 29500
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LaunchError(InputError):
    """A launch topology that cannot run; the message names the parameter and why."""


def windows_per_step(ranks: int, grad_accum: int) -> int:
    """Windows averaged by one optimizer step: one window per rank per micro-step."""
    if ranks <= 0 or grad_accum <= 0:
        raise LaunchError(f"ranks ({ranks}) and grad_accum ({grad_accum}) must be positive")
    return ranks * grad_accum


def fit_data_parallel(target_windows_per_step: int, max_ranks: int) -> tuple[int, int]:
    """(ranks, grad_accum) with ranks × grad_accum == target and the most ranks ≤ max_ranks.

    This is how a preset keeps its batch whatever the GPU count: the paper's 3 windows per step become 3 ranks × 1
    on ≥3 GPUs, or 1 rank × 3 micro-steps on 1–2 GPUs.
    """
    if target_windows_per_step <= 0 or max_ranks <= 0:
        raise LaunchError(
            f"windows per step ({target_windows_per_step}) and available ranks ({max_ranks}) must be positive"
        )
    ranks = max(r for r in range(1, min(target_windows_per_step, max_ranks) + 1) if target_windows_per_step % r == 0)
    return ranks, target_windows_per_step // ranks


def render_hostfile(hosts: Sequence[str], slots: int) -> str:
    """A DeepSpeed hostfile (`host slots=N` per line), needed by the deepspeed launcher for multi-node runs."""
    if not hosts or slots <= 0:
        raise LaunchError("a hostfile needs at least one host and a positive slot count")
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def build_launch_command(
    args_path: str | Path,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank_env: str = "NODE_RANK",
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_MASTER_PORT,
    launcher: Literal["torchrun", "deepspeed"] = "torchrun",
    python: str = "python",
    hostfile: str | Path | None = None,
) -> list[str]:
    """The argv that starts `python -m mass_ops.train.trainer --args <args_path>` on one node.

    Single node: a plain argv (torchrun `--standalone`, or the deepspeed runner on localhost). Several nodes: an
    `sh -c` argv whose script expands `$<node_rank_env>` when the container starts and fails fast when it is unset.
    The deepspeed launcher needs `hostfile` (see `render_hostfile`) for several nodes and runs with `--no_ssh`.
    """
    if nproc_per_node <= 0 or nnodes <= 0:
        raise LaunchError(f"nproc_per_node ({nproc_per_node}) and nnodes ({nnodes}) must be positive")
    if not 0 < master_port < 65536:
        raise LaunchError(f"master_port must be a TCP port (got {master_port})")
    if nnodes > 1 and not _ENV_NAME.match(node_rank_env):
        raise LaunchError(f"node_rank_env must be an environment variable name (got {node_rank_env!r})")
    if nnodes > 1 and not master_addr:
        raise LaunchError("master_addr is required for a multi-node launch")
    trainer = ["--args", str(args_path)]
    node_rank = f'"${{{node_rank_env}:?{node_rank_env} must hold the node rank}}"'

    if launcher == "torchrun":
        head = [python, "-m", "torch.distributed.run"]
        if nnodes == 1:
            return [
                *head,
                "--standalone",
                "--nnodes=1",
                f"--nproc_per_node={nproc_per_node}",
                "-m",
                TRAINER_MODULE,
                *trainer,
            ]
        fixed = [*head, f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}"]
        tail = [f"--master_addr={master_addr}", f"--master_port={master_port}", "-m", TRAINER_MODULE, *trainer]
        return ["sh", "-c", _script(fixed, "--node_rank=", node_rank, tail)]

    if launcher == "deepspeed":
        head = [python, "-m", "deepspeed.launcher.runner"]
        common = ["--no_local_rank", "--module", TRAINER_MODULE, *trainer]
        if nnodes == 1:
            return [*head, f"--num_gpus={nproc_per_node}", f"--master_port={master_port}", *common]
        if hostfile is None:
            raise LaunchError("the deepspeed launcher needs a hostfile for a multi-node launch")
        fixed = [*head, f"--hostfile={hostfile}", "--no_ssh", f"--num_nodes={nnodes}", f"--num_gpus={nproc_per_node}"]
        tail = [f"--master_addr={master_addr}", f"--master_port={master_port}", *common]
        return ["sh", "-c", _script(fixed, "--node_rank=", node_rank, tail)]

    raise LaunchError(f"launcher must be 'torchrun' or 'deepspeed' (got {launcher!r})")


def _script(fixed: list[str], flag: str, expansion: str, tail: list[str]) -> str:
    """`exec <fixed> <flag><expansion> <tail>`: every literal shell-quoted, only the node-rank expansion live."""
    return " ".join(["exec", shlex.join(fixed), flag + expansion, shlex.join(tail)])
