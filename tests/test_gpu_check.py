"""scripts/gpu_check.py on a machine without a GPU: arguments, the parts that need no CUDA, and the skip lines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mass_ops.train.args import TrainArgs
from mass_ops.train.data import load_windows

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up by name
spec.loader.exec_module(gpu_check)


def test_defaults_and_refused_arguments(capsys):
    args = gpu_check.parse_args([])
    assert (args.steps, args.size, args.window, args.peak_tflops, args.deadline_s) == (10, "4b", 8192, 989.0, 600)
    for bad in (["--steps", "2"], ["--window", "1000"], ["--gpus", "0"], ["--size", "70b"], ["--deadline-s", "5"]):
        with pytest.raises(SystemExit) as caught:
            gpu_check.parse_args(bad)
        assert caught.value.code == 2
    assert "--steps must be at least 3" in capsys.readouterr().err


def test_skip_reasons_name_what_is_missing():
    assert "no CUDA device visible" in gpu_check.skip_reason("train", 0, has_vllm=True)
    assert "vLLM is not installed" in gpu_check.skip_reason("serve", 8, has_vllm=False)
    assert gpu_check.skip_reason("serve", 1, has_vllm=True) is None
    assert gpu_check.skip_reason("train", 1, has_vllm=False) is None


def test_the_sizes_are_a_few_billion_parameters_and_fp8_friendly():
    from mass_ops.train.flops import flops_model

    for name, shape in gpu_check.SIZES.items():
        config = {
            "hidden_size": shape["hidden_size"],
            "num_hidden_layers": shape["num_layers"],
            "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["kv_heads"],
            "head_dim": 128,
            "intermediate_size": shape["intermediate_size"],
            "vocab_size": 151936,
        }
        billions = flops_model(config).active_params / 1e9
        assert 1.0 < billions < 9.0, name
        assert shape["hidden_size"] % 128 == 0 and shape["intermediate_size"] % 128 == 0


def test_synthetic_windows_load_as_training_data(tmp_path: Path):
    path = gpu_check.synthetic_windows(tmp_path / "w.jsonl", count=3, window=256, vocab=1000)
    windows = load_windows(str(path), vocab_size=1000)
    assert len(windows) == 3 and all(w.n_tokens == 256 and w.n_loss_tokens == 128 for w in windows.windows)


def test_train_args_are_valid_cuda_args(tmp_path: Path):
    args = gpu_check.parse_args(["--steps", "5"])
    built = gpu_check.train_args(args, tmp_path / "m", tmp_path / "w.jsonl", tmp_path / "out")
    assert isinstance(built, TrainArgs) and built.accelerator == "cuda" and built.steps == 5
    assert TrainArgs.from_dict(json.loads(json.dumps(built.to_dict()))) == built


def test_vllm_argv_serves_the_fp8_folder_under_the_check_name(tmp_path: Path):
    argv = gpu_check.vllm_argv(tmp_path / "fp8", port=8123, python="python")
    assert argv[:5] == ["python", "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path / "fp8")]
    assert argv[argv.index("--served-model-name") + 1] == gpu_check.SERVED_NAME
    assert argv[argv.index("--port") + 1] == "8123"


def _summary(**over: object) -> dict:
    summary = {
        "warmup_steps_excluded": [1, 2],
        "measured_steps": 8,
        "warmup": [
            {"step": 1, "step_s": 14.2, "data_s": 0.1, "forward_s": 3.0, "backward_s": 9.0, "optimizer_s": 2.1},
            {"step": 2, "step_s": 1.5, "data_s": 0.0, "forward_s": 0.5, "backward_s": 0.9, "optimizer_s": 0.1},
        ],
        "setup_s": {"data": 1.0, "model": 20.0, "engine": 5.0},
        "recompiles": None,
        "step_s_p50": 1.3,
        "step_s_p95": 1.43,
        "step_s_p95_over_p50": 1.1,
        "tokens_per_s": 12600.0,
        "supervised_tokens_per_s": 6300.0,
        "mfu": 0.41,
        "mfu_lora_causal": 0.3,
        "peak_mem_gib": 60.0,
        "knobs": {"attention": "flash_attention_2", "activation_checkpointing": "selective"},
    }
    return {**summary, **over}


def test_the_summary_line_names_the_warmup_and_both_mfus():
    line = gpu_check.summary_line(_summary(), peak_tflops=989.0)
    assert "after warm-up steps [1, 2]" in line and "step 1 14.2 s (data 0.1, forward 3.0, backward 9.0" in line
    assert "p50 1.300 s, p95 1.430 s" in line and "12600 tokens/s (6300 supervised)" in line
    assert "MFU 41.0% ours, 30.0% NeMo LoRA-causal" in line and "Recompiles: none (no torch.compile)" in line


def test_sweep_arguments_and_cells():
    args = gpu_check.parse_args(["--sweep", "--cells", "baseline,mixed-packed", "--tiny"])
    assert args.sweep and args.tiny and args.sweep_deadline_s == 480
    for bad in (["--cells", "baseline"], ["--sweep", "--cells", "turbo"], ["--tiny"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
    cells = gpu_check.SWEEP
    assert next(iter(cells)) == "baseline" and cells["baseline"].knobs["packing"] == "off"
    assert cells["mixed-packed"].knobs == {**cells["mixed-unpacked"].knobs, "packing": "on"}
    for cell in cells.values():  # every cell is a valid set of trainer knobs
        gpu_check.train_args(args, Path("m"), Path("d"), Path("o"), **cell.knobs)


def test_the_sweep_table_has_a_row_per_cell_and_says_why_one_has_none():
    lines = gpu_check.sweep_table(
        {"baseline": _summary(), "ckpt-off": {"error": "trainer exited 1; see x.log"}}, peak_tflops=989.0
    )
    assert lines[0].split()[:3] == ["cell", "knobs", "p50"]
    assert lines[2].startswith("baseline") and "12600" in lines[2] and "41.0%" in lines[2] and "30.0%" in lines[2]
    assert lines[3].startswith("ckpt-off") and lines[3].endswith("trainer exited 1; see x.log")


@pytest.mark.slow(seconds=50)
def test_the_tiny_sweep_runs_a_packed_cell_on_cpu(tmp_path: Path):
    done = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "gpu_check.sh"),
            *("--sweep", "--tiny", "--cells", "mixed-packed", "--steps", "3", "--window", "256"),
            *("--workdir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        # The real HOME: DeepSpeed's CPU communication op is built once into its extension cache there.
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    row = next(line for line in lines if line.startswith("mixed-packed"))
    figures = row.split()[-7:]  # p50, p95, tokens/s, supervised/s, MFU, MFU-NeMo, peak GiB
    assert float(figures[0]) > 0 and float(figures[2]) > float(figures[3]) > 0 and figures[4] == "n/a"
    assert lines[-1] == "gpu_check sweep: ok: 1 of 1 cells measured (CPU, tiny random Qwen3, window 256)"
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("mixed-packed-*/throughput.json")]
    assert summary["knobs"]["packing"] is True and summary["knobs"]["grad_accum"] == 4


def test_the_script_skips_both_parts_with_a_clear_line_on_this_machine(tmp_path: Path):
    if gpu_check.cuda_devices():
        pytest.skip("a CUDA device is visible: the skip path does not apply")
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu_check serve: skipped: no CUDA device visible (torch.cuda.is_available() is False); run this on a GPU node",
        "gpu_check train: skipped: no CUDA device visible (torch.cuda.is_available() is False); run this on a GPU node",
    ]
    assert not any(tmp_path.iterdir())  # nothing built when nothing can run
