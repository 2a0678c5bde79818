"""The model side of a cycle: model identities, the serving endpoint, sampling, token budgets and prompt texts.

`InferenceConfig` checks its token budgets against the context window and its endpoint against MASS_SPEC §1 (any
http(s) URL without credentials, query or fragment; OpenRouter only at its own address).
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, StrictBool, StrictInt, model_validator

from mass_ops.config.section import IDENTIFIER, PositiveInt, Section, StrictFloat

OPENROUTER_ENDPOINT = "https://openrouter.ai/api/v1"


class ModelsConfig(Section):
    """Model identities of the cycle. Relative locations are keys in the artifact store; `s3://…` or absolute paths
    are used as they are."""

    served_name: str = Field(min_length=1, description="Name the inference server serves the current model under.")
    parent_bf16: str = Field(min_length=1, description="BF16 parent: training base and tokenizer.")
    fp8_reference: str | None = Field(
        default=None, description="Official FP8 checkpoint whose layout the FP8 export mirrors; none = default rule."
    )
    next_bf16: str = Field(min_length=1, description="Where the merged BF16 model of the next generation goes.")
    next_fp8: str = Field(min_length=1, description="Where the block-FP8 model of the next generation goes.")


class SamplingConfig(Section):
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


class ServerConfig(Section):
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


class InferenceConfig(Section):
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
        if not IDENTIFIER.fullmatch(self.api_key_env):
            problems.append("api_key_env: must be an environment variable name, not a key")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def effective_tensor_parallel_size(self) -> int:
        """GPUs one served model is split over: `tensor_parallel_size`, else the launched server's GPUs."""
        return self.tensor_parallel_size or self.server.gpus


class PromptsConfig(Section):
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


def is_http_url(url: str) -> bool:
    """Whether `url` is an http(s) URL with a host and no user name."""
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
