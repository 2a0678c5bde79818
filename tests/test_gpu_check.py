"""scripts/gpu_check.py on a machine without a GPU: arguments, the parts that need no CUDA, and the skip lines."""

from __future__ import annotations

import importlib.util
import json
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


def test_throughput_summary_skips_warmup_steps():
    rows = [{"event": "lora_targets"}] + [
        {
            "step": s,
            "tokens_per_s": 1000.0 * s,
            "supervised_tokens_per_s": 500.0 * s,
            "model_tflops_per_gpu": 100.0 * s,
            "peak_mem_gib": float(s),
        }
        for s in range(1, 6)
    ]
    summary = gpu_check.throughput_summary(rows, peak_tflops=1000.0)
    assert summary == {
        "tokens_per_s": 4000.0,  # median of steps 3, 4, 5
        "supervised_tokens_per_s": 2000.0,
        "tflops_per_gpu": 400.0,
        "mfu": 0.4,
        "peak_mem_gib": 5.0,
    }
    assert gpu_check.throughput_summary(rows[:3], peak_tflops=1000.0)["tokens_per_s"] is None


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
