"""The `training:` section. `TrainerSettings` defines every trainer hyper-parameter once (default, rule, help text);
`TrainingConfig` adds the cycle's window geometry and launch topology, and `mass_ops.train.args.TrainArgs` adds the
paths and machine of one training job, so a knob set in the config reaches the trainer unchanged (MASS_SPEC §7, §8).

Rules that tie fields together are checked by one validator, in a fixed order, one `field: rule` line each.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, StrictBool, model_validator

from mass_ops.config.section import (
    IDENTIFIER,
    MAX_MAP_ENTRIES,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Section,
    StrictFloat,
)

# The reference's LoRA targets (MASS_SPEC §8): attention, MLP and linear-attention projections of the language model;
# `mass_ops.train.lora_targets.lora_target_pattern` turns them into the regex (vision tower and MTP never match).
DEFAULT_LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
)
# DeepSpeed keys the trainer derives from the settings (batch geometry, precision, optimizer, clipping).
OWNED_DEEPSPEED_KEYS = frozenset(
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


class TrainerSettings(Section):
    """What the LoRA SFT trainer does, whoever starts it: the fields a cycle's `training:` section and a training
    job's args file share. Defaults are the reference's constants."""

    # -- schedule and optimizer
    steps: PositiveInt = Field(
        default=1624,
        description="Optimizer steps of the LoRA run (reference 1624, about 19 h on 6 H100 for cycle 1).",
    )
    lr: Annotated[StrictFloat, Field(gt=0.0, lt=1.0)] = Field(
        default=3e-5,
        description="Peak learning rate of AdamW (reference 3e-5): linear warmup, then cosine down to min_lr_ratio × "
        "lr.",
    )
    warmup_steps: NonNegativeInt = Field(
        default=5,
        description="Steps of linear learning-rate warmup (reference 5).",
    )
    min_lr_ratio: Probability = Field(
        default=0.1,
        description="Final learning rate as a fraction of the peak at the end of the cosine (reference 0.1).",
    )
    adam_beta1: Annotated[StrictFloat, Field(ge=0.0, lt=1.0)] = Field(
        default=0.9,
        description="AdamW β1, the decay of the gradient's running mean (reference 0.9).",
    )
    adam_beta2: Annotated[StrictFloat, Field(ge=0.0, lt=1.0)] = Field(
        default=0.95,
        description="AdamW β2, the decay of the squared gradient's running mean (reference 0.95).",
    )
    adam_eps: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)] = Field(
        default=1e-8,
        description="AdamW ε added to the denominator (reference 1e-8).",
    )
    weight_decay: Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)] = Field(
        default=0.0,
        description="AdamW decoupled weight decay of the adapters (reference 0).",
    )
    max_grad_norm: Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Global gradient-norm clip (DeepSpeed gradient_clipping; reference 1.0); 0 disables it.",
    )
    # -- LoRA
    lora_r: PositiveInt = Field(
        default=64,
        description="LoRA rank (reference 64); adapter size grows linearly with it.",
    )
    lora_alpha: PositiveInt = Field(
        default=128,
        description="LoRA alpha (reference 128); the update is scaled by alpha / r = 2.",
    )
    lora_dropout: Annotated[StrictFloat, Field(ge=0.0, lt=1.0)] = Field(
        default=0.05,
        description="Dropout on the LoRA input (reference 0.05).",
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="Projection names LoRA adapts in the language model (never the vision tower or MTP heads); "
        "mass_ops.train.lora_targets.lora_target_pattern turns them into the PEFT regex.",
    )
    # -- checkpoints and validation
    save_every: PositiveInt = Field(
        default=50,
        description="Steps between adapter checkpoints (reference 50); the final step is always saved.",
    )
    val_every: PositiveInt = Field(
        default=150,
        description="Steps between validation passes on the rank-16 windows (reference 150); the final step is always"
        " validated. Checkpoint selection uses these losses.",
    )
    val_at_start: StrictBool = Field(
        default=True,
        description="Validate before the first step (reference on); step 0 never competes in checkpoint selection.",
    )
    # -- batches and the window sampler
    grad_accum: PositiveInt = Field(
        default=1,
        description="Micro-batches (one window each) accumulated per rank before an optimizer step (reference 1).",
    )
    ce_chunk: PositiveInt = Field(
        default=512,
        description="Tokens per chunk of the cross-entropy loss (fp32 logits per chunk; reference 512): bounds the "
        "memory of the vocabulary projection.",
    )
    seed: NonNegativeInt = Field(
        default=1234,
        description="Seed of the window sampler and of LoRA initialisation (reference 1234).",
    )
    sampler: Literal["task_role"] = Field(
        default="task_role",
        description="Window sampler: task_role draws a task uniformly, then the orchestrator group with probability "
        "p_orch, then a window (reference).",
    )
    p_orch: Probability = Field(
        default=1 / 3,
        description="Probability of drawing an orchestrator window when a task has both orchestrator and worker "
        "windows (reference 1/3).",
    )
    packing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Pack the windows a rank draws for one step (grad_accum of them) into as few micro-batches as "
        "pack_tokens allows, with per-window boundaries (positions restart, attention never crosses a window); the "
        "loss is unchanged. auto packs when grad_accum > 1 and the model's layers see the boundaries; on refuses a "
        "model whose linear-attention layers cannot (one error line); off never packs.",
    )
    pack_tokens: PositiveInt | None = Field(
        default=None,
        description="Token budget of a packed micro-batch; every pack is padded to it so shapes never change. null: "
        "the longest training window.",
    )
    # -- compute: precision, kernels, ZeRO-3, measurement
    autocast_bf16: StrictBool = Field(
        default=True,
        description="Forward under bf16 autocast with fp32 adapters in the optimizer (reference on; CPU runs compute "
        "in fp32).",
    )
    gradient_checkpointing: StrictBool | Literal["full", "selective", "off"] = Field(
        default="full",
        description="Activation checkpointing (non-reentrant): full (or true) recomputes every decoder layer in "
        "backward, the least memory for long windows (reference on); selective only every other layer (half the "
        "recompute, half the saving); off (or false) keeps all activations, fastest where memory allows.",
    )
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        default="auto",
        description="Attention kernel of the trainer: auto = flash_attention_2 on CUDA when the flash_attn package "
        "imports, else PyTorch SDPA (CPU runs); eager is for debugging.",
    )
    zero_stage: Literal[3] = Field(
        default=3,
        description="DeepSpeed ZeRO stage; mass-ops shards parameters, gradients and optimizer state (stage 3) "
        "instead of the reference's pipeline + DDP.",
    )
    zero3_init: StrictBool = Field(
        default=True,
        description="Load the parent under deepspeed.zero.Init, so no rank ever holds the whole model (off only for "
        "debugging small models).",
    )
    zero3_persistence_threshold: PositiveInt | None = Field(
        default=None,
        description="ZeRO-3 stage3_param_persistence_threshold: parameters with fewer elements stay whole on every "
        "rank instead of being gathered per use. null: one more than the largest LoRA tensor (lora_r × the widest "
        "projection), so adapters and norms are never gathered and large frozen projections stay partitioned.",
    )
    zero3_overlap_comm: StrictBool = Field(
        default=True,
        description="ZeRO overlap_comm: overlap gradient reduction and parameter gathers with compute (GPUs; always "
        "off on CPU, where gloo has nothing to overlap with).",
    )
    zero3_prefetch_bucket_size: NonNegativeInt = Field(
        default=100_000_000,
        description="ZeRO-3 stage3_prefetch_bucket_size: parameters gathered ahead of their use (about one decoder "
        "layer of a 4B model), so the next layer's gather overlaps this layer's compute.",
    )
    deepspeed_overrides: Annotated[dict[str, Any], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default_factory=dict,
        description="Merged over the generated DeepSpeed config (e.g. zero_optimization bucket sizes, offload); the "
        "batch, precision, optimizer, scheduler and clipping keys come from the fields above and may not be set here.",
    )
    dist_timeout_s: PositiveInt = Field(
        default=1800,
        description="Seconds a collective (gather, all-reduce, barrier) may wait for the other ranks before the "
        "run fails.",
    )
    warmup_measure_steps: NonNegativeInt = Field(
        default=2,
        description="Steps at the start of a training process that the throughput summary (throughput.json) names, "
        "explains (time per phase) and leaves out of its steady-state figures.",
    )
    peak_tflops_per_gpu: Annotated[StrictFloat, Field(gt=0.0)] | None = Field(
        default=989.0,
        description="Peak dense BF16 TFLOP/s of one training GPU, the denominator of the model FLOPs utilisation "
        "(MFU) the trainer logs: 989 for an H100 SXM or an H200 (the default), 756 for an H100 PCIe; null logs no "
        "MFU. Runs on CPU log tokens/s and achieved TFLOP/s but no MFU.",
    )

    @model_validator(mode="after")
    def _rules(self) -> Self:
        problems = self._rule_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _rule_problems(self) -> list[str]:
        """Every broken cross-field rule, one `field: rule` line each (subclasses add theirs in their own order)."""
        return [*self._schedule_problems(), *self._target_problems(), *self._deepspeed_problems()]

    def _schedule_problems(self) -> list[str]:
        if self.warmup_steps >= self.steps:
            return [f"warmup_steps: {self.warmup_steps} must be below steps ({self.steps})"]
        return []

    def _target_problems(self) -> list[str]:
        problems = []
        if not self.lora_target_modules:
            problems.append("lora_target_modules: must name at least one module")
        bad = [m for m in self.lora_target_modules if not IDENTIFIER.match(m)]
        if bad:
            problems.append(f"lora_target_modules: {bad} are not module names")
        return problems

    def _deepspeed_problems(self) -> list[str]:
        owned = sorted(set(self.deepspeed_overrides) & OWNED_DEEPSPEED_KEYS)
        return [f"deepspeed_overrides: keys {owned} are set from the training settings' own fields"] if owned else []

    @property
    def checkpointing(self) -> Literal["full", "selective", "off"]:
        """The activation-checkpointing mode: full, selective or off (true and false are full and off)."""
        value = self.gradient_checkpointing
        return ("full" if value else "off") if isinstance(value, bool) else value

    @property
    def lora_scale(self) -> float:
        """The factor LoRA's update is scaled by: alpha / r."""
        return self.lora_alpha / self.lora_r


class TrainingConfig(TrainerSettings):
    """LoRA SFT on DeepSpeed ZeRO-3 (MASS_SPEC §7, §8). `replicas` = data-parallel ranks; each optimizer step
    averages `replicas × grad_accum` windows."""

    window: PositiveInt = Field(
        default=49152,
        description="Tokens per training window, header included (MASS_SPEC §7; reference 49152). Longer threads are "
        "split into several windows.",
    )
    context_overlap: NonNegativeInt = Field(
        default=8192,
        description="Tokens of preceding context (masked, not trained) a window carries before its first trained "
        "block (reference 8192); the segment's query block may come on top.",
    )
    max_header_frac: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = Field(
        default=0.9,
        description="Largest share of a window the header (system + first user message) may take; a longer header is "
        "a thread error (reference 0.9).",
    )
    replicas: PositiveInt = Field(
        default=3,
        description="Data-parallel ranks (one GPU each under ZeRO-3); each optimizer step averages replicas × "
        "grad_accum windows (reference 3 × 1).",
    )
    gpus_per_rank: PositiveInt = Field(
        default=2,
        description="The reference's GPUs per pipeline-parallel replica; ZeRO-3 shards instead, so mass-ops runs one "
        "rank per GPU and uses this only to report the reference topology.",
    )
    windows_per_step: PositiveInt | None = Field(
        default=None, description="When set, replicas × grad_accum must equal it (the paper presets fix 3)."
    )
    nnodes: PositiveInt = Field(
        default=1,
        description="Training nodes; replicas are spread evenly over them (replicas / nnodes ranks per node).",
    )
    gpus_per_node: PositiveInt = Field(
        default=8,
        description="GPUs a training node offers; the resource plan checks that a node's ranks fit.",
    )

    def _rule_problems(self) -> list[str]:
        problems = []
        if self.context_overlap >= self.window:
            problems.append(f"context_overlap: {self.context_overlap} must be below window ({self.window})")
        problems += self._schedule_problems()
        if self.windows_per_step is not None and self.replicas * self.grad_accum != self.windows_per_step:
            problems.append(
                f"windows_per_step: replicas × grad_accum = {self.replicas * self.grad_accum} must equal "
                f"windows_per_step ({self.windows_per_step})"
            )
        problems += self._target_problems()
        if self.replicas % self.nnodes:
            problems.append(
                f"nnodes: {self.nnodes} must divide replicas ({self.replicas}): every node runs as many ranks"
            )
        elif self.replicas // self.nnodes > self.gpus_per_node:
            problems.append(
                f"gpus_per_node: {self.replicas // self.nnodes} ranks per node exceed {self.gpus_per_node} GPUs"
            )
        if self.val_every > self.steps:
            problems.append(f"val_every: {self.val_every} must not exceed steps ({self.steps})")
        return problems + self._deepspeed_problems()

    @property
    def ranks_per_node(self) -> int:
        """Data-parallel ranks (one GPU each) started on every node."""
        return self.replicas // self.nnodes

    @property
    def effective_windows_per_step(self) -> int:
        """Windows averaged by one optimizer step: data-parallel ranks × accumulation."""
        return self.replicas * self.grad_accum
