"""The typed cycle config: the single source of every knob of a MASS cycle.

A `CycleConfig` describes one cycle L(k) → L(k+1). It is loaded from a preset shipped in the package (`paper`,
`cycle2`, `demo`) or a YAML/JSON file, then `--set a.b=c` overrides and the `MASS_METADATA_URL` /
`MASS_ARTIFACT_URL` environment variables are applied, and finally every rule is checked. A bad config raises
`ConfigError` carrying one line per problem (field and rule); nothing is written before validation passes.

The `paper` and `cycle2` presets hold exactly the constants of the reference release (MASS_SPEC §2).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from mass_ops.errors import InputError

PRESETS_DIR = Path(__file__).parent / "presets"
PRESET_NAMES = ("paper", "cycle2", "demo")
# Presets that must reproduce the reference release's batch geometry (3 windows per optimizer step).
PAPER_PRESETS = frozenset({"paper", "cycle2"})
METADATA_URL_ENV = "MASS_METADATA_URL"
ARTIFACT_URL_ENV = "MASS_ARTIFACT_URL"
OPENROUTER_ENDPOINT = "https://openrouter.ai/api/v1"


# Documented maxima. A config is read by `plan` and by every task of a DAG run, so no value may make either allocate
# or compute more than a summary; each limit is far above what a real cycle uses (the reference value in brackets).
MAX_INT = 2**31 - 1  # any integer knob: fits a signed 32-bit column and every seed generator
MAX_CONFIG_BYTES = 256 * 1024  # a config file (the presets are ~3 KB)
MAX_CONFIG_DEPTH = 16  # nesting of mappings/lists in a config file or a --set value (the presets use 4)
MAX_TASK_ID = 999_999  # [324]
MAX_TASKS = 200  # ids in one task list [12]
MAX_SEARCH_ITERATIONS = 100  # [11]
MAX_CANDIDATES = 256  # teacher candidates per task [18]
MAX_OPPONENTS = 32  # tournament opponents per episode [6]
MAX_BOOTSTRAP_SAMPLES = 100_000  # [1000]
MAX_ROLLOUTS = 1000  # rollouts per task and generation [10]
MAX_JUDGE_SEEDS = 16  # [3]
MAX_JUDGES = 16  # external judges [2]
MAX_JUDGE_INVALID_RETRIES = 16  # extra judge calls per unusable verdict, per run [2]
MAX_TRAINING_STEPS = 100_000  # optimizer steps [1624]
MAX_MAP_ENTRIES = 64  # node selectors, tolerations


def _number(value: Any) -> Any:
    """Accept ints and floats for float knobs, but never bools or strings (YAML 'yes' is not 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number (got {value!r})")
    return float(value)


StrictFloat = Annotated[float, BeforeValidator(_number)]
PositiveInt = Annotated[StrictInt, Field(gt=0, le=MAX_INT)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]
Probability = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
TaskId = Annotated[StrictInt, Field(gt=0, le=MAX_TASK_ID)]
TaskList = Annotated[list[TaskId], Field(max_length=MAX_TASKS)]
# `\Z`, not `$`: `$` also matches before a final newline, and these names end up in URLs, paths and env lookups.
# Use them with `fullmatch`.
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# A cycle name is one path segment of artifact keys and of report URLs (the Airflow plugin checks it with this).
CYCLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


class ConfigError(InputError):
    """A config that breaks one or more rules; `problems` holds one line per problem (exit status 2)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelsConfig(_Section):
    """Model identities of the cycle. Relative locations are keys in the artifact store; `s3://…` or absolute paths
    are used as they are."""

    served_name: str = Field(min_length=1, description="Name the inference server serves the current model under.")
    parent_bf16: str = Field(min_length=1, description="BF16 parent: training base and tokenizer.")
    fp8_reference: str | None = Field(
        default=None, description="Official FP8 checkpoint whose layout the FP8 export mirrors; none = default rule."
    )
    next_bf16: str = Field(min_length=1, description="Where the merged BF16 model of the next generation goes.")
    next_fp8: str = Field(min_length=1, description="Where the block-FP8 model of the next generation goes.")


class SamplingConfig(_Section):
    """Sampling of episodes and in-loop judge/optimizer calls on a local server (MASS_SPEC §3.2, §4)."""

    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] = Field(
        default=0.6,
        description=(
            "Sampling temperature of episodes and in-loop judge/optimizer calls on the local server; 0 is "
            "greedy. Reference: 0.6."
        ),
    )
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = Field(
        default=0.95,
        description=(
            "Nucleus sampling: only the smallest set of tokens whose probabilities add up to `top_p` is sampled "
            "from. Reference: 0.95."
        ),
    )
    top_k: Annotated[StrictInt, Field(ge=-1)] = Field(
        default=20,
        description="Only the `top_k` most likely tokens are sampled from; -1 disables the limit. Reference: 20.",
    )
    presence_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] = Field(
        default=0.0,
        description=(
            "Penalty on tokens already present in the output (positive values discourage repetition). Reference: 0."
        ),
    )
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0)] = Field(
        default=1.0,
        description="Multiplicative penalty on repeated tokens; 1 leaves the distribution unchanged. Reference: 1.",
    )
    enable_thinking: StrictBool = Field(
        default=True,
        description=(
            "Whether the chat template opens a reasoning block before each answer (Qwen thinking mode). "
            "Reference: true."
        ),
    )


class ServerConfig(_Section):
    """How the inference server is launched (vLLM in production, `transformers serve` locally)."""

    port: Annotated[StrictInt, Field(ge=1, le=65535)] = Field(
        default=8001,
        description=(
            "Port the launched inference server listens on; `inference.endpoint` must point at it. Reference: 8001."
        ),
    )
    max_num_seqs: PositiveInt = Field(
        default=4,
        description=(
            "Sequences the server decodes at once (vLLM `--max-num-seqs`); more raises throughput and memory "
            "use. Reference: 4."
        ),
    )
    gpu_memory_utilization: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = Field(
        default=0.9,
        description=(
            "Fraction of each GPU's memory the server may use for weights and KV cache (vLLM "
            "`--gpu-memory-utilization`). Reference: 0.9."
        ),
    )
    tool_call_parser: str = Field(
        default="qwen3_coder",
        description=(
            "vLLM `--tool-call-parser` that turns the model's tool-call text into OpenAI tool calls. Reference: "
            "qwen3_coder."
        ),
    )
    reasoning_parser: str = Field(
        default="qwen3",
        description="vLLM `--reasoning-parser` that separates reasoning from the answer. Reference: qwen3.",
    )
    gpus: PositiveInt = Field(
        default=1,
        description="GPUs the inference server runs on (tensor parallel size). Reference: 1.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description=(
            "Order in which the server takes waiting requests (vLLM `--scheduling-policy`). 'priority': every "
            "request carries its work's place on the cycle's critical path (search, then collection, then ranking; "
            "`mass_ops.critical_path`), so a full server serves the longest remaining chain first; needs the vllm "
            "backend. Reference: fcfs."
        ),
    )
    readiness_timeout_s: PositiveInt = Field(
        default=1800,
        description=(
            "Seconds to wait for a launched server to list the model before the stage fails (loading a 27B model "
            "can take many minutes)."
        ),
    )


class InferenceConfig(_Section):
    """The OpenAI-compatible endpoint the current model is served on, and the token budgets of every call."""

    backend: Literal["vllm", "openai-compatible", "openrouter"] = Field(
        default="vllm",
        description=(
            "Kind of endpoint: 'vllm' (a server mass-ops launches or finds), 'openai-compatible' (any "
            "OpenAI-style server), or 'openrouter' (hosted; search, collect and rank only, nothing to train)."
        ),
    )
    endpoint: str = Field(
        default="http://127.0.0.1:8001/v1",
        description=(
            "OpenAI-compatible base URL (ending in /v1) the current model is served at; no credentials, query or "
            "fragment. Reference: http://127.0.0.1:8001/v1."
        ),
    )
    api_key_env: str = Field(
        default="VLLM_API_KEY", description="NAME of the environment variable holding the key (never the key)."
    )
    context_window_tokens: PositiveInt = Field(
        default=262144,
        description=(
            "Context length of the served model in tokens; calls whose prompt plus output budget would not fit "
            "are refused before they are sent. Reference: 262144."
        ),
    )
    episode_max_output_tokens: PositiveInt = Field(
        default=32768,
        description="Most tokens the agent may generate in one model response during an episode. Reference: 32768.",
    )
    max_output_tokens: PositiveInt = Field(
        default=49152,
        description="Most tokens generated by one judge or optimizer call (search, ranking). Reference: 49152.",
    )
    context_safety_tokens: PositiveInt = Field(
        default=8192,
        description=(
            "Tokens kept free below the context window when checking that a call fits (tokenizer and template "
            "slack). Reference: 8192."
        ),
    )
    reasoning_effort: Literal["low", "medium", "high"] = Field(
        default="medium",
        description="Reasoning effort requested from the model for every call. Reference: medium.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="Sampling parameters of episodes and in-loop calls.",
    )
    max_concurrent_requests: PositiveInt = Field(
        default=4, description="Capacity of the endpoint: episodes and judge calls in flight at once."
    )
    request_timeout_s: PositiveInt = Field(
        default=3600,
        description="Seconds one judge or optimizer call may take before it fails and is retried. Reference: 3600.",
    )
    server: ServerConfig = Field(
        default_factory=ServerConfig,
        description="How the inference server is launched.",
    )
    tensor_parallel_size: PositiveInt | None = Field(
        default=None,
        description=(
            "GPUs one served model is split over (vLLM --tensor-parallel-size); export refuses an FP8 model whose "
            "quantized weights do not split into whole 128-wide blocks on this many GPUs. Null: inference.server.gpus."
        ),
    )

    @model_validator(mode="after")
    def _budgets_and_endpoint(self) -> InferenceConfig:
        problems = []
        largest = max(self.episode_max_output_tokens, self.max_output_tokens)
        if largest + self.context_safety_tokens >= self.context_window_tokens:
            problems.append(
                f"max_output_tokens: max(episode_max_output_tokens, max_output_tokens) + context_safety_tokens = "
                f"{largest + self.context_safety_tokens} must be below context_window_tokens "
                f"({self.context_window_tokens})"
            )
        if self.server.scheduling_policy == "priority" and self.backend != "vllm":
            problems.append(
                f"server.scheduling_policy: priority needs the vllm backend (a {self.backend} server does not "
                "schedule by the request's priority field)"
            )
        endpoint_problem = _endpoint_problem(self.endpoint, self.backend)
        if endpoint_problem:
            problems.append(f"endpoint: {endpoint_problem}")
        if not _IDENTIFIER.fullmatch(self.api_key_env):
            problems.append("api_key_env: must be an environment variable name, not a key")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def effective_tensor_parallel_size(self) -> int:
        """GPUs one served model is split over: `tensor_parallel_size`, else the launched server's GPUs."""
        return self.tensor_parallel_size or self.server.gpus


CATALOGUE_NOT_CHOSEN = (
    "config: tasks.catalogue: not chosen; the paper presets are meant for the reference's tasks, which mass-ops "
    "cannot ship: import them with `mass-ops tasks import <reference>/tasks --dest DIR` and pass "
    "`--set tasks.catalogue=DIR`, or pass `--set tasks.catalogue=builtin` to run the paper's settings on mass-ops' "
    "own 12 tasks"
)


class TasksConfig(_Section):
    """Which tasks play which part. `catalogue` = 'builtin', a MASS-format task directory, or null (not chosen yet:
    the paper presets leave it to the user, and no stage runs until it is set)."""

    catalogue: Annotated[str, Field(min_length=1)] | None = Field(
        default="builtin",
        description=(
            "Task catalogue: 'builtin' (mass-ops' own 12 tasks), a directory written by `mass-ops tasks import`, "
            "or null when not chosen yet (the paper presets: validate and every stage refuse to run until it is "
            "set)."
        ),
    )
    train_candidates: TaskList = Field(
        description=(
            "Task ids that workflow search runs on: every designated training task, excluded ones included; must "
            "equal train ∪ excluded. Reference: 9 tasks."
        ),
    )
    train: TaskList = Field(
        description="Task ids whose teacher trajectories are collected, ranked and trained on. Reference: 8 tasks.",
    )
    test: TaskList = Field(
        description="Held-out task ids: searched and evaluated, never trained on. Reference: 60, 207, 305.",
    )
    excluded: TaskList = Field(
        default=[],
        description="Training candidates kept out of teacher collection (searched, not trained on). Reference: [221].",
    )

    @model_validator(mode="after")
    def _splits(self) -> TasksConfig:
        problems = []
        for name in ("train_candidates", "train", "test", "excluded"):
            ids = getattr(self, name)
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                problems.append(f"{name}: lists {dupes} more than once")
        train, test, excluded = set(self.train), set(self.test), set(self.excluded)
        for a, b, left, right in (
            ("train", "test", train, test),
            ("train", "excluded", train, excluded),
            ("test", "excluded", test, excluded),
        ):
            if left & right:
                problems.append(f"{b}: overlaps {a} on {sorted(left & right)}")
        if train | excluded != set(self.train_candidates):
            problems.append(
                f"train_candidates: train ∪ excluded {sorted(train | excluded)} must equal train_candidates "
                f"{sorted(self.train_candidates)}"
            )
        if not self.train:
            problems.append("train: must name at least one task")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def for_split(self, split: Literal["train", "test", "all"]) -> list[int]:
        """Default task set of the search/rollout stages (MASS_SPEC §1): all = train candidates + test."""
        if split == "train":
            return list(self.train_candidates)
        if split == "test":
            return list(self.test)
        return list(self.train_candidates) + list(self.test)


class SearchConfig(_Section):
    """RHI workflow search (MASS_SPEC §3)."""

    iterations: Annotated[StrictInt, Field(gt=0, le=MAX_SEARCH_ITERATIONS)] = Field(
        default=11,
        description=(
            "RHI improvement steps per task; the search produces iterations + 1 workflow versions (v0..vN). "
            "Reference: 11; at most 100."
        ),
    )
    seed_base: NonNegativeInt = Field(
        default=450000,
        description=(
            "Base of the search seeds: the reference episode of task q uses seed_base + q, version k uses "
            "seed_base + q + 1000·k. Reference: 450000 (cycle 2: 1450000)."
        ),
    )
    swap_consistent: StrictBool = Field(default=False, description="Judge both orders; disagreement = tie (not paper).")
    on_invalid_proposal: Literal["fail", "keep_design"] = Field(
        default="fail",
        description="When the optimizer's answer is unusable: fail the step (paper; a rerun retries it) or carry the "
        "current design forward as the next version, recorded as such (demo: a random model never writes JSON).",
    )
    reject_numeric_caps: StrictBool = Field(
        default=False,
        description=(
            "Refuse optimizer designs that impose fixed numeric caps on agents (a reference flag the pipeline "
            "does not use)."
        ),
    )
    max_design_chars: PositiveInt | None = Field(
        default=None,
        description=(
            "Longest workflow design, in characters, an optimizer answer may propose; none = no limit (the "
            "reference pipeline sets none)."
        ),
    )
    results_json_max_chars: PositiveInt = Field(
        default=24000,
        description=(
            "Characters of each results/*.json file shown to the optimizer and judge (longer files keep their "
            "head and tail). Reference: 24000."
        ),
    )
    results_json_total_max_chars: PositiveInt = Field(
        default=120000,
        description=(
            "Characters of all results/*.json files together shown to the optimizer and judge. Reference: 120000."
        ),
    )


class JudgeConfig(_Section):
    """What happens when a judge answers with something that is not a usable verdict (MASS_SPEC §5), in every stage
    that judges: search (judging and arbitration), rank (self-judge) and evaluate (external judges, self-judge)."""

    invalid_retries: Annotated[StrictInt, Field(ge=0, le=MAX_JUDGE_INVALID_RETRIES)] = Field(
        default=2,
        description=(
            "Extra calls a judge gets, per run of a stage, when its answer is not a usable verdict (not JSON, wrong "
            "schema, empty); each retry samples with a seed derived from the call's seed and the number of unusable "
            "answers so far (seeds.judge_retry_seed). The reference makes no retry; at most 16."
        ),
    )
    max_invalid_fraction: Probability = Field(
        default=0.0,
        description=(
            "Largest share of a stage's verdicts (per task in search and rank, per judge in evaluate) that may stay "
            "invalid after the retries and count as ties. Above it the stage fails; finished verdicts stay recorded "
            "and a rerun judges only the missing ones. Reference: 0 (it aborts on invalid output); demo: 1."
        ),
    )
    position_bias_sample: Probability = Field(
        default=0.0,
        description=(
            "Share of judged pairs (every judging stage and external judge) judged once more with A and B swapped, "
            "to measure position bias: the report's flip rate per judge. The pick is a hash of the call's key, so "
            "it is the same on every rerun. The extra call is recorded (key '<call>/swapped') but never changes the "
            "verdict used for RHI or ranking. Reference: 0 (one call per pair); demo: 0.5."
        ),
    )
    verdict_parsing: Literal["strict", "lenient"] = Field(
        default="strict",
        description=(
            "How every judging stage (search, rank, evaluate, the position-bias check) reads a judge's answer. "
            "'strict': the reference's schema exactly - winner exactly 'A', 'B' or 'tie', a rationale of at least "
            "one character kept as written - and the reference's JSON reading on the call's route (chat: the whole "
            "text, else its outermost {...}, else the first fenced block; Responses API: the whole text only; "
            "Anthropic: the first fenced block, else the outermost {...}). "
            "'lenient': winner case- and space-insensitive, rationale trimmed and non-blank, any fenced block "
            "tried. Unusable answers are retried (invalid_retries) in both. Reference: strict; demo: lenient."
        ),
    )


class CollectionConfig(_Section):
    """Teacher collection under the retained workflow (MASS_SPEC §1 collect/select)."""

    candidates: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=18,
        description=(
            "Teacher episodes collected per training task under its retained workflow. Reference: 18; at most 256."
        ),
    )
    train_ranks: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=15,
        description=(
            "Best-ranked candidates per task that become training trajectories (ranks 1..train_ranks). Reference: 15."
        ),
    )
    validation_rank: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=16,
        description=(
            "Rank whose candidate becomes the task's validation trajectory; must be train_ranks + 1. Reference: 16."
        ),
    )
    seed_base: NonNegativeInt = Field(
        default=710000,
        description=(
            "Base of the collection seeds: candidate i of task q uses seed_base + 100·q + i. Reference: 710000 "
            "(cycle 2: 1710000)."
        ),
    )
    require_beats_reference: StrictBool = Field(
        default=True, description="Skip tasks whose retained workflow never beat the reference (paper behaviour)."
    )

    @model_validator(mode="after")
    def _ranks(self) -> CollectionConfig:
        problems = []
        if self.validation_rank != self.train_ranks + 1:
            problems.append(
                f"validation_rank: {self.validation_rank} must equal train_ranks + 1 ({self.train_ranks + 1})"
            )
        if self.candidates < self.validation_rank:
            problems.append(f"candidates: {self.candidates} must be ≥ validation_rank ({self.validation_rank})")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RankingConfig(_Section):
    """Within-task self-ranking: ring tournament + Bradley–Terry (MASS_SPEC §6)."""

    opponents_per_episode: Annotated[StrictInt, Field(gt=0, le=MAX_OPPONENTS)] = Field(
        default=6,
        description=(
            "Opponents each candidate meets in the ring tournament (even; each pair judged once). Reference: 6; "
            "at most 32."
        ),
    )
    seed: NonNegativeInt = Field(
        default=1234,
        description=(
            "Base seed of the tournament schedule (seed + q) and of each self-judge match (seed + 1000·q + i). "
            "Reference: 1234."
        ),
    )
    bootstrap_samples: Annotated[StrictInt, Field(ge=0, le=MAX_BOOTSTRAP_SAMPLES)] = Field(
        default=1000,
        description=(
            "Bootstrap resamples of each task's tournament for confidence intervals on the Bradley–Terry scores "
            "(recorded, never used for selection); below 2 skips them. Default 1000; at most 100000."
        ),
    )

    @model_validator(mode="after")
    def _even(self) -> RankingConfig:
        if self.opponents_per_episode < 2 or self.opponents_per_episode % 2:
            raise ValueError(f"opponents_per_episode: {self.opponents_per_episode} must be even and ≥ 2")
        return self


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


class TrainingConfig(_Section):
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
    save_every: PositiveInt = Field(
        default=50,
        description="Steps between adapter checkpoints (reference 50); the final step is always saved.",
    )
    val_every: PositiveInt = Field(
        default=150,
        description="Steps between validation passes on the rank-16 windows (reference 150); the final step is always"
        " validated. Checkpoint selection uses these losses.",
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
    val_at_start: StrictBool = Field(
        default=True,
        description="Validate before the first step (reference on); step 0 never competes in checkpoint selection.",
    )
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
    warmup_measure_steps: NonNegativeInt = Field(
        default=2,
        description="Steps at the start of a training process that the throughput summary (throughput.json) names, "
        "explains (time per phase) and leaves out of its steady-state figures.",
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
    zero_stage: Literal[3] = Field(
        default=3,
        description="DeepSpeed ZeRO stage; mass-ops shards parameters, gradients and optimizer state (stage 3) "
        "instead of the reference's pipeline + DDP.",
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
    max_header_frac: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = Field(
        default=0.9,
        description="Largest share of a window the header (system + first user message) may take; a longer header is "
        "a thread error (reference 0.9).",
    )
    peak_tflops_per_gpu: Annotated[StrictFloat, Field(gt=0.0)] | None = Field(
        default=989.0,
        description="Peak dense BF16 TFLOP/s of one training GPU, the denominator of the model FLOPs utilisation "
        "(MFU) the trainer logs: 989 for an H100 SXM or an H200 (the default), 756 for an H100 PCIe; null logs no "
        "MFU. Runs on CPU log tokens/s and achieved TFLOP/s but no MFU.",
    )

    @model_validator(mode="after")
    def _geometry(self) -> TrainingConfig:
        problems = []
        if self.context_overlap >= self.window:
            problems.append(f"context_overlap: {self.context_overlap} must be below window ({self.window})")
        if self.warmup_steps >= self.steps:
            problems.append(f"warmup_steps: {self.warmup_steps} must be below steps ({self.steps})")
        if self.windows_per_step is not None and self.replicas * self.grad_accum != self.windows_per_step:
            problems.append(
                f"windows_per_step: replicas × grad_accum = {self.replicas * self.grad_accum} must equal "
                f"windows_per_step ({self.windows_per_step})"
            )
        if not self.lora_target_modules:
            problems.append("lora_target_modules: must name at least one module")
        bad = [m for m in self.lora_target_modules if not _IDENTIFIER.match(m)]
        if bad:
            problems.append(f"lora_target_modules: {bad} are not module names")
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
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def ranks_per_node(self) -> int:
        """Data-parallel ranks (one GPU each) started on every node."""
        return self.replicas // self.nnodes

    @property
    def effective_windows_per_step(self) -> int:
        """Windows averaged by one optimizer step: data-parallel ranks × accumulation."""
        return self.replicas * self.grad_accum


class ExportConfig(_Section):
    """Merge to BF16 and block-wise FP8 (MASS_SPEC §9)."""

    fp8_block_size: Literal[128] = Field(
        default=128,
        description=(
            "Side of the square weight blocks that share one FP8 scale (128 × 128, as the official FP8 checkpoints)."
        ),
    )
    formats: Annotated[list[Literal["bf16", "fp8"]], Field(max_length=2)] = Field(
        default=["bf16", "fp8"],
        description=(
            "Which exports to write after training: the merged BF16 model, the block-wise FP8 model, or both. "
            "Reference: both."
        ),
    )


class ExternalJudgeConfig(_Section):
    """One external judge used for reporting only (never for selection)."""

    name: str = Field(
        min_length=1,
        description="Label of the judge in reports and rows.",
    )
    provider: Literal["openai-compatible", "anthropic"] = Field(
        description=(
            "API the judge speaks: 'openai-compatible' (OpenAI Responses/Chat style) or 'anthropic' (Messages API)."
        ),
    )
    model: str = Field(
        min_length=1,
        description="Model id sent to the provider.",
    )
    base_url: str | None = Field(
        default=None,
        description="http(s) base URL of the provider without credentials; none = the provider's default.",
    )
    api_key_env: str = Field(
        description="NAME of the environment variable holding the judge's API key (never the key itself).",
    )
    reasoning_effort: str | None = Field(
        default=None,
        description="Reasoning effort passed to the provider as is (e.g. 'xhigh', 'max'); none = its default.",
    )
    api: Literal["chat", "responses"] = Field(
        default="chat",
        description=(
            "Endpoint an openai-compatible judge is called on: 'chat' (POST /chat/completions, the effort as "
            "reasoning_effort, the cap as max_completion_tokens) or 'responses' (POST /responses: instructions + "
            "input, text.format json_object, reasoning.effort, the cap as max_output_tokens). Anthropic judges "
            "take 'chat' only (their Messages API). Reference: responses for gpt-5.5."
        ),
    )
    max_tokens: PositiveInt | None = Field(
        default=32768,
        description=(
            "Most tokens the judge may generate per verdict; none = no cap sent (Anthropic requires one: 4096 is "
            "sent then, as in the reference). Reference: none for gpt-5.5 (Responses API), 32768 for Claude."
        ),
    )

    @model_validator(mode="after")
    def _key_env(self) -> ExternalJudgeConfig:
        if not _IDENTIFIER.fullmatch(self.api_key_env):
            raise ValueError("api_key_env: must be an environment variable name, not a key")
        if self.provider == "anthropic" and self.api != "chat":
            raise ValueError(f"api: {self.api!r} applies to openai-compatible judges only (anthropic: leave it unset)")
        if self.base_url is not None and not _is_http_url(self.base_url):
            raise ValueError(f"base_url: {self.base_url!r} must be an http(s) URL without credentials")
        return self


class EvaluationConfig(_Section):
    """Rollouts, external pairwise judging and the nightly regression check (MASS_SPEC §10)."""

    rollout_count: Annotated[StrictInt, Field(gt=0, le=MAX_ROLLOUTS)] = Field(
        default=10,
        description=(
            "Rollouts per task and generation in evaluation (bare prompt, no workflow). Reference: 10; at most 1000."
        ),
    )
    rollout_seed_base: NonNegativeInt = Field(
        default=910000,
        description=(
            "Base of the rollout seeds: rollout i of task q uses rollout_seed_base + 100·q + i. Reference: 910000."
        ),
    )
    tasks: TaskList | None = Field(
        default=None, description="Rollout pool; none = the 8 SFT tasks + the test tasks (the paper's 11-task pool)."
    )
    judge_seeds: Annotated[list[NonNegativeInt], Field(max_length=MAX_JUDGE_SEEDS)] = Field(
        default=[42, 43, 44],
        description=(
            "Presentation seeds of the external pairwise judging; every pair is judged once per seed and judge. "
            "Reference: [42, 43, 44]."
        ),
    )
    judges: Annotated[list[ExternalJudgeConfig], Field(max_length=MAX_JUDGES)] = Field(
        default=[],
        description=(
            "External judges used for reporting only, never for selection. Reference: gpt-5.5 and claude-opus-4-8."
        ),
    )
    swap_consistent: StrictBool = Field(
        default=False,
        description="Judge each pair in both orders and count a disagreement as a tie (not what the reference does).",
    )
    regression_threshold: Probability = Field(
        default=0.05,
        description=(
            "The nightly check fails when the new generation's win rate against its parent is below 0.5 minus "
            "this. Default 0.05."
        ),
    )


class PromptsConfig(_Section):
    """Where the prompt texts come from: mass-ops ships its own wording as Jinja2 templates (`mass-ops prompts list`);
    a folder may replace any of them by file name."""

    dir: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "Folder of prompt templates that replace the shipped ones by file name (e.g. judge_system.j2); start "
            "from `mass-ops prompts export DIR`. null = the shipped wording. Every file must be a known template; "
            "validate renders each one, and the cycle row records every template's SHA-256."
        ),
    )


class StorageConfig(_Section):
    """Where records and artifacts live. Overridden by MASS_METADATA_URL / MASS_ARTIFACT_URL."""

    metadata_url: str = Field(
        default="sqlite:///runs/mass-ops.db",
        description=(
            "Database of the cycle's records: sqlite:///PATH (embedded default) or postgresql://HOST/DB; "
            "MASS_METADATA_URL overrides it."
        ),
    )
    artifact_url: str = Field(
        default="runs/artifacts",
        description=(
            "Where artifacts (workspaces, logs, models) go: a folder, file://PATH or s3://BUCKET/PREFIX; "
            "MASS_ARTIFACT_URL overrides it."
        ),
    )

    @model_validator(mode="after")
    def _urls(self) -> StorageConfig:
        problems = []
        meta = self.metadata_url
        if not (meta.startswith("sqlite:///") or re.match(r"^postgresql(\+[a-z0-9]+)?://[^/]+/[^/?#]+", meta)):
            problems.append("metadata_url: must be sqlite:///PATH or postgresql://HOST/DB")
        art = self.artifact_url
        if art.startswith("s3://"):
            if not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?$", art):
                problems.append("artifact_url: s3://BUCKET/PREFIX has an invalid bucket name")
        elif "://" in art and not art.startswith("file://"):
            problems.append("artifact_url: must be s3://BUCKET/PREFIX, file://PATH or a folder path")
        elif not art.strip():
            problems.append("artifact_url: must not be empty")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class KubernetesConfig(_Section):
    """Settings of the Kubernetes compute backend (production profile)."""

    namespace: str = Field(
        default="mass-ops",
        description="Namespace every pod and Job of the cycle runs in.",
    )
    image_episode: str = Field(
        default="ghcr.io/mass-ops/episode:0.1.0",
        description="Container image of episode pods (the agent and its sandbox).",
    )
    image_trainer: str = Field(
        default="ghcr.io/mass-ops/trainer:0.1.0",
        description="Container image of training and export Jobs.",
    )
    image_inference: str = Field(
        default="ghcr.io/mass-ops/inference:0.1.0",
        description="Container image of the inference server.",
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        description="Extended resource name GPUs are requested under.",
    )
    node_selector: Annotated[dict[str, str], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default={},
        description="Node labels episode pods must match (at most 64); GPU pods use gpu_node_selector instead.",
    )
    gpu_node_selector: Annotated[dict[str, str], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default={},
        description="Node labels of the pods that need GPUs (inference, training, export).",
    )
    gpu_tolerations: Annotated[list[dict[str, str]], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default=[],
        description="Tolerations added to GPU pods, each a Kubernetes toleration as a mapping (at most 64).",
    )
    model_cache_pvc: str = Field(
        default="mass-ops-model-cache",
        description="PersistentVolumeClaim holding the model snapshots that inference and training read.",
    )
    episode_cpu: str = Field(
        default="4",
        description="CPU request and limit of the agent container of an episode pod (Kubernetes quantity).",
    )
    episode_memory: str = Field(
        default="16Gi",
        description="Memory request and limit of the agent container of an episode pod (Kubernetes quantity).",
    )
    publisher_cpu: str = Field(
        default="1", description="CPU of the publisher container of an episode pod (uploads artifacts, writes rows)."
    )
    publisher_memory: str = Field(default="1Gi", description="Memory of the publisher container of an episode pod.")
    startup_timeout_s: PositiveInt = Field(
        default=1800,
        description="Seconds a pod or Job may stay unscheduled or pulling its image before the task fails.",
    )
    training_priority_class: str = Field(
        default="mass-ops-training",
        description="PriorityClass of training Jobs (lets them preempt less important work).",
    )
    training_launcher: Literal["indexed-job", "trainjob"] = Field(
        default="indexed-job",
        description=(
            "How multi-node training starts: 'indexed-job' (a batch/v1 indexed Job plus a headless Service, nothing "
            "to install) or 'trainjob' (a Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime "
            "`trainjob_runtime`; needs Trainer and JobSet in the cluster). Export always runs as a Job."
        ),
    )
    trainjob_runtime: str = Field(
        default="torch-distributed",
        description="The ClusterTrainingRuntime a TrainJob refers to (Kubeflow Trainer's torch runtime by default).",
    )

    @model_validator(mode="after")
    def _names(self) -> KubernetesConfig:
        if not _K8S_NAME.fullmatch(self.namespace):
            raise ValueError(f"namespace: {self.namespace!r} is not a valid Kubernetes name")
        if not _K8S_NAME.fullmatch(self.trainjob_runtime):
            raise ValueError(f"trainjob_runtime: {self.trainjob_runtime!r} is not a valid Kubernetes name")
        return self


class ComputeConfig(_Section):
    """Where commands run: local processes (embedded default) or Kubernetes."""

    backend: Literal["local", "kubernetes"] = Field(
        default="local",
        description="Where commands run: 'local' processes (embedded default) or 'kubernetes' pods and Jobs.",
    )
    local_inference: Literal["transformers", "external"] = Field(
        default="transformers",
        description=(
            "Local backend: 'transformers' starts `transformers serve` on the cycle's model; 'external' uses a server "
            "already answering at inference.endpoint (your own vLLM, a hosted endpoint) and only checks it is ready. "
            "Evaluation always serves the registered generations it compares with `transformers serve`."
        ),
    )
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig,
        description="Settings of the Kubernetes backend.",
    )


class RuntimeConfig(_Section):
    """Limits of one episode (MASS_SPEC §4; the wall-clock limit is beyond the reference)."""

    http_response_timeout_ms: PositiveInt = Field(
        default=1800000,
        description=(
            "Milliseconds the agent waits for one model response, streaming included. Reference: 1800000 (30 min)."
        ),
    )
    shell_timeout_ms: PositiveInt = Field(
        default=600000,
        description="Milliseconds one foreground shell command of the agent may run. Reference: 600000 (10 min).",
    )
    stream_idle_timeout_ms: PositiveInt = Field(
        default=600000,
        description=(
            "Milliseconds a streamed model response may stay silent before the agent gives up on it. Reference: 600000."
        ),
    )
    episode_wall_clock_s: PositiveInt | None = Field(
        default=6 * 3600,
        description=(
            "Seconds an episode's agent may run before its whole process group is stopped (a model failure, subtype "
            "wall_clock_limit); null = no limit, as in the reference (MASS_SPEC §4), which the paper and cycle2 "
            "presets follow. Other presets keep a limit: 6 h by default, 600 s in the demo. On Kubernetes it also "
            "sets the episode pod's activeDeadlineSeconds (none when null)."
        ),
    )
    max_infra_attempts: PositiveInt = Field(default=3, description="Attempts per episode when infrastructure fails.")
    thread_limit: PositiveInt = Field(
        default=2,
        description=(
            "Threads the agent's research code may use per math library (OMP, MKL, OpenBLAS; loky gets twice as "
            "many workers). Reference: 2."
        ),
    )
    episode_cuda_visible_devices: str = Field(
        default="",
        description=(
            "CUDA_VISIBLE_DEVICES of the agent's research code; empty = no GPU (what the reference documents "
            "recommend)."
        ),
    )
    proxy_max_request_bytes: PositiveInt = Field(
        default=32 * 1024**2,
        description=(
            "Largest request body (bytes) the episode proxy reads from the agent; a larger one gets HTTP 413, is "
            "recorded and never forwarded. A full 256K-token context is about 1 MB of JSON."
        ),
    )
    sandbox: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description=(
            "How the local backend contains the agent: `bwrap` = a bubblewrap sandbox (own PID, IPC, mount and "
            "network namespaces; it sees its workspace, home and a read-only system, and reaches only its episode "
            "proxy; see mass_ops.compute.sandbox), `none` = a plain process of the runner's user. Where bwrap is "
            "chosen but unavailable, or none is chosen, an episode with a real API key is refused unless "
            "`allow_unsandboxed_agent` is true. Kubernetes episodes run in their sandbox pod either way."
        ),
    )
    allow_unsandboxed_agent: bool = Field(
        default=False,
        description=(
            "Run local episodes that hold a real API key (anything but the placeholder EMPTY) without a sandbox: "
            "the agent can then read the runner's environment and reach every local service. Off by default."
        ),
    )
    sandbox_egress: Literal["none", "public"] = Field(
        default="none",
        description=(
            "Internet for the bwrap-sandboxed agent's downloads (pip, uv, npm, git, curl): `public` = an egress proxy "
            "per attempt, named in the agent's HTTPS_PROXY/HTTP_PROXY/ALL_PROXY, that forwards CONNECT tunnels and "
            "plain http:// requests to globally routable addresses only (never loopback, private, link-local or "
            "cloud metadata, CGNAT or this host's own addresses; see mass_ops.compute.egress), counted in each "
            "attempt's status document; `none` = no network but the episode proxy. The paper and cycle2 presets "
            "choose public (the reference's agents download packages)."
        ),
    )
    sandbox_egress_ports: list[Annotated[StrictInt, Field(ge=1, le=65535)]] = Field(
        default_factory=lambda: [443, 80],
        min_length=1,
        description="Destination ports the egress proxy forwards to (`sandbox_egress: public`); others get HTTP 403.",
    )


UsdAmount = Annotated[StrictFloat, Field(gt=0.0, le=1e9)]


class BudgetsConfig(_Section):
    """Spending limits that hold while a cycle runs (ISSUE #15.2); every field is optional, null = unlimited.

    Tokens are prompt + completion tokens as the server reports them (cached prompt tokens count as prompt tokens).
    The episode proxy checks each agent request before forwarding it (prompt estimate + its max tokens against what
    is left); in-loop calls check before each call. Spend per cycle and scope lives in the metadata store, so every
    process and pod of the cycle shares it. Budgets are not part of the config hash: raise one and rerun, and the
    cycle continues where it stopped (finished units are reused).
    """

    episode_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens one episode attempt may use through its proxy (all its requests, subagents included).",
    )
    task_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens all episodes and in-loop calls of one task may use in this cycle.",
    )
    task_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) all episodes and in-loop calls of one task may cost.",
    )
    cycle_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens the whole cycle may use (every episode and in-loop call).",
    )
    cycle_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) the whole cycle may cost.",
    )
    in_loop_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens the in-loop calls of the cycle (judge, optimizer, arbitration, self-judge) may use.",
    )
    in_loop_cost_usd: UsdAmount | None = Field(
        default=None,
        description="US dollars (server-reported cost) the in-loop calls of the cycle may cost.",
    )
    alert_callback: str | None = Field(
        default=None,
        description=(
            "Dotted path of a callable (`package.module.function` or `package.module:function`) called once with a "
            "`mass_ops.store.budgets.BudgetAlert` when a budget first reaches 50% or 80% of its limit (the alert is "
            "logged and recorded in the store either way); checked importable when the config loads."
        ),
    )

    @model_validator(mode="after")
    def _callback_importable(self) -> BudgetsConfig:
        if self.alert_callback is not None:
            try:
                import_callable(self.alert_callback)
            except ValueError as exc:
                raise ValueError(f"alert_callback: {exc}") from None
        return self


def import_callable(path: str) -> Any:
    """The callable that `path` (``package.module.function`` or ``package.module:function``) names; ValueError saying
    why in one line when there is none. Imports the module: a config names only code its deployment ships."""
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not a dotted path of a callable (package.module.function)")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a config problem, named in one line
        raise ValueError(f"cannot import module {module_name!r} of {path!r} ({type(exc).__name__}: {exc})") from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ValueError(f"{path!r} does not name a callable in module {module_name!r}")
    return target


class PromotionConfig(_Section):
    """When a newly registered generation L(k+1) becomes the served model: what nightly evaluation evaluates and
    what the next cycle starts from. Not part of the config hash (an operational choice, not what the cycle is)."""

    require_approval: StrictBool = Field(
        default=False,
        description=(
            "Wait for a person's approval in Airflow (a human-in-the-loop task showing the evaluation's headline) "
            "before promoting the new generation; rejected or pending, nightly runs keep evaluating the previous "
            "one and no next cycle starts. Reference: false (the reference release has no gate)."
        ),
    )


class ModelPrice(_Section):
    """What one API model charges, in US dollars per million tokens (the provider's price list)."""

    prompt_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million prompt (input) tokens not served from the provider's cache."
    )
    completion_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million completion (output) tokens, reasoning tokens included."
    )
    cached_per_million: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=0.0, description="USD per million prompt tokens the provider served from its prompt cache."
    )


class PricesConfig(_Section):
    """The price table of the cost estimate (`mass-ops plan`) and of spend in `status` and the report (ISSUE #15).
    Not part of the config hash: a new price list changes what a cycle costs, not what it is."""

    models: Annotated[dict[str, ModelPrice], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default_factory=dict,
        description=(
            "Per-token prices of API models by model name (an external judge's `model`, or the served name when the "
            "policy itself is an API model). A model not listed costs nothing per token: self-hosted models are "
            "paid by the GPU-hour instead, and the estimate names API judges left unpriced."
        ),
    )
    serving_gpu_hour_usd: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=3.0,
        description=(
            "USD per GPU-hour of the self-hosted inference server (vLLM or `transformers serve`). Default 3.0: a "
            "typical on-demand H100/H200 rate; set your own."
        ),
    )
    training_gpu_hour_usd: Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default=3.0, description="USD per GPU-hour of training jobs. Default 3.0, as for serving."
    )


class CycleConfig(_Section):
    """One MASS cycle L(generation) → L(generation + 1)."""

    name: str | None = Field(default=None, description="Cycle name; default '<preset>-L<generation>'.")
    preset: Literal["paper", "cycle2", "demo", "custom"] = Field(
        default="custom",
        description=(
            "Which shipped preset this config derives from ('paper', 'cycle2', 'demo') or 'custom'; the paper "
            "presets get the reference's batch rule."
        ),
    )
    generation: NonNegativeInt = Field(
        description=(
            "Generation k of the model that this cycle improves: the cycle turns L(k) into L(k + 1). Reference: "
            "0 (cycle 2: 1)."
        ),
    )
    models: ModelsConfig = Field(
        description="Where the models of this cycle live.",
    )
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig,
        description="The endpoint and token budgets of every model call.",
    )
    tasks: TasksConfig = Field(
        description="Which tasks are searched, trained on and held out.",
    )
    search: SearchConfig = Field(
        default_factory=SearchConfig,
        description="RHI workflow search.",
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig,
        description="Retries and tolerance of judge answers that are not usable verdicts.",
    )
    collection: CollectionConfig = Field(
        default_factory=CollectionConfig,
        description="Teacher collection under the retained workflows.",
    )
    ranking: RankingConfig = Field(
        default_factory=RankingConfig,
        description="Within-task self-ranking of the teacher candidates.",
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="LoRA fine-tuning.",
    )
    export: ExportConfig = Field(
        default_factory=ExportConfig,
        description="Merge and export of the trained model.",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="Rollouts, external judging and the nightly regression check.",
    )
    prompts: PromptsConfig = Field(
        default_factory=PromptsConfig,
        description="The prompt templates every model call is built from (shipped, or replaced from a folder).",
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="Where records and artifacts live (not part of the config hash).",
    )
    compute: ComputeConfig = Field(
        default_factory=ComputeConfig,
        description="Where commands run.",
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="Limits of one episode.",
    )
    budgets: BudgetsConfig = Field(
        default_factory=BudgetsConfig,
        description="Token and cost budgets per episode, task, cycle and for in-loop calls (not part of the hash).",
    )
    prices: PricesConfig = Field(
        default_factory=PricesConfig,
        description="Token and GPU-hour prices of the cost estimate and spend reports (not part of the config hash).",
    )
    promotion: PromotionConfig = Field(
        default_factory=PromotionConfig,
        description="Whether a person approves the new generation before it is served (not part of the hash).",
    )

    @model_validator(mode="after")
    def _cross(self) -> CycleConfig:
        problems = []
        if self.preset in PAPER_PRESETS and self.training.windows_per_step != 3:
            problems.append("training.windows_per_step: the paper presets average exactly 3 windows per step")
        if self.name is not None and not CYCLE_NAME.fullmatch(self.name):
            problems.append("name: must be 1-63 letters, digits, '.', '_' or '-'")
        # TrainingConfig's own fields carry only the generic integer bound; `plan` counts checkpoints and
        # validations step by step, so the step count is bounded here.
        if self.training.steps > MAX_TRAINING_STEPS:
            problems.append(f"training.steps: {self.training.steps} exceeds the maximum of {MAX_TRAINING_STEPS}")
        pool = self.evaluation.tasks or []
        known = set(self.tasks.train_candidates) | set(self.tasks.test)
        stray = sorted(set(pool) - known)
        if stray:
            problems.append(f"evaluation.tasks: {stray} are neither train candidates nor test tasks")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def cycle_name(self) -> str:
        """The cycle's name in the metadata store."""
        return self.name or f"{self.preset}-L{self.generation}"

    def require_catalogue(self) -> str:
        """The chosen task catalogue ('builtin' or a directory); `ConfigError` (one line saying how to choose) when
        `tasks.catalogue` is unset, as the paper and cycle2 presets leave it. `validate` and every stage call this
        before loading tasks; `plan` does not, so it works offline on every preset."""
        if self.tasks.catalogue is None:
            raise ConfigError([CATALOGUE_NOT_CHOSEN])
        return self.tasks.catalogue

    @property
    def catalogue_label(self) -> str:
        """`tasks.catalogue` for display: its value, or 'not chosen' (what `plan` shows for the paper presets)."""
        return self.tasks.catalogue or "not chosen"

    @property
    def is_remote_backend(self) -> bool:
        """OpenRouter serves a model we cannot train or export (MASS_SPEC §1)."""
        return self.inference.backend == "openrouter"

    def rollout_tasks(self) -> list[int]:
        """The evaluation pool: configured, else the SFT tasks plus the test tasks."""
        return list(self.evaluation.tasks) if self.evaluation.tasks else list(self.tasks.train) + list(self.tasks.test)

    def config_hash(self) -> str:
        """SHA-256 of the canonical config without `storage` (where records live is not what the cycle is) and
        `budgets` (raising a budget and rerunning continues the same cycle), `prices` (what things cost) or
        `promotion` (who approves the result)."""
        payload = self.model_dump(mode="json", exclude={"storage", "budgets", "prices", "promotion"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.username is None


def _endpoint_problem(endpoint: str, backend: str) -> str | None:
    """The endpoint rule of MASS_SPEC §1, widened to any http(s) URL since vLLM runs in-cluster."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as exc:
        return f"endpoint {endpoint!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"endpoint {endpoint!r} must be an http(s) URL"
    if parts.username or parts.password:
        return "endpoint must not carry credentials"
    if parts.query or parts.fragment:
        return "endpoint must not carry a query or fragment"
    if backend == "openrouter" and endpoint.rstrip("/") != OPENROUTER_ENDPOINT:
        return f"the openrouter backend needs endpoint {OPENROUTER_ENDPOINT}"
    if backend != "openrouter" and port is None and parts.scheme == "http" and parts.hostname in _LOOPBACK:
        return "a loopback endpoint needs an explicit port"
    return None


_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# --------------------------------------------------------------------------------------------------------------------
# Loading


def preset_path(name: str) -> Path:
    """Path of a shipped preset file."""
    return PRESETS_DIR / f"{name}.yaml"


class _RefusedInput(Exception):
    """A config text that parses but is refused (alias, duplicate key, too deep); the message is the reason."""


class _StrictYAMLLoader(yaml.SafeLoader):
    """A safe loader that refuses anchors and aliases (an alias bomb expands 0.5 KB into gigabytes), duplicate keys
    (YAML keeps the last one silently) and nesting deeper than `MAX_CONFIG_DEPTH` (the composer recurses)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event unannotated
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise _RefusedInput(f"line {line}: YAML aliases (*{event.anchor}) are not allowed")
        if getattr(event, "anchor", None) is not None:
            raise _RefusedInput(f"line {line}: YAML anchors (&{event.anchor}) are not allowed")
        self._depth += 1
        if self._depth > MAX_CONFIG_DEPTH:
            raise _RefusedInput(f"line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise _RefusedInput(f"line {key_node.start_mark.line + 1}: duplicate key {key_node.value!r}")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    loader = _StrictYAMLLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _RefusedInput(f"duplicate key {key!r}")
        result[key] = value
    return result


def _check_depth(value: Any, where: str) -> None:
    """Refuse data nested deeper than `MAX_CONFIG_DEPTH` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_CONFIG_DEPTH:
                raise ConfigError([f"config: {where}: nested deeper than {MAX_CONFIG_DEPTH} levels"])
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def parse_config_text(text: str, kind: Literal["yaml", "json"]) -> Any:
    """Parse config text with every guard (no aliases, no duplicate keys, bounded depth); raise `_RefusedInput`,
    `ValueError` (which includes JSON and integer-size errors) or `yaml.YAMLError` on bad input."""
    try:
        if kind == "json":
            return json.loads(text, object_pairs_hook=_json_object)
        return _load_yaml(text)
    except RecursionError:
        raise _RefusedInput(f"nested deeper than {MAX_CONFIG_DEPTH} levels") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _short(text: str, limit: int = 80) -> str:
    """`repr` of user text cut to `limit` characters, so an error about a huge value stays a short line."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def read_config_source(source: str | Path) -> dict[str, Any]:
    """Read a preset name or a YAML/JSON file into a plain mapping (no validation yet).

    The file must be UTF-8, at most `MAX_CONFIG_BYTES`, nested at most `MAX_CONFIG_DEPTH` levels, without duplicate
    keys and (YAML) without anchors or aliases; anything else is a `ConfigError`.
    """
    text_source = str(source)
    path = preset_path(text_source) if text_source in PRESET_NAMES else Path(text_source)
    if not path.is_file():
        presets = ", ".join(PRESET_NAMES)
        raise ConfigError([f"config: {_short(text_source)}: no such preset or file (presets: {presets})"])
    kind: Literal["yaml", "json"] = "json" if path.suffix == ".json" else "yaml"
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"config: {path}: cannot read ({exc.strerror or exc})"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"config: {path}: larger than {MAX_CONFIG_BYTES} bytes"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config: {path}: not UTF-8 text (invalid byte at offset {exc.start})"]) from None
    try:
        data = parse_config_text(text, kind)
    except _RefusedInput as exc:
        raise ConfigError([f"config: {path}: {exc}"]) from None
    except (ValueError, yaml.YAMLError) as exc:
        label = path.suffix.lstrip(".") or "YAML"
        raise ConfigError([f"config: {path}: not valid {label}: {_first_line(exc)}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config: {path}: the top level must be a mapping"])
    _check_depth(data, str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars/lists (`3`, `true`, `[51, 53]`, `null`).

    Values get the same guards as config files (no aliases, no duplicate keys, bounded depth); a value that is not
    YAML at all is taken as a plain string.
    """
    _check_depth(data, "config")
    result: dict[str, Any] = json.loads(json.dumps(data))
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or not key or any(not part for part in parts):
            problems.append(f"--set {_short(item)}: expected KEY.PATH=VALUE")
            continue
        if len(parts) > MAX_CONFIG_DEPTH:
            problems.append(f"--set {_short(item)}: key nested deeper than {MAX_CONFIG_DEPTH} levels")
            continue
        try:
            value = parse_config_text(raw, "yaml") if raw.strip() else ""
        except _RefusedInput as exc:
            problems.append(f"--set {_short(item)}: {exc}")
            continue
        except ValueError as exc:
            problems.append(f"--set {_short(item)}: {_first_line(exc)}")
            continue
        except yaml.YAMLError:
            value = raw
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"--set {_short(item)}: {part} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    _check_depth(result, "--set")
    return result


def apply_environment(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """MASS_METADATA_URL and MASS_ARTIFACT_URL override the storage URLs of any config."""
    env = os.environ if environ is None else environ
    result = dict(data)
    storage = dict(result.get("storage") or {})
    if env.get(METADATA_URL_ENV):
        storage["metadata_url"] = env[METADATA_URL_ENV]
    if env.get(ARTIFACT_URL_ENV):
        storage["artifact_url"] = env[ARTIFACT_URL_ENV]
    if storage:
        result["storage"] = storage
    return result


def format_validation_error(exc: ValidationError) -> list[str]:
    """One line per problem: `config: <dotted field>: <rule>`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and "(got " not in msg and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        for part in msg.split("; "):
            # Model-level rules name their field as "field: rule"; fold it into the location.
            field, sep, rule = part.partition(": ")
            if sep and re.fullmatch(r"[a-z_][a-z0-9_.]*", field):
                where = field if loc == "(top level)" else f"{loc}.{field}"
                lines.append(f"config: {where}: {rule}")
            else:
                lines.append(f"config: {loc}: {part}")
    return lines


def validate_config(data: Mapping[str, Any]) -> CycleConfig:
    """Validate a mapping into a frozen `CycleConfig`, or raise `ConfigError` listing every problem."""
    try:
        return CycleConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(
    source: str | Path,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> CycleConfig:
    """Preset name or file → overrides → environment → validated config."""
    data = read_config_source(source)
    data = apply_overrides(data, overrides)
    data = apply_environment(data, environ)
    return validate_config(data)


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of the cycle config (drives the Airflow trigger form)."""
    return CycleConfig.model_json_schema()
