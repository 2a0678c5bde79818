"""LoRA SFT of a frozen BF16 parent on DeepSpeed ZeRO-3 (MASS_SPEC §8): the script every rank runs.

    python -m mass_ops.train.trainer --args args.json      # started by torchrun or the deepspeed launcher

`grad_accum` windows per rank per step, one per micro-batch or packed (mass_ops.train.packing); each window's loss is
its own token mean ÷ `grad_accum`, DeepSpeed averages ranks: a step averages `world_size × grad_accum` per-window
token means. The logged loss is the token-weighted mean; throughput.json the steady state (mass_ops.train.metrics).
Exact resume: sampler draws are a pure function of (seed, rank, draw), dropout is reseeded from the same triple every
micro-step, and the DeepSpeed checkpoint restores fp32 master weights, Adam moments and the LR scheduler. How ZeRO-3
and PEFT are made to work together: docs/training.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mass_ops.errors import InputError
from mass_ops.train.adapters import AdapterSaveError, gather_lora_fp32, write_adapters
from mass_ops.train.args import TrainArgs, TrainArgsError
from mass_ops.train.checkpoints import (
    ENGINE_DIR,
    LORA_STATE_FILE,
    TRAIN_LOG_FILE,
    TRAIN_STATE_FILE,
    checkpoint_dir,
    is_complete,
)
from mass_ops.train.data import TrainingWindow, WindowDataError, WindowSet, load_windows
from mass_ops.train.efficiency import apply_checkpointing, choose_attention
from mass_ops.train.flops import ArchitectureError, FlopsModel, read_flops_model, step_throughput
from mass_ops.train.lora_targets import LoraTargetError, LoraTargetSummary, summarize_lora_targets
from mass_ops.train.metrics import PhaseClock, describe, summarize, write_summary
from mass_ops.train.packing import (
    PackedBatch,
    has_linear_attention,
    model_inputs,
    pack_windows,
    packing_enabled,
    plan_packs,
    split_to,
    window_losses,
)
from mass_ops.train.sampler import Draw, Exposure, TaskRoleSampler, draw_index
from mass_ops.train.schedule import lr_at, lr_factor
from mass_ops.train.zero import deepspeed_config

if TYPE_CHECKING:
    import torch

log = logging.getLogger("mass_ops.train")

ARGS_FILE = "args.json"
LORA_TARGETS_FILE = "lora_targets.json"
# The train_log row (no `step`, so loss readers skip it) that records what LoRA adapts.
LORA_TARGETS_EVENT = "lora_targets"
EXPOSURE_LOG_FILE = "exposure_log.jsonl"
RESUME_LOG_FILE = "resume_log.jsonl"
ENGINE_TAG = "state"
# Args whose change would alter the training trajectory; a resume must keep them.
_TRAJECTORY_FIELDS = (
    "model_dir",
    "train_data",
    "val_data",
    "steps",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "weight_decay",
    "max_grad_norm",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_regex",
    "grad_accum",
    "ce_chunk",
    "seed",
    "sampler",
    "p_orch",
    "autocast_bf16",
    "packing",
    "pack_tokens",
)


class TrainingError(InputError):
    """A run that cannot start or continue (existing log, mismatched resume, …); the message says why."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------------------------------------------------------
# small helpers


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from the joined parts (LoRA init: ("lora-init", seed); dropout: ("dropout", seed, rank, draw))."""
    digest = hashlib.sha256("-".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, sort_keys=True) + "\n")
        handle.flush()


def _truncate_jsonl(path: Path, keep_through_step: int) -> int:
    """Drop rows logged after `keep_through_step` (they belong to the abandoned continuation); returns rows dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for text in path.read_text(encoding="utf-8").splitlines():
        if not text.strip():
            continue
        row = json.loads(text)
        if isinstance(row.get("step"), int) and row["step"] > keep_through_step:
            dropped += 1
        else:
            kept.append(text)
    _atomic_write_text(path, "".join(t + "\n" for t in kept))
    return dropped


# ---------------------------------------------------------------------------------------------------------------------
# distributed setup and model


def _init_distributed(args: TrainArgs) -> Ranks:
    if args.accelerator != "auto":
        os.environ["DS_ACCELERATOR"] = args.accelerator
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    deepspeed.init_distributed(
        dist_backend=accelerator.communication_backend_name(), timeout=timedelta(seconds=args.dist_timeout_s)
    )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank)


def _model_class(model_dir: str) -> Any:
    """The architecture named in the parent's config (e.g. Qwen3_5ForConditionalGeneration keeps its
    `language_model` prefix, so LoRA keys match the parent's own tensor names at merge time)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM


def _vocab_size(model_dir: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(config.get_text_config().vocab_size)


def build_lora_model(
    args: TrainArgs, ds_config: dict[str, Any], *, attention: str | None = None
) -> tuple[Any, torch.Tensor, Any, LoraTargetSummary]:
    """Load the frozen parent (under zero.Init when `zero3_init`) with the `attention` implementation (default: the
    args' choice, `auto` read as sdpa), take out its output projection, checkpoint activations per
    `args.checkpointing`, add LoRA.

    Returns (peft model, frozen output-projection weight [V, H], the HfDeepSpeedConfig that must stay alive, what the
    target pattern adapts). Raises `TrainingError` when the pattern adapts nothing or PEFT adapts something else.
    """
    import deepspeed
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    # transformers consults this object (through a weak reference) during from_pretrained: keep it referenced.
    hf_ds_config = HfDeepSpeedConfig(ds_config) if args.zero3_init else None  # type: ignore[no-untyped-call]
    dtype = torch.bfloat16 if args.autocast_bf16 else torch.float32
    if attention is None:
        attention = "sdpa" if args.attention == "auto" else args.attention
    model = _model_class(args.model_dir).from_pretrained(args.model_dir, dtype=dtype, attn_implementation=attention)
    model.requires_grad_(False)
    model.config.use_cache = False

    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise TrainingError(f"{args.model_dir}: expected a bias-free linear output projection")
    weight = head.weight
    if hasattr(weight, "ds_id"):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            lm_weight = weight.detach().clone()
    else:
        lm_weight = weight.detach().clone()
    # The model now returns final hidden states; `chunked_next_token_loss` applies lm_weight chunk by chunk.
    model.set_output_embeddings(torch.nn.Identity())

    apply_checkpointing(model, args.checkpointing)

    pattern = args.target_pattern()
    try:
        targets = summarize_lora_targets(model, pattern, lora_r=args.lora_r)
    except LoraTargetError as exc:
        raise TrainingError(f"{args.model_dir}: {exc}") from None
    if targets.modules == 0:
        raise TrainingError(
            f"{args.model_dir}: LoRA target pattern {pattern!r} matches none of its {targets.linear_modules} Linear "
            "modules; refusing to train nothing"
        )

    # Same LoRA initialisation on every rank (ZeRO also broadcasts rank 0's copy when it partitions them).
    torch.manual_seed(derived_seed("lora-init", args.seed))
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        bias="none",
        target_modules=pattern,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    stray = [n for n, _ in trainable if ".lora_" not in n]
    if stray:
        raise TrainingError(f"unexpected trainable parameters besides LoRA: {stray[:5]}")
    # PEFT must have adapted exactly what the summary names (ZeRO-3 keeps the full size in ds_numel).
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for _, p in trainable)
    if len(trainable) != targets.lora_tensors or numel != targets.adapter_parameters:
        raise TrainingError(
            f"{args.model_dir}: PEFT created {len(trainable)} LoRA tensors ({numel} parameters) where the target "
            f"pattern names {targets.lora_tensors} ({targets.adapter_parameters})"
        )
    return peft_model, lm_weight, hf_ds_config, targets


# ---------------------------------------------------------------------------------------------------------------------
# the run


class LoraSftRun:
    """One training run on this rank: data, sampler, engine, logs and checkpoints."""

    def __init__(self, args: TrainArgs, ranks: Ranks) -> None:
        self.args = args
        self.ranks = ranks
        self.out_dir = Path(args.out_dir)
        self.train_log = self.out_dir / TRAIN_LOG_FILE
        self.exposure_log = self.out_dir / EXPOSURE_LOG_FILE
        self.start_step = 0
        self.elapsed_before = 0.0
        self.train_started = 0.0  # perf_counter when `train` began; `_elapsed` counts from it
        self.exposure = Exposure()
        self.last_loss: float | None = None
        self.setup_s: dict[str, float] = {}
        self.step_rows: list[dict[str, Any]] = []

    # -- setup ----------------------------------------------------------------------------------------------------
    def _check_start(self) -> dict[str, Any] | None:
        """Refuse to overwrite a run; for a resume, load and check its train_state. Same answer on every rank."""
        args = self.args
        if args.resume_from is None:
            if self.train_log.exists():
                raise TrainingError(
                    f"{self.train_log} exists: this run already started (set resume_from to a step_NNNNN directory)"
                )
            return None
        step_dir = Path(args.resume_from)
        if not is_complete(step_dir):
            raise TrainingError(f"{step_dir}: not a complete checkpoint (adapters or {TRAIN_STATE_FILE} missing)")
        state: dict[str, Any] = json.loads((step_dir / TRAIN_STATE_FILE).read_text())
        problems = []
        if state.get("world_size") != self.ranks.world_size:
            problems.append(
                f"saved with {state.get('world_size')} ranks, resumed with {self.ranks.world_size} "
                "(ZeRO-3 optimizer partitions are per rank)"
            )
        saved_args = state.get("args", {})
        changed = [f for f in _TRAJECTORY_FIELDS if f in saved_args and saved_args[f] != getattr(args, f)]
        if changed:
            problems.append(f"args changed since the checkpoint: {changed}")
        if not 0 < int(state.get("step", 0)) <= args.steps:
            problems.append(f"checkpoint step {state.get('step')} outside 1..{args.steps}")
        if problems:
            raise TrainingError(f"cannot resume from {step_dir}: " + "; ".join(problems))
        return state

    def setup(self) -> None:
        import deepspeed
        import torch
        from deepspeed.accelerator import get_accelerator

        args, ranks = self.args, self.ranks
        resume_state = self._check_start()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        clock = time.perf_counter()

        # Data first: a bad window file fails in seconds, before the parent is loaded.
        vocab = _vocab_size(args.model_dir)
        self.train_set = load_windows(args.train_data, vocab_size=vocab)
        self.val_set: WindowSet | None = load_windows(args.val_data, vocab_size=vocab) if args.val_data else None
        self.sampler = TaskRoleSampler(self.train_set.tags(), seed=args.seed, p_orch=args.p_orch)
        self.setup_s["data"] = round(time.perf_counter() - clock, 3)

        clock = time.perf_counter()
        device_type = get_accelerator().device_name()
        self.attention = choose_attention(args.attention, device_type)
        self.ds_config = deepspeed_config(args, ranks.world_size, on_cpu=device_type == "cpu")
        self.peft_model, lm_weight, self._hf_ds_config, self.lora_targets = build_lora_model(
            args, self.ds_config, attention=self.attention
        )
        self.setup_s["model"] = round(time.perf_counter() - clock, 3)
        clock = time.perf_counter()
        self.packing = packing_enabled(self.peft_model, args.packing, args.grad_accum, device=device_type)
        self.linear_attention = has_linear_attention(self.peft_model)
        self.pack_tokens = args.pack_tokens or max(w.n_tokens for w in self.train_set.windows)
        if lm_weight.shape[0] != vocab:
            raise TrainingError(f"{args.model_dir}: output projection has {lm_weight.shape[0]} rows, config {vocab}")

        trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable,
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(
                s, warmup_steps=args.warmup_steps, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio
            ),
        )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.peft_model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=self.ds_config,
            dist_init_required=False,
        )
        # CPU kernels have no fast bf16 GEMM for vocabulary-sized reductions (orders of magnitude slower than fp32),
        # so on CPU the output projection runs in fp32; accelerators keep the parent's dtype, as the reference does.
        on_cpu = torch.device(self.engine.device).type == "cpu"
        self.lm_weight = lm_weight.to(self.engine.device, torch.float32 if on_cpu else lm_weight.dtype)
        self.flops_model, self.peak_tflops_per_gpu = self._flops_reference(on_cpu)
        self.setup_s["engine"] = round(time.perf_counter() - clock, 3)

        if resume_state is not None:
            assert args.resume_from is not None  # a resume state is only read from it
            self._restore(Path(args.resume_from), resume_state)
        elif ranks.is_main:
            args.write(self.out_dir / ARGS_FILE)
            self._record_lora_targets()
        if ranks.is_main:
            log.info("%s; pattern %s", self.lora_targets.describe(), self.lora_targets.pattern)
            log.info(
                "attention %s, activation checkpointing %s, packing %s, setup %s",
                self.attention,
                args.checkpointing,
                f"on ({self.pack_tokens} tokens per micro-batch)" if self.packing else "off",
                self.setup_s,
            )
            log.info(
                "train windows %d (%d label-free dropped), val windows %d, tasks %s, ranks %d × grad_accum %d",
                len(self.train_set),
                self.train_set.dropped_unsupervised,
                len(self.val_set or []),
                self.sampler.tasks,
                ranks.world_size,
                args.grad_accum,
            )
        self._barrier()

    def _flops_reference(self, on_cpu: bool) -> tuple[FlopsModel | None, float | None]:
        """The architecture's FLOPs model and the per-GPU peak MFU is measured against.

        An architecture the FLOPs model cannot read costs the FLOPs fields, never the run. CPU runs log no MFU:
        the peak is a GPU's tensor-core figure. `peak_tflops_per_gpu` comes from `training.peak_tflops_per_gpu`
        through the args file; null logs no MFU (achieved TFLOP/s are logged either way).
        """
        try:
            model: FlopsModel | None = read_flops_model(self.args.model_dir)
        except ArchitectureError as exc:
            log.warning("no FLOPs figures: %s", exc)
            model = None
        peak = self.args.peak_tflops_per_gpu
        return model, None if on_cpu else peak

    def _record_lora_targets(self) -> None:
        """`lora_targets.json` beside args.json, and the same summary as the first train_log row (no `step`)."""
        summary = self.lora_targets.as_dict()
        _atomic_write_text(self.out_dir / LORA_TARGETS_FILE, json.dumps(summary, indent=2, sort_keys=True) + "\n")
        _append_jsonl(self.train_log, {"event": LORA_TARGETS_EVENT, **summary})

    def _restore(self, step_dir: Path, state: dict[str, Any]) -> None:
        """Load engine state, check the restored adapters equal the saved fp32 tensors, trim the logs."""
        import torch
        from safetensors.torch import load_file

        load_path, _ = self.engine.load_checkpoint(
            str(step_dir / ENGINE_DIR),
            tag=ENGINE_TAG,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise TrainingError(f"{step_dir / ENGINE_DIR}: DeepSpeed found no checkpoint to load")
        self.start_step = int(state["step"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.exposure = Exposure.from_dict(state.get("exposure", {}))
        self.last_loss = state.get("loss")
        restored = gather_lora_fp32(self.peft_model, self.ranks)
        error = None
        if self.ranks.is_main:
            saved = load_file(str(step_dir / LORA_STATE_FILE))
            mismatched = [n for n, t in saved.items() if n not in restored or not torch.equal(restored[n], t)]
            if mismatched or len(saved) != len(restored):
                error = f"{step_dir}: restored adapters differ from {LORA_STATE_FILE}: {mismatched[:3]}"
        self._raise_together(error, TrainingError)
        if self.ranks.is_main:
            dropped = _truncate_jsonl(self.train_log, self.start_step) + _truncate_jsonl(
                self.exposure_log, self.start_step
            )
            superseded = self._set_aside_later_checkpoints()
            _append_jsonl(
                self.out_dir / RESUME_LOG_FILE,
                {
                    "resumed_from": str(step_dir),
                    "step": self.start_step,
                    "time": time.time(),
                    "log_rows_dropped": dropped,
                    "superseded_checkpoints": superseded,
                    "world_size": self.ranks.world_size,
                },
            )
            log.info("resumed at step %d from %s", self.start_step, step_dir)

    def _set_aside_later_checkpoints(self) -> list[str]:
        later = [
            d
            for d in sorted(self.out_dir.glob("step_[0-9]*"))
            if d.is_dir() and d.name.removeprefix("step_").isdigit() and int(d.name[5:]) > self.start_step
        ]
        if not later:
            return []
        aside = self.out_dir / f"superseded-at-{self.start_step:05d}-{int(time.time())}"
        aside.mkdir()
        for d in later:
            d.rename(aside / d.name)
        return [str(aside / d.name) for d in later]

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _raise_together(self, error: str | None, kind: type[Exception]) -> None:
        """Share a failure seen on one rank, so every rank raises it instead of waiting in the next collective."""
        import torch.distributed as dist

        errors: list[str | None] = [None] * self.ranks.world_size
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e), None)
        if first is not None:
            raise kind(first)

    # -- forward ---------------------------------------------------------------------------------------------------
    def _window_loss(self, index: int, windows: WindowSet, *, recompute: bool) -> tuple[torch.Tensor, int]:
        import torch

        from mass_ops.train.loss import chunked_next_token_loss

        window = windows.windows[index]
        ids = torch.from_numpy(window.input_ids).to(self.engine.device, torch.long).unsqueeze(0)
        labels = torch.from_numpy(window.labels).to(self.engine.device, torch.long)
        hidden = self.engine(input_ids=ids, use_cache=False).logits
        return chunked_next_token_loss(hidden, labels, self.lm_weight, chunk=self.args.ce_chunk, recompute=recompute)

    def _micro_batches(self, step: int) -> list[list[Draw]]:
        """This rank's draws of `step` grouped into micro-batches: one window each, or packed — then split so every
        rank runs as many micro-batches as the rank needing most (plans are pure functions of the draws)."""
        args = self.args

        def draws(rank: int) -> list[Draw]:
            return self.sampler.draws_for_step(step=step, rank=rank, grad_accum=args.grad_accum)

        mine = draws(self.ranks.rank)
        if not self.packing:
            return [[d] for d in mine]

        def plan(ds: list[Draw]) -> list[list[int]]:
            return plan_packs([self.train_set.windows[d.window].n_tokens for d in ds], self.pack_tokens)

        count = max(len(plan(draws(r))) for r in range(self.ranks.world_size))
        return [[mine[i] for i in pack] for pack in split_to(plan(mine), count)]

    def _packed_losses(self, draws: list[Draw]) -> tuple[list[tuple[torch.Tensor, int]], int]:
        """(loss sum, targets) of each window of one packed forward, and the padding tokens it carried."""
        import torch

        windows = [self.train_set.windows[d.window] for d in draws]
        batch: PackedBatch = pack_windows([w.input_ids for w in windows], self.pack_tokens, pad_id=0)
        kwargs = model_inputs(
            batch,
            self.attention,
            device=self.engine.device,
            dtype=torch.bfloat16 if self.args.autocast_bf16 else torch.float32,
            linear_attention=self.linear_attention,
        )
        hidden = self.engine(**kwargs).logits
        labels = [w.labels for w in windows]
        losses = window_losses(hidden, batch, labels, self.lm_weight, chunk=self.args.ce_chunk, recompute=True)
        return losses, batch.pad

    # -- validation ------------------------------------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, Any]:
        """Round-robin the validation windows over ranks; every rank runs the same number of forwards (ZeRO-3
        gathers are collectives), padding with its shortest window without counting it."""
        import torch
        import torch.distributed as dist

        assert self.val_set is not None
        started = time.perf_counter()
        windows, ranks = self.val_set, self.ranks
        n = len(windows)
        per_rank = math.ceil(n / ranks.world_size)
        pad = min(range(n), key=lambda i: windows.windows[i].n_tokens)
        results: list[tuple[int, float, int]] = []
        self.engine.eval()
        with torch.no_grad():
            for k in range(per_rank):
                index = k * ranks.world_size + ranks.rank
                loss_sum, count = self._window_loss(index if index < n else pad, windows, recompute=False)
                if index < n:
                    results.append((index, float(loss_sum), count))
        self.engine.train()
        gathered: list[list[tuple[int, float, int]]] = [[] for _ in range(ranks.world_size)]
        dist.all_gather_object(gathered, results)
        rows = sorted(r for part in gathered for r in part)

        def breakdown(key: Callable[[TrainingWindow], object]) -> dict[str, dict[str, float | int]]:
            sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for index, loss_sum, count in rows:
                entry = sums[str(key(windows.windows[index]))]
                entry[0] += loss_sum
                entry[1] += count
            return {
                k: {"loss": v[0] / v[1] if v[1] else float("nan"), "tokens": int(v[1])} for k, v in sorted(sums.items())
            }

        total_loss = sum(r[1] for r in rows)
        total_tokens = sum(r[2] for r in rows)
        return {
            "step": step,
            "val_loss": total_loss / total_tokens if total_tokens else float("nan"),
            "val_tokens": int(total_tokens),
            "val_windows": len(rows),
            "val_by_role": breakdown(lambda w: w.role),
            "val_by_task": breakdown(lambda w: w.task),
            "val_per_episode": breakdown(lambda w: w.episode),
            "val_seconds": round(time.perf_counter() - started, 3),
        }

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, step: int, lr: float, elapsed: float) -> Path:
        """Write step_NNNNN/ into a hidden staging directory, then publish it by rename (rank 0) once complete."""
        args, ranks = self.args, self.ranks
        final = checkpoint_dir(self.out_dir, step)
        staging = self.out_dir / f".{final.name}.partial"
        if ranks.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self._barrier()
        self.engine.save_checkpoint(
            str(staging / ENGINE_DIR),
            tag=ENGINE_TAG,
            client_state={"step": step},
            save_latest=False,
            exclude_frozen_parameters=True,
        )
        tensors = gather_lora_fp32(self.peft_model, ranks)
        error = None
        if ranks.is_main:
            try:
                write_adapters(
                    self.peft_model, tensors, staging, args.lora_r, expected_tensors=self.lora_targets.lora_tensors
                )
            except (AdapterSaveError, OSError) as exc:
                error = f"checkpoint step {step} not published: {exc}"
        self._raise_together(error, AdapterSaveError)
        if ranks.is_main:
            state = {
                "step": step,
                "total_steps": args.steps,
                "lr": lr,
                "next_lr": lr_at(
                    step,
                    peak=args.lr,
                    warmup_steps=args.warmup_steps,
                    total_steps=args.steps,
                    min_lr_ratio=args.min_lr_ratio,
                )
                if step < args.steps
                else None,
                "loss": self.last_loss,
                "elapsed_s": elapsed,
                "world_size": ranks.world_size,
                "grad_accum": args.grad_accum,
                "windows_per_step": ranks.world_size * args.grad_accum,
                "sampler": {
                    "kind": args.sampler,
                    "seed": args.seed,
                    "p_orch": args.p_orch,
                    "next_draw": draw_index(step, 0, args.grad_accum),
                },
                "exposure": self.exposure.to_dict(),
                "lora_tensors": len(tensors),
                "lora_modules_by_kind": self.lora_targets.by_kind,
                "lora_parameters": sum(t.numel() for t in tensors.values()),
                "args": args.to_dict(),
            }
            _atomic_write_text(staging / TRAIN_STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
        self._barrier()
        return final

    # -- training --------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Validate at the start when asked, then optimizer steps from `start_step`, validating and saving on the
        configured cadence (and always at the last step); rank 0 writes throughput.json at the end."""
        args, ranks = self.args, self.ranks
        self.train_started = time.perf_counter()
        if self.val_set is not None and args.val_at_start and self.start_step == 0:
            self._validate_and_log(0)
        self.engine.train()
        for step in range(self.start_step, args.steps):
            lr = self._optimizer_step(step)
            done = step + 1
            last = done == args.steps
            if self.val_set is not None and (done % args.val_every == 0 or last):
                self._validate_and_log(done)
            if done % args.save_every == 0 or last:
                path = self.save(done, lr, self._elapsed())
                if ranks.is_main:
                    log.info("saved %s", path)
        if ranks.is_main:
            self._write_throughput()

    def _elapsed(self) -> float:
        """Training seconds of the whole run: those before a resume plus this process's."""
        return round(self.elapsed_before + time.perf_counter() - self.train_started, 3)

    def _validate_and_log(self, step: int) -> None:
        row = self.validate(step)
        if self.ranks.is_main:
            _append_jsonl(self.train_log, row)
            log.info("step %d val_loss %.4f over %d tokens", step, row["val_loss"], row["val_tokens"])

    def _optimizer_step(self, step: int) -> float:
        """One optimizer step (0-based `step`) over this rank's micro-batches; rank 0 logs it. Returns its lr."""
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        args, ranks = self.args, self.ranks
        step_started = time.perf_counter()
        clock = PhaseClock(get_accelerator().synchronize)
        with clock.phase("data_s"):
            micro_batches = self._micro_batches(step)
        draws = [d for batch in micro_batches for d in batch]
        lr = float(self.optimizer.param_groups[0]["lr"])
        # Loss sum, loss tokens, input tokens, padding tokens; on the engine's device, where the backend's
        # collectives run (NCCL has no CPU tensors).
        local = torch.zeros(4, dtype=torch.float64, device=self.engine.device)
        for k, batch in enumerate(micro_batches):
            # Dropout masks depend only on (seed, rank, draw): a resumed run reproduces them.
            torch.manual_seed(derived_seed("dropout", args.seed, ranks.rank, batch[0].draw))
            pad = 0
            with clock.phase("forward_s"):
                if self.packing:
                    losses, pad = self._packed_losses(batch)
                else:
                    losses = [self._window_loss(batch[0].window, self.train_set, recompute=True)]
                # The mean of per-window token means over the step's windows (DeepSpeed then averages ranks).
                loss = sum(total / count for total, count in losses) / args.grad_accum
            with clock.phase("backward_s"):
                self.engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
                self.engine.backward(loss, scale_wrt_gas=False)
            with clock.phase("optimizer_s"):
                self.engine.step()
            for (total, count), d in zip(losses, batch, strict=True):
                local += torch.tensor(
                    [total.item(), count, self.train_set.windows[d.window].n_tokens, 0],
                    dtype=torch.float64,
                    device=local.device,
                )
            local[3] += pad
        dist.all_reduce(local)
        gathered: list[list[dict[str, Any]]] = [[] for _ in range(ranks.world_size)]
        dist.all_gather_object(gathered, [d.__dict__ for d in draws])
        step_draws = [drawn for part in gathered for drawn in part]
        self.exposure.add(Draw(**drawn) for drawn in step_draws)
        self.last_loss = float(local[0] / local[1])
        grad_norm = self.engine.get_global_grad_norm()
        if ranks.is_main:
            step_s = time.perf_counter() - step_started
            tokens = (int(local[1]), int(local[2]), int(local[3]))
            self._log_step(step + 1, lr, grad_norm, tokens, step_draws, len(micro_batches), clock, step_s)
        return lr

    def _log_step(
        self,
        done: int,
        lr: float,
        grad_norm: Any,
        tokens: tuple[int, int, int],
        step_draws: list[dict[str, Any]],
        micro_batches: int,
        clock: PhaseClock,
        step_s: float,
    ) -> None:
        """Rank 0: the step's train_log row (loss, throughput, phases, memory), its exposure row and one log line.
        `tokens` = (loss, input, padding) tokens of the step over every rank."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        windows = self.train_set.windows
        window_tokens: dict[int, list[int]] = defaultdict(list)
        for drawn in step_draws:
            window_tokens[drawn["rank"]].append(windows[drawn["window"]].n_tokens)
        throughput = step_throughput(
            window_tokens,
            tokens[0],
            step_s,
            self.flops_model,
            world_size=self.ranks.world_size,
            peak_tflops_per_gpu=self.peak_tflops_per_gpu,
            adapter_params=self.lora_targets.adapter_parameters,
        )
        row = {
            "step": done,
            "loss": self.last_loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens": tokens[0],
            "input_tokens": tokens[1],
            "windows": len(step_draws),
            "micro_batches": micro_batches,
            "pad_tokens": tokens[2],
            "step_s": round(step_s, 4),
            # The first steps of a process build kernels, caches and lazy optimizer state: named, and left
            # out of throughput.json's figures.
            "warmup": done <= self.start_step + self.args.warmup_measure_steps,
            "phases": clock.rounded(),
            "elapsed_s": self._elapsed(),
            "peak_mem_gib": round(accelerator.max_memory_allocated() / 2**30, 3),
            "peak_reserved_gib": round(accelerator.max_memory_reserved() / 2**30, 3),
            **throughput,
        }
        _append_jsonl(self.train_log, row)
        self.step_rows.append(row)
        by_pair: dict[str, int] = defaultdict(int)
        for drawn in step_draws:
            by_pair[f"{drawn['task']}:{drawn['role']}"] += 1
        exposure = [
            {
                **{k: d[k] for k in ("rank", "micro", "draw", "window", "task", "role", "group")},
                "episode": windows[d["window"]].episode,
                "tokens": windows[d["window"]].n_tokens,
                "loss_tokens": windows[d["window"]].n_loss_tokens,
            }
            for d in step_draws
        ]
        _append_jsonl(
            self.exposure_log,
            {"step": done, "draws": exposure, "by_task_role": dict(sorted(by_pair.items())), "loss_tokens": tokens[0]},
        )
        log.info(
            "step %d/%d loss %.4f lr %.3g grad_norm %s tokens/s %.0f mfu %s",
            done,
            self.args.steps,
            self.last_loss,
            lr,
            None if grad_norm is None else f"{float(grad_norm):.4f}",
            throughput["tokens_per_s"],
            "n/a" if throughput["mfu"] is None else f"{throughput['mfu']:.1%}",
        )

    def _write_throughput(self) -> None:
        """throughput.json: the steady-state figures of this process's steps (mass_ops.train.metrics)."""
        args = self.args
        knobs = {
            "attention": self.attention,
            "activation_checkpointing": args.checkpointing,
            "packing": self.packing,
            "pack_tokens": self.pack_tokens if self.packing else None,
            "zero_optimization": {k: v for k, v in self.ds_config["zero_optimization"].items() if k != "stage"},
            "world_size": self.ranks.world_size,
            "grad_accum": args.grad_accum,
        }
        summary = summarize(
            self.step_rows,
            warmup_steps=args.warmup_measure_steps,
            peak_tflops_per_gpu=self.peak_tflops_per_gpu,
            setup_s=self.setup_s,
            knobs=knobs,
        )
        write_summary(self.out_dir, summary)
        log.info("%s", describe(summary))


def run(args: TrainArgs) -> None:
    """Train on this rank (all ranks call this with the same args)."""
    import torch.distributed as dist

    ranks = _init_distributed(args)
    logging.basicConfig(
        level=logging.INFO if ranks.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {ranks.rank}] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        training = LoraSftRun(args, ranks)
        training.setup()
        training.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mass_ops.train.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--args", required=True, help="TrainArgs JSON file")
    options = parser.parse_args(argv)
    try:
        args = TrainArgs.read(options.args)
        run(args)
    except (TrainArgsError, TrainingError, WindowDataError, AdapterSaveError) as exc:
        print(f"mass_ops.train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
