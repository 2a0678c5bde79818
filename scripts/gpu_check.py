"""GPU validation of one node: serve an exported FP8 model with vLLM, then time ZeRO-3 LoRA steps on a random Qwen3.

    bash scripts/gpu_check.sh [--steps 10] [--size 4b] [--gpus N] [--peak-tflops 989] [--only serve|train]

1. serve: a tiny randomly initialised Qwen3 (mass_ops.models.tiny) → block-FP8 export (the production exporter, with
   its tensor-parallel check) → `vllm serve` → readiness (health, listed name, one-token generation) → one timed
   32-token completion. Prints the start-up seconds and decode tokens/s.
2. train: a random Qwen3 of a few billion parameters (the shapes of Qwen3-1.7B/4B/8B) → N steps of the production
   trainer (DeepSpeed ZeRO-3 + LoRA, one rank per GPU) on synthetic windows → median tokens/s and MFU from its
   train_log (the FLOPs model of mass_ops.train.flops against --peak-tflops).

Each part has a deadline (--deadline-s, 600 by default). Without CUDA (or without vLLM for the serve part) a part is
skipped with a line saying why, and the script exits 0: it validates GPU nodes and has nothing to say elsewhere.
Exit 1 when a part that could run failed. Everything lands under --workdir (default runs/gpu_check).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Qwen3 dense shapes (hidden, layers, MLP, heads, KV heads, head dim) of the released models of that size.
SIZES: dict[str, dict[str, int]] = {
    "1.7b": {"hidden_size": 2048, "num_layers": 28, "intermediate_size": 6144, "heads": 16, "kv_heads": 8},
    "4b": {"hidden_size": 2560, "num_layers": 36, "intermediate_size": 9728, "heads": 32, "kv_heads": 8},
    "8b": {"hidden_size": 4096, "num_layers": 36, "intermediate_size": 12288, "heads": 32, "kv_heads": 8},
}
SERVED_NAME = "mass-gpu-check"
SKIPPED, PASSED, FAILED = "skipped", "ok", "FAILED"


@dataclass(frozen=True)
class PartResult:
    part: str
    status: str
    detail: str

    def line(self) -> str:
        return f"gpu_check {self.part}: {self.status}: {self.detail}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("serve", "train"), help="Run one part only.")
    parser.add_argument("--steps", type=int, default=10, help="ZeRO-3 LoRA steps to time (default 10; ≥ 3).")
    parser.add_argument("--size", choices=sorted(SIZES), default="4b", help="Random Qwen3 to train (default 4b).")
    parser.add_argument("--window", type=int, default=8192, help="Tokens per training window (default 8192).")
    parser.add_argument("--gpus", type=int, default=None, help="Training ranks (default: every visible GPU).")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="Peak dense BF16 TFLOP/s per GPU for MFU (989: H100 SXM / H200; 756: H100 PCIe).",
    )
    parser.add_argument("--port", type=int, default=8123, help="Port of the vLLM server (default 8123).")
    parser.add_argument("--deadline-s", type=int, default=600, help="Seconds each part may take (default 600).")
    parser.add_argument("--workdir", type=Path, default=Path("runs/gpu_check"), help="Where models and logs go.")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first steps warm up and are not timed)")
    if args.window < 256 or args.window % 128:
        parser.error("--window must be a multiple of 128, at least 256")
    if args.gpus is not None and args.gpus < 1:
        parser.error("--gpus must be positive")
    if not 0 < args.port < 65536:
        parser.error("--port must be a TCP port")
    if args.deadline_s < 60 or args.peak_tflops <= 0:
        parser.error("--deadline-s must be at least 60 and --peak-tflops positive")
    return args


def cuda_devices() -> int:
    """Visible CUDA devices (0 without torch's CUDA build or a driver)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(part: str, devices: int, *, has_vllm: bool) -> str | None:
    """Why a part cannot run on this machine, or None."""
    if devices == 0:
        return "no CUDA device visible (torch.cuda.is_available() is False); run this on a GPU node"
    if part == "serve" and not has_vllm:
        return "vLLM is not installed in this environment (pip install vllm)"
    return None


# -- serve --------------------------------------------------------------------------------------------------------


def vllm_argv(model_dir: Path, *, port: int, python: str = sys.executable) -> list[str]:
    """`vllm serve` of the FP8 folder: small context and memory share, the production parsers."""
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.3",
        "--tensor-parallel-size",
        "1",
    ]


def check_serve(args: argparse.Namespace) -> PartResult:
    import httpx

    from mass_ops.compute.local import start_server, stop_server, wait_ready
    from mass_ops.export import export_fp8
    from mass_ops.export.tensor_parallel import check_fp8_tensor_parallel
    from mass_ops.models.tiny import build_tiny_qwen3

    work = args.workdir / "serve"
    bf16 = build_tiny_qwen3(work / "tiny-bf16", max_position_embeddings=4096)
    fp8 = work / "tiny-fp8"
    if not (fp8 / "config.json").is_file():
        check_fp8_tensor_parallel(bf16, 1)
        export_fp8(bf16, fp8)
    endpoint = f"http://127.0.0.1:{args.port}/v1"
    state_file = work / "server.json"
    started = time.monotonic()
    state = start_server(
        vllm_argv(fp8, port=args.port),
        state_file=state_file,
        endpoint=endpoint,
        served_name=SERVED_NAME,
        log_path=work / "vllm.log",
    )
    try:
        wait_ready(state, timeout_s=args.deadline_s, interval_s=2.0)
        ready_s = time.monotonic() - started
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 32,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        t0 = time.monotonic()
        answer = httpx.post(f"{endpoint}/chat/completions", json=body, timeout=120.0)
        answer.raise_for_status()
        seconds = time.monotonic() - t0
        tokens = int(answer.json().get("usage", {}).get("completion_tokens") or 0)
    finally:
        stop_server(state_file, grace_s=30)
    return PartResult(
        "serve",
        PASSED,
        f"FP8 tiny Qwen3 ready in {ready_s:.0f} s; {tokens} tokens in {seconds:.2f} s "
        f"({tokens / seconds:.0f} tokens/s)",
    )


# -- train --------------------------------------------------------------------------------------------------------


def synthetic_windows(path: Path, *, count: int, window: int, vocab: int, seed: int = 0) -> Path:
    """`count` windows of `window` random tokens, the second half supervised (MASS_SPEC §7 record fields)."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            ids = [rng.randrange(vocab) for _ in range(window)]
            labels = [-100] * (window // 2) + ids[window // 2 :]
            record = {
                "input_ids": ids,
                "labels": labels,
                "task": 1,
                "role": "orchestrator",
                "episode": f"synthetic-{i}",
            }
            out.write(json.dumps(record) + "\n")
    return path


def throughput_summary(rows: list[dict[str, Any]], *, peak_tflops: float, warmup: int = 2) -> dict[str, float | None]:
    """Median tokens/s, supervised tokens/s, TFLOP/s per GPU and MFU over the logged steps after `warmup`."""
    steps = [r for r in rows if "tokens_per_s" in r and r.get("step", 0) > warmup]
    if not steps:
        return {"tokens_per_s": None, "supervised_tokens_per_s": None, "tflops_per_gpu": None, "mfu": None}
    tflops = [r["model_tflops_per_gpu"] for r in steps if r.get("model_tflops_per_gpu") is not None]
    median_tflops = statistics.median(tflops) if tflops else None
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "supervised_tokens_per_s": statistics.median(r["supervised_tokens_per_s"] for r in steps),
        "tflops_per_gpu": median_tflops,
        "mfu": None if median_tflops is None else median_tflops / peak_tflops,
        "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in steps),
    }


def train_args(args: argparse.Namespace, model_dir: Path, data: Path, out_dir: Path, val: Path | None = None) -> Any:
    from mass_ops.train.args import TrainArgs

    return TrainArgs(
        model_dir=str(model_dir),
        train_data=str(data),
        val_data=None if val is None else str(val),
        out_dir=str(out_dir),
        steps=args.steps,
        warmup_steps=1,
        save_every=args.steps,
        val_every=args.steps,
        val_at_start=False,
        accelerator="cuda",
        lora_r=64,
        lora_alpha=128,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )


def check_train(args: argparse.Namespace, devices: int) -> PartResult:
    from mass_ops.models.tiny import QWEN3_VOCAB_SIZE, build_tiny_qwen3
    from mass_ops.train.launch import build_launch_command

    gpus = args.gpus or devices
    if gpus > devices:
        return PartResult("train", FAILED, f"--gpus {gpus} but only {devices} CUDA devices are visible")
    work = args.workdir / f"train-{args.size}"
    model = build_tiny_qwen3(work / "model", **SIZES[args.size], head_dim=128, max_position_embeddings=args.window)
    data = synthetic_windows(work / "windows.jsonl", count=4 * gpus, window=args.window, vocab=QWEN3_VOCAB_SIZE)
    # Validation runs once, after the last step: its forward passes and gathers run on the accelerator too.
    val = synthetic_windows(work / "val.jsonl", count=gpus, window=args.window, vocab=QWEN3_VOCAB_SIZE, seed=1)
    out_dir = work / f"run-{int(time.time())}"
    args_path = train_args(args, model, data, out_dir, val).write(work / f"{out_dir.name}.args.json")
    argv = build_launch_command(args_path, nproc_per_node=gpus, python=sys.executable)
    with (work / f"{out_dir.name}.log").open("w") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=args.deadline_s, check=False)
    if done.returncode != 0:
        return PartResult("train", FAILED, f"trainer exited {done.returncode}; see {work / (out_dir.name + '.log')}")
    rows = [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    summary = throughput_summary(rows, peak_tflops=args.peak_tflops)
    if summary["tokens_per_s"] is None:
        return PartResult("train", FAILED, f"no timed steps in {out_dir / 'train_log.jsonl'}")
    mfu = summary["mfu"]
    val_loss = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
    if val_loss is None or not math.isfinite(val_loss):
        return PartResult("train", FAILED, f"no finite validation loss in {out_dir / 'train_log.jsonl'}")
    return PartResult(
        "train",
        PASSED,
        f"random Qwen3-{args.size} ZeRO-3 LoRA on {gpus} GPU(s), window {args.window}: "
        f"{summary['tokens_per_s']:.0f} tokens/s ({summary['supervised_tokens_per_s']:.0f} supervised), "
        f"{summary['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {'n/a' if mfu is None else f'{mfu:.1%}'} "
        f"of {args.peak_tflops:g}, peak memory {summary['peak_mem_gib']:.1f} GiB, validation loss {val_loss:.3f}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    devices = cuda_devices()
    has_vllm = importlib.util.find_spec("vllm") is not None
    parts = [args.only] if args.only else ["serve", "train"]
    results = []
    for part in parts:
        reason = skip_reason(part, devices, has_vllm=has_vllm)
        if reason is not None:
            results.append(PartResult(part, SKIPPED, reason))
        else:
            try:
                results.append(check_serve(args) if part == "serve" else check_train(args, devices))
            except (subprocess.TimeoutExpired, Exception) as exc:  # one part's failure must not hide the other's
                results.append(PartResult(part, FAILED, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
        print(results[-1].line(), flush=True)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
