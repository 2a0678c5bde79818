"""Fault matrix: SIGKILL every writing stage at seeded random points, rerun it, count what was lost or duplicated.

Each stage (search steps, collection candidates, rank + select, render, train, export + register, evaluation
rollouts, evaluate) runs as its own process (`python -m tests.hardening.stage_child`) through the stage functions,
against the scripted OpenAI-compatible policy server (`tests.policy_server`, in this process, so every paid call is
counted on the provider's side) with the inner-loop fake executor standing in for qwen-code episodes. The baseline
is a clean run of the same stage from the same saved state; each kill is a trial: restore, start, SIGKILL the
stage's process group at ready + U(0, clean duration), rerun to the end, compare stores (see
`tests/hardening/kill_matrix.py` for what counts as lost, duplicated and repeated).

Prints one line per stage — kills, reruns, units lost, units duplicated, paid calls repeated (and how many of those
had been answered before the kill but not yet recorded), staging files left for `mass-ops store gc`, the clean
run's working seconds — then the totals and the ledger's window (server answer → committed `llm_calls` row) over the
clean runs. Goal: 0 lost and 0 duplicated everywhere.

    .venv/bin/python benchmarks/fault_matrix.py [--stages search,collect,rank,render,train,export,rollout,evaluate]
        [--kills 5] [--seed 0] [--server-latency 0.02] [--keep DIR]

train runs DeepSpeed ZeRO-3 on the tiny CPU model (minutes per run): leave it out with --stages for a quick matrix.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.hardening.kill_matrix import ALL_STAGES, format_lines, open_matrix  # noqa: E402


def _stages(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALL_STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"stages must be among {', '.join(ALL_STAGES)} (got {text!r})")
    return [name for name in ALL_STAGES if name in names]  # chain order: each stage's clean run feeds the next


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=_stages, default=list(ALL_STAGES), help="comma-separated stage names")
    parser.add_argument("--kills", type=int, default=5, help="kill trials per stage")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--server-latency", type=float, default=0.02, help="seconds before each answer")
    parser.add_argument("--keep", type=Path, default=None, help="work in this (new) folder and keep it")
    args = parser.parse_args(argv)
    if args.kills < 0:
        parser.error("--kills must be >= 0")
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        lines = []
        with open_matrix(root, seed=args.seed, server_latency_s=args.server_latency) as matrix:
            for name in args.stages:
                lines.append(matrix.stage(name, args.kills))
                print(f"# {name}: done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        print(
            f"fault matrix: {args.kills} kill(s) per stage, seed {args.seed}, "
            f"server latency {args.server_latency * 1000:.0f} ms"
        )
        print("\n".join(format_lines(lines)))
        damaged = sum(line.lost + line.duplicated for line in lines)
        print(f"result: {'0 lost, 0 duplicated' if not damaged else f'{damaged} units lost or duplicated'}")
        return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
