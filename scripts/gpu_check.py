"""GPU validation of one node: serve an exported FP8 model with vLLM, then time ZeRO-3 LoRA steps on a random Qwen3.

    bash scripts/gpu_check.sh [--steps 10] [--size 4b] [--gpus N] [--peak-tflops 989] [--only serve|train]
    bash scripts/gpu_check.sh --sweep [--cells baseline,zero3,...] [--tiny]

1. serve: a tiny random Qwen3 → block-FP8 export (the production exporter) → `vllm serve` → readiness → one timed
   32-token completion: start-up seconds and decode tokens/s.
2. train: a random Qwen3 of Qwen3-1.7B/4B/8B shapes → N steps of the production trainer (ZeRO-3 + LoRA, a rank per
   GPU) → its throughput.json: warm-up steps left out and explained, step p50/p95, tokens/s, both MFUs, peak memory.
3. --sweep: the trainer's knob matrix (`SWEEP`), a launch per cell within --sweep-deadline-s (480 s), one table;
   `--tiny` runs it on CPU with a tiny random Qwen3 (the tests' path).

Each part has a deadline (--deadline-s, 600). Without CUDA (or vLLM, for serve) a part is skipped with a line saying
why and the script exits 0; exit 1 when a part that could run failed. Everything lands under --workdir.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
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

# The sweep's cells, each a full set of trainer knobs. `baseline` is the trainer as first measured (DeepSpeed's
# ZeRO-3 defaults, SDPA, every layer checkpointed); each next cell changes one thing, keeping the earlier gains.
_BASELINE = {
    "zero3_persistence_threshold": 100_000,  # DeepSpeed's default: LoRA A/B of a 4B model are gathered per use
    "zero3_overlap_comm": False,
    "zero3_prefetch_bucket_size": 50_000_000,
    "attn_implementation": "sdpa",
    "gradient_checkpointing": "full",
    "packing": "off",
}
_ZERO3 = {"zero3_persistence_threshold": None, "zero3_overlap_comm": True, "zero3_prefetch_bucket_size": 100_000_000}
_FAST = {**_BASELINE, **_ZERO3, "attn_implementation": "auto"}


@dataclass(frozen=True)
class Cell:
    label: str
    knobs: dict[str, Any]
    mixed: bool = False
    """Mixed-length windows (window/8 to window) and 4 windows per rank per step: what packing is for."""


SWEEP: dict[str, Cell] = {
    "baseline": Cell("DeepSpeed defaults, sdpa, full ckpt", _BASELINE),
    "zero3": Cell("+ adapter persistence, overlap, prefetch", {**_BASELINE, **_ZERO3}),
    "attn": Cell("+ attention auto (flash if installed)", _FAST),
    "ckpt-selective": Cell("+ selective ckpt", {**_FAST, "gradient_checkpointing": "selective"}),
    "ckpt-off": Cell("+ no ckpt", {**_FAST, "gradient_checkpointing": "off"}),
    "mixed-unpacked": Cell(
        "mixed lengths, 1 window/micro-batch", {**_FAST, "gradient_checkpointing": "selective"}, mixed=True
    ),
    "mixed-packed": Cell(
        "mixed lengths, packed", {**_FAST, "gradient_checkpointing": "selective", "packing": "on"}, mixed=True
    ),
}
MIXED_GRAD_ACCUM = 4
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
    parser.add_argument("--sweep", action="store_true", help="Run the training knob matrix and print one table.")
    parser.add_argument("--cells", help=f"Comma-separated sweep cells (default all: {','.join(SWEEP)}).")
    parser.add_argument("--tiny", action="store_true", help="Sweep a tiny random Qwen3 on CPU (a few steps per cell).")
    parser.add_argument("--sweep-deadline-s", type=int, default=480, help="Seconds the whole sweep may take.")
    args = parser.parse_args(argv)
    if args.cells is not None:
        unknown = sorted(set(args.cells.split(",")) - set(SWEEP))
        if unknown or not args.sweep:
            parser.error(f"--cells needs --sweep and names from {list(SWEEP)} (unknown: {unknown})")
    if args.tiny and not args.sweep:
        parser.error("--tiny applies to --sweep only")
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


def synthetic_windows(path: Path, *, count: int, window: int, vocab: int, seed: int = 0, mixed: bool = False) -> Path:
    """`count` windows of `window` random tokens (`mixed`: lengths drawn uniformly from window/8 to window), the
    second half of each supervised (MASS_SPEC §7 record fields)."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            n = rng.randrange(window // 8, window + 1) if mixed else window
            ids = [rng.randrange(vocab) for _ in range(n)]
            labels = [-100] * (n // 2) + ids[n // 2 :]
            record = {
                "input_ids": ids,
                "labels": labels,
                "task": 1,
                "role": "orchestrator",
                "episode": f"synthetic-{i}",
            }
            out.write(json.dumps(record) + "\n")
    return path


def summary_line(summary: dict[str, Any], *, peak_tflops: float) -> str:
    """The steady-state figures of a trainer's throughput.json, warm-up named and explained."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    warm = "; ".join(
        f"step {w['step']} {w['step_s']:.1f} s (data {w.get('data_s', 0):.1f}, forward {w.get('forward_s', 0):.1f}, "
        f"backward {w.get('backward_s', 0):.1f}, optimizer {w.get('optimizer_s', 0):.1f})"
        for w in summary["warmup"]
    )
    setup = ", ".join(f"{k} {v:.0f} s" for k, v in summary.get("setup_s", {}).items())
    recompiles = summary.get("recompiles")
    return (
        f"steady state over {summary['measured_steps']} steps after warm-up steps {summary['warmup_steps_excluded']}: "
        f"step p50 {summary['step_s_p50']:.3f} s, p95 {summary['step_s_p95']:.3f} s "
        f"(p95/p50 {summary['step_s_p95_over_p50']:.2f}); {summary['tokens_per_s']:.0f} tokens/s "
        f"({summary['supervised_tokens_per_s']:.0f} supervised); MFU {pct(summary['mfu'])} ours, "
        f"{pct(summary['mfu_lora_causal'])} NeMo LoRA-causal, of {peak_tflops:g} TFLOP/s; peak memory "
        f"{summary['peak_mem_gib']:.1f} GiB. Setup: {setup}. Warm-up: {warm}. "
        f"Recompiles: {'none (no torch.compile)' if recompiles is None else recompiles}"
    )


def train_args(
    args: argparse.Namespace,
    model_dir: Path,
    data: Path,
    out_dir: Path,
    val: Path | None = None,
    *,
    accelerator: str = "cuda",
    **knobs: Any,
) -> Any:
    """The trainer's args of a timed run: LoRA r = 64 on every projection, then `knobs` (sweep cells) over them."""
    from mass_ops.train.args import TrainArgs

    fields: dict[str, Any] = {
        "model_dir": str(model_dir),
        "train_data": str(data),
        "val_data": None if val is None else str(val),
        "out_dir": str(out_dir),
        "steps": args.steps,
        "warmup_steps": 1,
        "save_every": args.steps,
        "val_every": args.steps,
        "val_at_start": False,
        "accelerator": accelerator,
        "lora_r": 64,
        "lora_alpha": 128,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    return TrainArgs(**{**fields, **knobs})


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
    summary = read_summary(out_dir)
    if summary is None or not summary.get("measured_steps"):
        return PartResult("train", FAILED, f"no steady-state steps in {out_dir / 'throughput.json'}")
    val_loss = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
    if val_loss is None or not math.isfinite(val_loss):
        return PartResult("train", FAILED, f"no finite validation loss in {out_dir / 'train_log.jsonl'}")
    return PartResult(
        "train",
        PASSED,
        f"random Qwen3-{args.size} ZeRO-3 LoRA on {gpus} GPU(s), window {args.window}, "
        f"{summary['knobs'].get('attention')} attention, checkpointing "
        f"{summary['knobs'].get('activation_checkpointing')}: {summary_line(summary, peak_tflops=args.peak_tflops)}; "
        f"validation loss {val_loss:.3f}",
    )


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    """The trainer's throughput.json of a run, or None when it did not write one."""
    path = out_dir / "throughput.json"
    return json.loads(path.read_text()) if path.is_file() else None


# -- sweep --------------------------------------------------------------------------------------------------------


def tiny_model(path: Path) -> Path:
    """A random Qwen3 small enough for a CPU sweep (vocabulary 1024: the real one costs seconds per CPU step)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(config)
    model.to(dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    return path


def run_cell(
    args: argparse.Namespace, name: str, model: Path, data: Path, gpus: int, timeout_s: float
) -> dict[str, Any]:
    """Launch the trainer for one cell; its throughput.json, or {"error": why}."""
    from mass_ops.train.launch import build_launch_command

    cell = SWEEP[name]
    work = args.workdir / "sweep"
    out_dir = work / f"{name}-{int(time.time())}"
    extra: dict[str, Any] = {"grad_accum": MIXED_GRAD_ACCUM} if cell.mixed else {}
    if cell.mixed:
        extra["pack_tokens"] = args.window
    if args.tiny:
        extra.update(warmup_measure_steps=1, lora_r=8, lora_alpha=16, ce_chunk=128)
    targs = train_args(args, model, data, out_dir, accelerator="cpu" if args.tiny else "cuda", **cell.knobs, **extra)
    path = targs.write(work / f"{out_dir.name}.args.json")
    argv = build_launch_command(path, nproc_per_node=gpus, python=sys.executable)
    log = work / f"{out_dir.name}.log"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"} if args.tiny else None
    with log.open("w") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s; see {log}"}
    summary = read_summary(out_dir)
    if done.returncode != 0 or summary is None:
        return {"error": f"trainer exited {done.returncode}; see {log}"}
    return summary


def sweep_table(results: dict[str, dict[str, Any]], *, peak_tflops: float) -> list[str]:
    """One table: a row per cell, the steady-state figures (or why the cell has none)."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    header = (
        f"{'cell':<15} {'knobs':<40} {'p50 s':>7} {'p95 s':>7} {'tokens/s':>9} {'superv/s':>9} "
        f"{'MFU':>6} {'MFU-NeMo':>8} {'peak GiB':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        label = SWEEP[name].label
        if "error" in r or not r.get("measured_steps"):
            lines.append(f"{name:<15} {label:<40} {r.get('error', 'no step after warm-up')}")
            continue
        lines.append(
            f"{name:<15} {label:<40} {r['step_s_p50']:>7.3f} {r['step_s_p95']:>7.3f} {r['tokens_per_s']:>9.0f} "
            f"{r['supervised_tokens_per_s']:>9.0f} {pct(r['mfu']):>6} {pct(r['mfu_lora_causal']):>8} "
            f"{r['peak_mem_gib']:>8.1f}"
        )
    lines.append(f"MFU against {peak_tflops:g} TFLOP/s per GPU; warm-up steps excluded (see each throughput.json).")
    return lines


def check_sweep(args: argparse.Namespace, devices: int) -> PartResult:
    """Run the chosen cells within --sweep-deadline-s and print their table."""
    from mass_ops.models.tiny import QWEN3_VOCAB_SIZE, build_tiny_qwen3

    started = time.monotonic()
    names = args.cells.split(",") if args.cells else list(SWEEP)
    work = args.workdir / "sweep"
    if args.tiny:
        gpus, vocab = 1, 1024
        model = tiny_model(work / "model-tiny")
    else:
        gpus, vocab = args.gpus or devices, QWEN3_VOCAB_SIZE
        model = build_tiny_qwen3(
            work / f"model-{args.size}", **SIZES[args.size], head_dim=128, max_position_embeddings=args.window
        )
    count = 4 * gpus * MIXED_GRAD_ACCUM
    full = synthetic_windows(work / "full.jsonl", count=count, window=args.window, vocab=vocab)
    mixed = synthetic_windows(work / "mixed.jsonl", count=count, window=args.window, vocab=vocab, mixed=True)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        left = args.sweep_deadline_s - (time.monotonic() - started)
        if left < 30:
            results[name] = {"error": "not run: the sweep deadline was reached"}
            continue
        results[name] = run_cell(args, name, model, mixed if SWEEP[name].mixed else full, gpus, left)
    for line in sweep_table(results, peak_tflops=args.peak_tflops):
        print(line, flush=True)
    ran = [n for n, r in results.items() if r.get("measured_steps")]
    failed = [n for n in names if n not in ran]
    status = PASSED if ran else FAILED
    where = "CPU, tiny random Qwen3" if args.tiny else f"random Qwen3-{args.size} on {gpus} GPU(s)"
    detail = f"{len(ran)} of {len(names)} cells measured ({where}, window {args.window})"
    return PartResult("sweep", status, detail + (f"; no figures for {failed}" if failed else ""))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    devices = cuda_devices()
    has_vllm = importlib.util.find_spec("vllm") is not None
    parts = ["sweep"] if args.sweep else [args.only] if args.only else ["serve", "train"]
    results = []
    for part in parts:
        reason = None if part == "sweep" and args.tiny else skip_reason(part, devices, has_vllm=has_vllm)
        if reason is not None:
            results.append(PartResult(part, SKIPPED, reason))
        else:
            try:
                if part == "sweep":
                    results.append(check_sweep(args, devices))
                else:
                    results.append(check_serve(args) if part == "serve" else check_train(args, devices))
            except (subprocess.TimeoutExpired, Exception) as exc:  # one part's failure must not hide the other's
                results.append(PartResult(part, FAILED, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
        print(results[-1].line(), flush=True)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
