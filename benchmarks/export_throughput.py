"""Export throughput and memory: LoRA merge + FP8 export vs a plain safetensors load-and-save of the same model.

Generates a ~1 GB BF16 checkpoint (4 shards of 256 MiB of large linear weights; a rank-8 LoRA on every one of them),
then times
  * baseline: ``safetensors.torch.load_file`` + ``save_file`` of every shard, the I/O floor of any export;
  * ``merge_lora`` followed by ``export_fp8`` of the merged model.
Prints GB/s of each and their ratio (target ≥ 0.3), and the peak RSS of the export process against the largest shard
(target ≤ 2×).

Every phase runs in its own child process of a parent that never imports torch: a child's ``ru_maxrss`` starts from
the size of the process it was forked from, so a parent holding the generated model would inflate it. Each child's
own rusage comes from ``os.wait4``. Dirty pages are flushed (untimed) before each timed phase so no phase pays for
another's writeback.

    .venv/bin/python benchmarks/export_throughput.py [--layers 4] [--hidden 4096] [--intermediate 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def generate(folder: Path, layers: int, hidden: int, intermediate: int, rank: int) -> dict[str, float]:
    """One shard per decoder layer (attention q/o + MLP gate/up/down in BF16) and a LoRA on all of them."""
    import torch
    from safetensors.torch import save_file

    base = folder / "base"
    base.mkdir()
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    generator = torch.Generator().manual_seed(0)
    # Random draws are the slow part; each layer reuses them with its own per-row scaling.
    patterns = {m: torch.randn(shape, generator=generator) * 0.02 for m, shape in shapes.items()}
    weight_map, lora, total = {}, {}, 0
    for layer in range(layers):
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {f"model.layers.{layer}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
        for module, (rows, cols) in shapes.items():
            name = f"model.layers.{layer}.{module}"
            row_scale = torch.rand(rows, 1, generator=generator) + 0.5
            tensors[f"{name}.weight"] = (patterns[module] * row_scale).to(torch.bfloat16)
            lora[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) * 0.01
            lora[f"base_model.model.{name}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
        save_file(tensors, base / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "dtype": "bfloat16",
    }
    (base / "config.json").write_text(json.dumps(config))
    save_file(lora, folder / "lora.safetensors")
    return {}


def baseline(folder: Path) -> dict[str, float]:
    """Load every shard fully and save it again."""
    from safetensors.torch import load_file, save_file

    out = folder / "baseline"
    out.mkdir()
    os.sync()
    start = time.perf_counter()
    for shard in sorted((folder / "base").glob("*.safetensors")):
        save_file(load_file(shard), out / shard.name, metadata={"format": "pt"})
    return {"baseline_s": time.perf_counter() - start}


def export(folder: Path, rank: int) -> dict[str, float]:
    """merge_lora then export_fp8, each timed after an untimed flush of dirty pages."""
    from mass_ops.export import export_fp8, merge_lora

    os.sync()
    start = time.perf_counter()
    merge_lora(folder / "base", folder / "lora.safetensors", folder / "merged", r=rank, alpha=2 * rank)
    merge_s = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    export_fp8(folder / "merged", folder / "fp8")
    return {"merge_s": merge_s, "fp8_s": time.perf_counter() - start}


def run_phase(phase: str, folder: Path, args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """Run one phase in a child process; returns its JSON result and its own peak RSS in bytes."""
    command = [sys.executable, __file__, "--phase", phase, "--workdir", str(folder)]
    command += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
    command += ["--rank", str(args.rank)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"benchmark phase {phase} failed (exit {child.returncode})")
    return json.loads(output.strip().splitlines()[-1]), usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers = shards (default 4)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--phase", choices=["generate", "baseline", "export"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        phases = {
            "generate": lambda: generate(args.workdir, args.layers, args.hidden, args.intermediate, args.rank),
            "baseline": lambda: baseline(args.workdir),
            "export": lambda: export(args.workdir, args.rank),
        }
        print(json.dumps(phases[args.phase]()))
        return

    with tempfile.TemporaryDirectory(prefix="export-bench-", dir=args.workdir) as scratch:
        folder = Path(scratch)
        started = time.perf_counter()
        run_phase("generate", folder, args)
        shards = sorted((folder / "base").glob("*.safetensors"))
        model_bytes = sum(p.stat().st_size for p in shards)
        largest = max(p.stat().st_size for p in shards)
        print(
            f"generated {model_bytes / 1e9:.2f} GB in {len(shards)} shards (largest {largest / MIB:.0f} MiB) "
            f"in {time.perf_counter() - started:.1f} s"
        )
        timings, _ = run_phase("baseline", folder, args)
        export_timings, peak_rss = run_phase("export", folder, args)
        timings.update(export_timings)

    gb = model_bytes / 1e9
    export_s = timings["merge_s"] + timings["fp8_s"]
    baseline_rate, export_rate = gb / timings["baseline_s"], gb / export_s
    print(f"baseline load+save : {timings['baseline_s']:6.2f} s  {baseline_rate:5.2f} GB/s")
    print(f"merge_lora         : {timings['merge_s']:6.2f} s  {gb / timings['merge_s']:5.2f} GB/s")
    print(f"export_fp8         : {timings['fp8_s']:6.2f} s  {gb / timings['fp8_s']:5.2f} GB/s")
    print(f"merge + FP8        : {export_s:6.2f} s  {export_rate:5.2f} GB/s")
    print(f"throughput ratio (merge+FP8 / load+save): {export_rate / baseline_rate:.2f}  (target >= 0.3)")
    print(f"peak RSS of the export process: {peak_rss / MIB:.0f} MiB (includes ~220 MiB for importing torch)")
    print(f"peak RSS / largest shard: {peak_rss / largest:.2f}  (target <= 2.0)")


if __name__ == "__main__":
    main()
