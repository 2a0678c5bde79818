"""`TrainArgs`: every knob of one LoRA SFT run (MASS_SPEC §8), read from the JSON file the trainer is started with.

The defaults are the paper's constants. The file is plain data so that the stage that launches training (locally,
as a Kubernetes Job or a TrainJob) writes it once and every rank of every node reads the same thing.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from mass_ops.errors import InputError
from mass_ops.train.lora_targets import (
    REFERENCE_TARGET_MODULES,
    REFERENCE_TARGET_PATTERN,
    LoraTargetError,
    lora_target_pattern,
)

# Kept under its old name: the reference's regex, verbatim (multimodal Qwen3.5/3.6 checkpoints only).
PAPER_TARGET_MODULES = REFERENCE_TARGET_PATTERN


class TrainArgsError(InputError):
    """A training argument file that cannot be used; the message names the field and the rule."""


@dataclass
class TrainArgs:
    """One training run. Paths are local to the machine that runs the ranks (the launching stage stages data in).

    Batch geometry: one window per rank per micro-step, so an optimizer step averages
    `world_size × grad_accum` per-window token-mean losses (the paper: 3 ranks × 1).
    """

    model_dir: str
    """BF16 parent (config, safetensors shards); frozen, never written."""
    train_data: str
    """Window JSONL (MASS_SPEC §7), one window per line."""
    out_dir: str
    """Receives args.json, train_log.jsonl, exposure_log.jsonl, resume_log.jsonl and step_NNNNN/ checkpoints."""
    val_data: str | None = None
    """Validation window JSONL (rank-16 trajectories); None disables validation and checkpoint selection."""

    steps: int = 1624
    """Optimizer steps."""
    lr: float = 3e-5
    """Peak learning rate."""
    warmup_steps: int = 5
    """Linear warmup: step s (0-based) uses lr·(s+1)/warmup_steps."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of the peak, reached at the last step."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (DeepSpeed `gradient_clipping`); 0 disables it."""

    lora_r: int = 64
    lora_alpha: int = 128
    lora_dropout: float = 0.05
    target_modules: str | list[str] = field(default_factory=lambda: list(REFERENCE_TARGET_MODULES))
    """A list of projection names (q_proj, …, in_proj_qkv, in_proj_z, out_proj), turned into a regex by
    `lora_target_pattern` (language model only: never the vision tower or MTP heads), or a regex used as is
    (fullmatch against module names, as PEFT does)."""

    grad_accum: int = 1
    """Micro-steps per optimizer step on every rank."""
    ce_chunk: int = 512
    """Tokens per cross-entropy chunk (fp32 logits for one chunk at a time)."""
    seed: int = 1234
    """Seeds the sampler draws, LoRA initialisation and dropout masks."""
    sampler: Literal["task_role"] = "task_role"
    """`task_role`: uniform task, then orchestrator windows with p_orch, else worker + auxiliary windows."""
    p_orch: float = 1 / 3

    save_every: int = 50
    """Checkpoint every N steps; the last step is always saved."""
    val_every: int = 150
    """Validate every N steps; the last step is always validated."""
    val_at_start: bool = True
    """Validate before the first update (step 0, never a checkpoint candidate)."""

    zero_stage: Literal[3] = 3
    zero3_init: bool = True
    """Load the parent under `deepspeed.zero.Init` so no rank ever holds the whole model."""
    autocast_bf16: bool = True
    """bf16 compute: the parent, activations and the adapters' working copy in bf16 (DeepSpeed `bf16`), fp32
    master adapters and Adam moments in the optimizer. False: fp32 throughout (debugging only)."""
    gradient_checkpointing: bool | Literal["full", "selective", "off"] = True
    """Non-reentrant activation checkpointing of decoder layers: `full` (or true) every layer, `selective` every
    other layer (half the recompute; the other layers keep their activations), `off` (or false) none."""
    peak_tflops_per_gpu: float | None = None
    """Dense BF16 peak of one GPU (TFLOP/s) that MFU is measured against; None: MFU is not reported."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """`auto`: flash_attention_2 on CUDA when the flash_attn package imports, else sdpa (mass_ops.train.efficiency)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Pack the windows a rank draws for one optimizer step into as few micro-batches as `pack_tokens` allows, with
    per-window boundaries (mass_ops.train.packing). `on` refuses a model whose layers cannot see the boundaries;
    `auto` falls back to one window per micro-batch for such a model; `off` never packs."""
    pack_tokens: int | None = None
    """Token budget of a packed micro-batch, every pack padded to it (fixed shapes); None: the longest window."""
    warmup_measure_steps: int = 2
    """Steps at the start of this process that the throughput summary names and leaves out of its figures."""
    zero3_persistence_threshold: int | None = None
    """ZeRO-3 `stage3_param_persistence_threshold`; None: the largest LoRA tensor + 1 (mass_ops.train.zero)."""
    zero3_overlap_comm: bool = True
    """ZeRO `overlap_comm` on accelerators (always off on CPU)."""
    zero3_prefetch_bucket_size: int = 100_000_000
    """ZeRO-3 `stage3_prefetch_bucket_size`: parameters gathered ahead of their use (about one 4B decoder layer)."""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """DeepSpeed accelerator; `cpu` runs on gloo (tests, the laptop demo)."""
    deepspeed_overrides: dict[str, Any] = field(default_factory=dict)
    """Merged over the generated DeepSpeed config (bucket sizes, offload); batch, precision and clip keys are
    owned by this file and may not be overridden."""
    dist_timeout_s: int = 1800

    resume_from: str | None = None
    """A `step_NNNNN` directory of this run: restores adapters, optimizer, step and exposure counts exactly."""

    # ------------------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        problems: list[str] = []

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                problems.append(f"{name}: {rule} (got {getattr(self, name)!r})")

        for name in (
            "steps",
            "lora_r",
            "lora_alpha",
            "grad_accum",
            "ce_chunk",
            "save_every",
            "val_every",
            "dist_timeout_s",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "must be a positive int")
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                name,
                "must be a non-negative int",
            )
        for name in (
            "lr",
            "min_lr_ratio",
            "lora_dropout",
            "p_orch",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "weight_decay",
            "max_grad_norm",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
                name,
                "must be a finite number",
            )
        if not problems:
            need(self.lr > 0, "lr", "must be > 0")
            need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must lie in [0, 1]")
            need(0 <= self.lora_dropout < 1, "lora_dropout", "must lie in [0, 1)")
            need(0 <= self.p_orch <= 1, "p_orch", "must lie in [0, 1]")
            need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1", "betas must lie in [0, 1)")
            need(self.adam_eps > 0, "adam_eps", "must be > 0")
            need(
                self.weight_decay >= 0 and self.max_grad_norm >= 0,
                "weight_decay",
                "weight_decay and max_grad_norm must be >= 0",
            )
            need(self.warmup_steps < self.steps, "warmup_steps", f"must be below steps ({self.steps})")
        need(self.sampler == "task_role", "sampler", "must be 'task_role'")
        need(self.zero_stage == 3, "zero_stage", "must be 3")
        need(self.accelerator in ("auto", "cpu", "cuda"), "accelerator", "must be auto, cpu or cuda")
        for name in ("zero3_init", "autocast_bf16", "val_at_start", "zero3_overlap_comm"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")
        need(
            isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing in _CHECKPOINTING,
            "gradient_checkpointing",
            "must be true, false, full, selective or off",
        )
        need(self.attn_implementation in _ATTENTION, "attn_implementation", f"must be one of {list(_ATTENTION)}")
        need(self.packing in ("auto", "on", "off"), "packing", "must be auto, on or off")
        for name in ("pack_tokens", "zero3_persistence_threshold"):
            value = getattr(self, name)
            need(value is None or (type(value) is int and value > 0), name, "must be null or a positive int")
        need(
            type(self.warmup_measure_steps) is int and self.warmup_measure_steps >= 0,
            "warmup_measure_steps",
            "must be a non-negative int",
        )
        need(
            type(self.zero3_prefetch_bucket_size) is int and self.zero3_prefetch_bucket_size >= 0,
            "zero3_prefetch_bucket_size",
            "must be a non-negative int",
        )
        for name in ("model_dir", "train_data", "out_dir"):
            need(isinstance(getattr(self, name), str) and bool(getattr(self, name)), name, "must be a non-empty path")
        need(isinstance(self.deepspeed_overrides, dict), "deepspeed_overrides", "must be an object")
        if isinstance(self.deepspeed_overrides, dict):
            owned = sorted(set(self.deepspeed_overrides) & _OWNED_DEEPSPEED_KEYS)
            if owned:
                problems.append(f"deepspeed_overrides: keys {owned} are set from this file's own fields")
        try:
            self.target_pattern()
        except TrainArgsError as exc:
            problems.append(str(exc))
        if problems:
            raise TrainArgsError("; ".join(problems))

    def target_pattern(self) -> str:
        """The regex PEFT fullmatches against module names to choose the adapted projections."""
        spec = self.target_modules
        if isinstance(spec, str):
            try:
                re.compile(spec)
            except re.error as exc:
                raise TrainArgsError(f"target_modules: not a valid regex ({exc})") from None
            return spec
        if not isinstance(spec, list):
            raise TrainArgsError(f"target_modules: must be a regex or a non-empty list of module names ({spec!r})")
        try:
            return lora_target_pattern(spec)
        except LoraTargetError:
            raise TrainArgsError(
                f"target_modules: must be a regex or a non-empty list of module names ({spec!r})"
            ) from None

    @property
    def checkpointing(self) -> str:
        """The activation-checkpointing mode: full, selective or off."""
        value = self.gradient_checkpointing
        return ("full" if value else "off") if isinstance(value, bool) else value

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_r

    # ------------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        """Write the args atomically (temp file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "training args") -> TrainArgs:
        if not isinstance(data, dict):
            raise TrainArgsError(f"{source}: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainArgsError(f"{source}: unknown keys {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.name in _REQUIRED and f.name not in data)
        if missing:
            raise TrainArgsError(f"{source}: missing keys {missing}")
        try:
            return cls(**data)
        except TrainArgsError as exc:
            raise TrainArgsError(f"{source}: {exc}") from None

    @classmethod
    def read(cls, path: str | Path) -> TrainArgs:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TrainArgsError(f"{path}: training args file not found") from None
        except json.JSONDecodeError as exc:
            raise TrainArgsError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))


_REQUIRED = frozenset({"model_dir", "train_data", "out_dir"})
_CHECKPOINTING = ("full", "selective", "off")
_ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2")
_OWNED_DEEPSPEED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "bf16",
        "fp16",
        "optimizer",
        "scheduler",
    }
)
