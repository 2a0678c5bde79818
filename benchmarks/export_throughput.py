"""Export throughput and memory: LoRA merge + FP8 export vs a plain safetensors load-and-save of the same model.

Generates a ~1 GB BF16 checkpoint (4 shards of 256 MiB of large linear weights; a rank-8 LoRA on every one of them),
then times
  * baseline: ``safetensors.torch.load_file`` + ``save_file`` of every shard, the I/O floor of any export;
  * ``merge_lora`` followed by ``export_fp8`` of the merged model (the two steps as separate passes);
  * ``merge_and_export_fp8``: both outputs in one pass, which is what the post-training export stage runs.
Prints GB/s of each and the ratio of the one-pass export to the baseline (target ≥ 0.3), and the peak RSS of each
export process against the largest shard (target ≤ 2×).

Every phase runs in its own child process of a parent that never imports torch: a child's ``ru_maxrss`` starts from
the size of the process it was forked from, so a parent holding the generated model would inflate it. Each child's
own rusage comes from ``os.wait4``. Dirty pages are flushed (untimed) before each timed phase so no phase pays for
another's writeback.

The phases run ``--repeat`` times, interleaved, and each is reported by its best time (interference from other work
on the machine only ever adds time). Every repetition first deletes that phase's output from the previous one
(untimed), so each phase writes into memory freed moments before: on a VM that hands free memory back to its host,
the kernel pays several times more to fill a page nobody touched recently, and without this the first phase would
get the pages the generator had just freed while later phases got cold ones.

    .venv/bin/python benchmarks/export_throughput.py [--layers 4] [--hidden 4096] [--intermediate 8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def fresh(*outputs: Path) -> None:
    """Delete a previous repetition's output, then flush dirty pages (both untimed; see the module docstring)."""
    for output in outputs:
        shutil.rmtree(output, ignore_errors=True)
    os.sync()


def baseline(folder: Path) -> dict[str, float]:
    """Load every shard fully and save it again."""
    from safetensors.torch import load_file, save_file

    out = folder / "baseline"
    fresh(out)
    out.mkdir()
    start = time.perf_counter()
    for shard in sorted((folder / "base").glob("*.safetensors")):
        save_file(load_file(shard), out / shard.name, metadata={"format": "pt"})
    return {"baseline_s": time.perf_counter() - start}


def export(folder: Path, rank: int) -> dict[str, float]:
    """merge_lora then export_fp8, each timed after an untimed flush of dirty pages."""
    from mass_ops.export import export_fp8, merge_lora

    fresh(folder / "merged", folder / "fp8")
    start = time.perf_counter()
    merge_lora(folder / "base", folder / "lora.safetensors", folder / "merged", r=rank, alpha=2 * rank)
    merge_s = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    export_fp8(folder / "merged", folder / "fp8")
    return {"merge_s": merge_s, "fp8_s": time.perf_counter() - start}


def fused(folder: Path, rank: int) -> dict[str, float]:
    """merge_and_export_fp8 (BF16 and FP8 outputs from one pass), timed after an untimed flush of dirty pages."""
    from mass_ops.export import merge_and_export_fp8

    bf16, fp8 = folder / "fused-bf16", folder / "fused-fp8"
    fresh(bf16, fp8)
    start = time.perf_counter()
    merge_and_export_fp8(folder / "base", folder / "lora.safetensors", bf16, fp8, r=rank, alpha=2 * rank)
    return {"fused_s": time.perf_counter() - start}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers = shards (default 4)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repetitions of every phase (default 3)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--phase", choices=["generate", "baseline", "export", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase is not None:
        phases = {
            "generate": lambda: generate(args.workdir, args.layers, args.hidden, args.intermediate, args.rank),
            "baseline": lambda: baseline(args.workdir),
            "export": lambda: export(args.workdir, args.rank),
            "fused": lambda: fused(args.workdir, args.rank),
        }
        print(json.dumps(phases[args.phase]()))
        return
    if args.repeat < 1:
        sys.exit(f"--repeat must be at least 1, got {args.repeat}")

    timings: dict[str, list[float]] = {}
    peak_rss = {"export": 0, "fused": 0}
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
        for _ in range(args.repeat):
            for phase in ("baseline", "export", "fused"):
                result, rss = run_phase(phase, folder, args)
                for key, seconds in result.items():
                    timings.setdefault(key, []).append(seconds)
                if phase in peak_rss:
                    peak_rss[phase] = max(peak_rss[phase], rss)
    timings["separate_s"] = [m + f for m, f in zip(timings["merge_s"], timings["fp8_s"], strict=True)]

    gb = model_bytes / 1e9
    best = {key: min(values) for key, values in timings.items()}
    baseline_rate = gb / best["baseline_s"]
    rows = [
        ("baseline load+save", "baseline_s"),
        ("merge_lora", "merge_s"),
        ("export_fp8", "fp8_s"),
        ("merge, then FP8", "separate_s"),
        ("merge + FP8, 1 pass", "fused_s"),
    ]
    print(f"best of {args.repeat} (all runs in brackets):")
    for label, key in rows:
        seconds = best[key]
        runs = " ".join(f"{t:.2f}" for t in timings[key])
        print(
            f"{label:<20}: {seconds:6.2f} s  {gb / seconds:5.2f} GB/s  ({gb / seconds / baseline_rate:.2f}x)  [{runs}]"
        )
    ratio = gb / best["fused_s"] / baseline_rate
    print(f"throughput ratio (one-pass merge+FP8 / load+save): {ratio:.2f}  (target >= 0.3)")
    print("peak RSS (includes ~220 MiB for importing torch) and its ratio to the largest shard (target <= 2.0):")
    for label, phase in (("merge, then FP8", "export"), ("merge + FP8, 1 pass", "fused")):
        print(f"  {label:<20}: {peak_rss[phase] / MIB:4.0f} MiB  {peak_rss[phase] / largest:.2f}")


if __name__ == "__main__":
    main()
