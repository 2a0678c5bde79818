"""LoRA SFT on DeepSpeed ZeRO-3 for real: 2 processes on gloo (CPU), a tiny Qwen3 model, the real Qwen3 tokenizer.

The slow module fixture trains once from scratch with torchrun, then restarts a copy of that run from its middle
checkpoint with the deepspeed launcher; the tests read what both runs wrote. The fast tests cover the pieces the
trainer is built from (chunked loss, adapter checks, refusal to overwrite a run).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mass_ops.train.args import TrainArgs
from mass_ops.train.checkpoints import select_checkpoint
from mass_ops.train.launch import build_launch_command
from mass_ops.train.sampler import TaskRoleSampler, WindowTag
from mass_ops.train.schedule import lr_at
from tests.support.train import window_record, write_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, VAL_EVERY, RESUME_AT = 16, 8, 8, 8
THROUGHPUT_FIELDS = {
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "supervised_tokens_per_s",
    "model_tflops_per_gpu",
    "mfu",
    "model_tflops_per_gpu_lora_causal",
    "mfu_lora_causal",
}
LORA_R = 16
LABEL_FREE_TASK = 999


# ---------------------------------------------------------------------------------------------------------------------
# fast: the pieces


def test_chunked_loss_equals_full_cross_entropy_and_its_gradient() -> None:
    import torch
    import torch.nn.functional as F

    from mass_ops.train.loss import chunked_next_token_loss

    torch.manual_seed(0)
    hidden = torch.randn(70, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (70,))
    labels[:25] = -100  # a masked prefix: its chunks must be skipped, not mis-counted
    labels[40:47] = -100
    total, count = chunked_next_token_loss(hidden, labels, weight, chunk=8)
    expected = F.cross_entropy((hidden[:-1] @ weight.T).float(), labels[1:], ignore_index=-100, reduction="sum")
    assert count == int((labels[1:] != -100).sum())
    assert torch.allclose(total, expected.to(total.dtype), rtol=1e-5)
    (grad,) = torch.autograd.grad(total, hidden)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    assert torch.allclose(grad, expected_grad.to(grad.dtype), rtol=1e-4, atol=1e-6)
    assert torch.count_nonzero(grad[:24]) == 0  # positions whose next token is masked get no gradient


def test_chunked_loss_without_targets_is_a_connected_zero() -> None:
    import torch

    from mass_ops.train.loss import chunked_next_token_loss

    hidden = torch.randn(1, 10, 8, requires_grad=True)
    total, count = chunked_next_token_loss(hidden, torch.full((1, 10), -100), torch.randn(20, 8), chunk=4)
    assert count == 0 and float(total.detach()) == 0.0
    total.backward()  # still part of the graph, so every rank can call backward
    assert hidden.grad is not None


def test_empty_adapter_tensors_are_refused() -> None:
    import torch

    from mass_ops.train.adapters import AdapterSaveError, assert_adapter_non_empty

    # Step 0 as PEFT initialises it: lora_A random, lora_B zero. That is a valid adapter.
    good = {"m.q_proj.lora_A.default.weight": torch.randn(4, 32), "m.q_proj.lora_B.default.weight": torch.zeros(32, 4)}
    assert_adapter_non_empty(good, lora_r=4, where="test")
    assert_adapter_non_empty(good, lora_r=4, where="test", expected_tensors=2)
    # What a plain state_dict() of a ZeRO-3 partitioned LoRA layer looks like: 0-element placeholders.
    partitioned = {k: torch.empty(0) for k in good}
    with pytest.raises(AdapterSaveError, match="empty or malformed"):
        assert_adapter_non_empty(partitioned, lora_r=4, where="test")
    with pytest.raises(AdapterSaveError, match="rank 8"):
        assert_adapter_non_empty(good, lora_r=8, where="test")
    with pytest.raises(AdapterSaveError, match="no LoRA tensors"):
        assert_adapter_non_empty({}, lora_r=4, where="test")


def test_adapters_missing_modules_zero_or_non_finite_are_refused() -> None:
    import torch

    from mass_ops.train.adapters import AdapterSaveError, assert_adapter_non_empty

    def pair(module: str, a: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"{module}.lora_A.default.weight": a, f"{module}.lora_B.default.weight": torch.zeros(32, 4)}

    adapter = {**pair("m.q_proj", torch.randn(4, 32)), **pair("m.in_proj_qkv", torch.randn(4, 32))}
    # Fewer tensors than the target pattern adapts (e.g. a save that saw only some modules).
    with pytest.raises(AdapterSaveError, match="4 tensors where the target pattern adapts 3 modules"):
        assert_adapter_non_empty(adapter, lora_r=4, where="step_00050", expected_tensors=6)
    # lora_A read back as zeros: the gathered tensors were placeholders, not the weights.
    zero_a = {**adapter, **pair("m.out_proj", torch.zeros(4, 32))}
    with pytest.raises(AdapterSaveError, match=r"1 of 3 lora_A tensors are all zeros \(e\.g\. m\.out_proj"):
        assert_adapter_non_empty(zero_a, lora_r=4, where="step_00050")
    bad = dict(adapter)
    bad["m.q_proj.lora_B.default.weight"] = torch.full((32, 4), float("nan"))
    with pytest.raises(AdapterSaveError, match="not finite"):
        assert_adapter_non_empty(bad, lora_r=4, where="step_00050")
    for case in (zero_a, bad):
        with pytest.raises(AdapterSaveError) as raised:
            assert_adapter_non_empty(case, lora_r=4, where="step_00050")
        assert "\n" not in str(raised.value)


def test_a_target_pattern_matching_nothing_refuses_to_start(tiny_qwen3: Path, tmp_path: Path) -> None:
    from mass_ops.train.trainer import TrainingError, build_lora_model

    args = TrainArgs(
        model_dir=str(tiny_qwen3),
        train_data="t",
        out_dir=str(tmp_path),
        lora_target_regex=r".*language_model.*\.(q_proj|v_proj)$",  # the multimodal-only layout on a text-only model
        zero3_init=False,
        autocast_bf16=False,
        gradient_checkpointing=False,
    )
    with pytest.raises(TrainingError, match="matches none of its 14 Linear modules") as raised:
        build_lora_model(args, {})
    assert "\n" not in str(raised.value)
    peft_model, _, _, targets = build_lora_model(
        args.model_copy(update={"lora_target_regex": None, "lora_target_modules": ["q_proj", "down_proj"]}), {}
    )
    assert targets.by_kind == {"q_proj": 2, "down_proj": 2} and targets.lora_tensors == 8
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == targets.adapter_parameters


def test_a_started_run_is_not_overwritten(tmp_path: Path) -> None:
    from mass_ops.train.trainer import LoraSftRun, Ranks, TrainingError

    (tmp_path / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    args = TrainArgs(model_dir="m", train_data="t.jsonl", out_dir=str(tmp_path), steps=10)
    with pytest.raises(TrainingError, match="already started"):
        LoraSftRun(args, Ranks(rank=0, world_size=1, local_rank=0))._check_start()
    resume = args.model_copy(update={"resume_from": str(tmp_path / "step_00005")})
    with pytest.raises(TrainingError, match="not a complete checkpoint"):
        LoraSftRun(resume, Ranks(rank=0, world_size=1, local_rank=0))._check_start()


def test_deepspeed_config_is_zero3_with_the_run_geometry() -> None:
    from mass_ops.train.zero import deepspeed_config

    args = TrainArgs(
        model_dir="m",
        train_data="t",
        out_dir="o",
        grad_accum=3,
        deepspeed_overrides={"zero_optimization": {"reduce_bucket_size": 1000, "stage": 2}},
    )
    config = deepspeed_config(args, world_size=8)
    assert config["train_batch_size"] == 24 and config["gradient_accumulation_steps"] == 3
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert config["zero_optimization"]["stage"] == 3  # an override cannot leave ZeRO-3
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": True}


def test_zero3_adapter_settings_keep_lora_and_norm_tensors_whole(tiny_qwen3: Path) -> None:
    from mass_ops.train.zero import deepspeed_config

    args = TrainArgs(model_dir=str(tiny_qwen3), train_data="t", out_dir="o", lora_r=16)
    zero = deepspeed_config(args, world_size=2)["zero_optimization"]
    # tiny Qwen3: hidden 128, MLP 384, 4 heads × 64 → widest projection 384; largest LoRA tensor 16 × 384.
    assert zero["stage3_param_persistence_threshold"] == 16 * 384 + 1
    assert 128 < zero["stage3_param_persistence_threshold"] < 128 * 128  # norms persist; no frozen projection does
    assert zero["overlap_comm"] is True and zero["stage3_prefetch_bucket_size"] == 100_000_000
    assert deepspeed_config(args, world_size=2, on_cpu=True)["zero_optimization"]["overlap_comm"] is False
    fixed = TrainArgs(model_dir="missing", train_data="t", out_dir="o", zero3_persistence_threshold=10**9)
    assert deepspeed_config(fixed, world_size=1)["zero_optimization"]["stage3_param_persistence_threshold"] == 10**9
    unknown = deepspeed_config(fixed.model_copy(update={"zero3_persistence_threshold": None}), world_size=1)
    assert "stage3_param_persistence_threshold" not in unknown["zero_optimization"]  # DeepSpeed's default


# ---------------------------------------------------------------------------------------------------------------------
# slow: two real runs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(argv: list[str], log: Path) -> None:
    env = {
        **os.environ,
        # the venv's tools first, as the training stage does (its ninja built DeepSpeed's op in scripts/setup.sh)
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with log.open("w") as out:
        done = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        pytest.fail(f"training exited {done.returncode}:\n{tail}")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tiny_qwen3: Path, chat_windows: list[dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("zero3")
    first = chat_windows[0]
    label_free = window_record(
        first["input_ids"], [-100] * len(first["input_ids"]), task=LABEL_FREE_TASK, role="worker", episode="t999_L0_s1"
    )
    train = write_jsonl(root / "train.jsonl", [*chat_windows, label_free])
    val = write_jsonl(root / "val.jsonl", [{**w, "episode": w["episode"] + "_val"} for w in chat_windows])
    args = TrainArgs(
        model_dir=str(tiny_qwen3),
        train_data=str(train),
        val_data=str(val),
        out_dir=str(root / "full"),
        steps=STEPS,
        lr=1e-2,
        warmup_steps=2,
        lora_r=LORA_R,
        lora_alpha=2 * LORA_R,
        save_every=SAVE_EVERY,
        val_every=VAL_EVERY,
        ce_chunk=32,
        seed=1234,
        accelerator="cpu",
    )
    full_args = args.write(root / "full.json")
    _launch(build_launch_command(full_args, nproc_per_node=2, python=sys.executable), root / "full.log")

    # The "interrupted" run: a copy of the run directory restarted from its step-8 checkpoint, by the other launcher.
    shutil.copytree(root / "full", root / "resumed")
    resumed = args.model_copy(
        update={"out_dir": str(root / "resumed"), "resume_from": str(root / "resumed" / f"step_{RESUME_AT:05d}")}
    )
    resumed_args = resumed.write(root / "resumed.json")
    command = build_launch_command(
        resumed_args, nproc_per_node=2, launcher="deepspeed", python=sys.executable, master_port=_free_port()
    )
    _launch(command, root / "resumed.log")
    return {"root": root, "args": args, "full": root / "full", "resumed": root / "resumed", "train": train, "val": val}


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir / "train_log.jsonl") if "loss" in r]


def _val_rows(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir / "train_log.jsonl") if "val_loss" in r]


@pytest.mark.slow(seconds=50)
def test_loss_falls_on_a_memorisable_set(runs: dict) -> None:
    losses = [r["loss"] for r in _train_rows(runs["full"])]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # A frozen random head caps how far a 2-layer model can go (its best logit margin is ~2.5 nats over uniform),
    # so "falls" means a clear share of that room, in training and on the validation copy of the same turns.
    # Training rows see different draws each step (noisy); validation sees the same windows every time.
    early, late = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert late < early - 0.3, f"training loss {early:.3f} → {late:.3f}"
    val = [r["val_loss"] for r in _val_rows(runs["full"])]
    assert val == sorted(val, reverse=True) and val[-1] < val[0] - 0.5, f"validation losses {val}"


@pytest.mark.slow
def test_train_rows_follow_the_schedule_and_batch_geometry(runs: dict) -> None:
    args: TrainArgs = runs["args"]
    rows = _train_rows(runs["full"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "elapsed_s", "peak_mem_gib", "peak_reserved_gib"} <= set(r)
        expected = lr_at(
            r["step"] - 1,
            peak=args.lr,
            warmup_steps=args.warmup_steps,
            total_steps=args.steps,
            min_lr_ratio=args.min_lr_ratio,
        )
        assert r["lr"] == pytest.approx(expected, rel=1e-9)
        assert r["windows"] == 2  # 2 ranks × grad_accum 1
        assert r["tokens"] > 0 and r["grad_norm"] > 0
        # Throughput from the architecture; no MFU on CPU (the peak is a GPU figure).
        assert set(r) >= THROUGHPUT_FIELDS and r["tokens_per_s"] > 0 and len(r["tokens_per_s_per_rank"]) == 2
        assert r["model_tflops_per_gpu"] > 0 and r["mfu"] is None
        assert 0 < r["model_tflops_per_gpu_lora_causal"] < r["model_tflops_per_gpu"]
        assert r["micro_batches"] == 1 and r["pad_tokens"] == 0  # one window per rank: nothing to pack
        assert r["warmup"] == (r["step"] <= 2)
        assert set(r["phases"]) == {"data_s", "forward_s", "backward_s", "optimizer_s"}


@pytest.mark.slow
def test_throughput_summary_names_and_excludes_the_warmup_steps(runs: dict) -> None:
    summary = json.loads((runs["full"] / "throughput.json").read_text())
    assert summary["warmup_steps_excluded"] == [1, 2] and summary["measured_steps"] == STEPS - 2
    assert [w["step"] for w in summary["warmup"]] == [1, 2] and "forward_s" in summary["warmup"][0]
    assert set(summary["setup_s"]) == {"data", "model", "engine"}
    assert 0 < summary["step_s_p50"] <= summary["step_s_p95"]
    assert summary["tokens_per_s"] > summary["supervised_tokens_per_s"] > 0
    assert summary["mfu"] is None and summary["recompiles"] is None  # CPU: no peak; nothing is torch.compile'd
    assert summary["knobs"]["attention"] == "sdpa" and summary["knobs"]["packing"] is False
    assert summary["knobs"]["zero_optimization"]["stage3_param_persistence_threshold"] > LORA_R * 384


@pytest.mark.slow
def test_validation_rows_at_start_every_val_every_and_end(runs: dict, chat_windows: list[dict]) -> None:
    rows = _val_rows(runs["full"])
    assert [r["step"] for r in rows] == [0, 8, 16]
    expected_tokens = sum(sum(label != -100 for label in w["labels"][1:]) for w in chat_windows)
    for r in rows:
        assert r["val_tokens"] == expected_tokens  # padding on the short rank is not counted
        assert set(r["val_by_role"]) == {"orchestrator", "worker", "auxiliary"}
        assert set(r["val_by_task"]) == {"51", "53", "202"}
        assert set(r["val_per_episode"]) == {w["episode"] + "_val" for w in chat_windows}
        for breakdown in ("val_by_role", "val_by_task", "val_per_episode"):
            parts = r[breakdown].values()
            assert sum(p["tokens"] for p in parts) == r["val_tokens"]
            assert sum(p["loss"] * p["tokens"] for p in parts) / r["val_tokens"] == pytest.approx(r["val_loss"])
        assert r["val_seconds"] >= 0


@pytest.mark.slow
def test_checkpoints_hold_non_empty_peft_adapters(runs: dict, tiny_qwen3: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full: Path = runs["full"]
    assert sorted(p.name for p in full.glob("step_*")) == ["step_00008", "step_00016"]
    # What LoRA adapts is recorded beside args.json and as the first train_log row, once (not again on resume).
    targets = json.loads((full / "lora_targets.json").read_text())
    per_kind = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2, "down_proj": 2}
    assert targets["by_kind"] == per_kind and targets["lora_tensors"] == 28
    for run_dir in (full, runs["resumed"]):
        events = [r for r in _rows(run_dir / "train_log.jsonl") if r.get("event") == "lora_targets"]
        assert [{k: v for k, v in r.items() if k != "event"} for r in events] == [targets]
    for step_dir in sorted(full.glob("step_*")):
        lora = load_file(str(step_dir / "lora_state_dict.safetensors"))
        adapter = load_file(str(step_dir / "adapter" / "adapter_model.safetensors"))
        # 2 layers × 7 projections × (A, B): a dense Qwen3 has no linear-attention projections
        assert len(lora) == targets["lora_tensors"]
        assert all(t.dtype == torch.float32 and t.numel() > 0 for t in lora.values())
        for name, tensor in lora.items():
            assert name.startswith("base_model.model.model.layers.") and ".default.weight" in name
            assert tensor.shape[0 if ".lora_A." in name else 1] == LORA_R
            assert torch.equal(adapter[name.replace(".default", "")], tensor)
        assert all(t.abs().max() > 0 for n, t in lora.items() if ".lora_B." in n)  # B starts at zero: it trained
        config = json.loads((step_dir / "adapter" / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (LORA_R, 2 * LORA_R, 0.05)
        assert sum(t.numel() for t in lora.values()) == targets["adapter_parameters"]
        state = json.loads((step_dir / "train_state.json").read_text())
        assert state["step"] == int(step_dir.name[5:]) and state["total_steps"] == STEPS
        assert state["lora_modules_by_kind"] == per_kind
        assert state["world_size"] == 2 and state["exposure"]["draws"] == 2 * state["step"]
        # ZeRO-3 kept one optimizer partition per rank; the frozen parent was not written.
        engine = sorted(p.name for p in (step_dir / "engine" / "state").iterdir())
        assert [n for n in engine if n.endswith("optim_states.pt")] == [
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
        assert sum(p.stat().st_size for p in (step_dir / "engine").rglob("*.pt")) < 5_000_000

    # The published adapter loads into the parent with PEFT, every key consumed, and changes the model's output.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    ids = torch.tensor([[151644, 872, 198, 9707]])
    before = base(input_ids=ids).logits
    model = PeftModel.from_pretrained(base, str(full / "step_00016" / "adapter"))
    loaded = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    final = load_file(str(full / "step_00016" / "lora_state_dict.safetensors"))
    assert set(loaded) == set(final) and all(torch.equal(loaded[n].float(), final[n]) for n in final)
    assert not torch.allclose(model(input_ids=ids).logits, before)


@pytest.mark.slow
def test_sampler_draws_match_the_pure_function_and_skip_label_free_windows(runs: dict, chat_windows: list) -> None:
    # The label-free window (task 999) was dropped at load: the kept windows are the 6 chat windows, in order.
    tags = [WindowTag(index=i, task=w["task"], role=w["role"]) for i, w in enumerate(chat_windows)]
    sampler = TaskRoleSampler(tags, seed=1234, p_orch=1 / 3)
    rows = _rows(runs["full"] / "exposure_log.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for drawn in row["draws"]:
            expected = sampler.draw(step=row["step"] - 1, rank=drawn["rank"], micro=drawn["micro"], grad_accum=1)
            assert (drawn["window"], drawn["task"], drawn["role"]) == (expected.window, expected.task, expected.role)
            assert drawn["task"] != LABEL_FREE_TASK


@pytest.mark.slow
def test_resume_continues_at_the_right_step_with_identical_draws_and_weights(runs: dict) -> None:
    import torch
    from safetensors.torch import load_file

    full, resumed = runs["full"], runs["resumed"]
    (resume,) = _rows(resumed / "resume_log.jsonl")
    assert resume["step"] == RESUME_AT and resume["world_size"] == 2
    # Later checkpoints of the copied run were set aside, then re-created by the resumed run.
    assert [Path(p).name for p in resume["superseded_checkpoints"]] == ["step_00016"]
    assert sorted(p.name for p in resumed.glob("step_*")) == ["step_00008", "step_00016"]

    volatile = {"elapsed_s", "step_s", "val_seconds", "peak_mem_gib", "peak_reserved_gib", "warmup", "phases"}
    volatile |= THROUGHPUT_FIELDS

    def stable(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in volatile} for r in rows]

    full_log, resumed_log = _rows(full / "train_log.jsonl"), _rows(resumed / "train_log.jsonl")
    assert [r["step"] for r in resumed_log if "loss" in r][RESUME_AT] == RESUME_AT + 1
    # Exact, not approximate: CPU kernels and gloo reductions are deterministic, draws and dropout masks are pure
    # functions of (seed, rank, draw), and the fp32 master weights, Adam moments and LR schedule are restored as is.
    assert stable(resumed_log) == stable(full_log)
    assert _rows(resumed / "exposure_log.jsonl") == _rows(full / "exposure_log.jsonl")
    for step in (16,):
        a = load_file(str(full / f"step_{step:05d}" / "lora_state_dict.safetensors"))
        b = load_file(str(resumed / f"step_{step:05d}" / "lora_state_dict.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a = json.loads((full / "step_00016" / "train_state.json").read_text())
    state_b = json.loads((resumed / "step_00016" / "train_state.json").read_text())
    assert state_a["exposure"] == state_b["exposure"]


@pytest.mark.slow
def test_checkpoint_selection_on_the_run(runs: dict) -> None:
    full = runs["full"]
    chosen = select_checkpoint(full / "train_log.jsonl", full)
    saved = {r["step"]: r["val_loss"] for r in _val_rows(full) if r["step"] > 0}
    assert chosen.step == min(saved, key=lambda s: (saved[s], s))
    assert chosen.checkpoint_dir == full / f"step_{chosen.step:05d}"


@pytest.mark.slow
def test_first_update_averages_per_window_token_means_over_ranks(runs: dict, tiny_qwen3: Path) -> None:
    """Replay step 1 without DeepSpeed: the same draws and dropout seeds, each window's token-mean loss divided by
    the windows per step. ZeRO-3's reduced gradient norm and the logged token-weighted loss must agree."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mass_ops.train.data import load_windows
    from mass_ops.train.loss import chunked_next_token_loss
    from mass_ops.train.trainer import derived_seed

    args: TrainArgs = runs["args"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.bfloat16)
    model.requires_grad_(False)
    head = model.get_output_embeddings().weight.detach().float().clone()
    model.set_output_embeddings(torch.nn.Identity())
    torch.manual_seed(derived_seed("lora-init", args.seed))
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_pattern(),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora).train()
    windows = load_windows(args.train_data)
    sampler = TaskRoleSampler(windows.tags(), seed=args.seed, p_orch=args.p_orch)
    draws = [sampler.draw(step=0, rank=rank, micro=0, grad_accum=1) for rank in range(2)]
    loss_sum, tokens = 0.0, 0
    for d in draws:
        torch.manual_seed(derived_seed("dropout", args.seed, d.rank, d.draw))
        window = windows.windows[d.window]
        hidden = model(input_ids=torch.tensor(window.input_ids, dtype=torch.long)[None]).logits
        total, count = chunked_next_token_loss(
            hidden, torch.tensor(window.labels, dtype=torch.long), head, chunk=args.ce_chunk
        )
        (total / count / len(draws)).backward()
        loss_sum, tokens = loss_sum + total.item(), tokens + count
    norm = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in model.parameters() if p.requires_grad))
    first = _train_rows(runs["full"])[0]
    assert first["tokens"] == tokens
    assert first["loss"] == pytest.approx(loss_sum / tokens, rel=1e-4)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-3)  # bf16 forward on both sides; fp32 reductions
