"""What a call is made with: the endpoint (where, which model, the NAME of the key's variable) and the sampling
knobs, each validated when built (an LLMConfigError names the bad value).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from mass_ops.llm.errors import LLMConfigError

# "anthropic": the Messages API (`mass_ops.llm.messages`), for external judges only; the others speak OpenAI's API.
Backend = Literal["vllm", "openai-compatible", "openrouter", "anthropic"]
JsonMode = Literal["json_object", "json_schema"]

BACKENDS: tuple[str, ...] = ("vllm", "openai-compatible", "openrouter", "anthropic")
# Hosted providers: a call needs a real key (local servers take a placeholder).
_KEYED_BACKENDS = ("openrouter", "anthropic")
REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high")
# vLLM's own default when a server runs without --api-key.
LOCAL_PLACEHOLDER_KEY = "EMPTY"
# OpenRouter routing shortcuts that are accepted in requests but absent from /models.
_OPENROUTER_ROUTING_SUFFIXES = (":nitro", ":floor")
# LM Studio rejects json_object: "'response_format.type' must be 'json_schema' or 'text'".
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LLMConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LLMConfigError(f"{what} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LLMEndpoint:
    """Where and how to call a model. `api_key_env` is the NAME of the variable holding the key, never the key.

    `context_window_tokens`, when set, arms the context guard for every call (with `context_safety_tokens` margin).
    """

    base_url: str
    model: str
    api_key_env: str = "VLLM_API_KEY"
    backend: Backend = "vllm"
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 30.0
    context_window_tokens: int | None = None
    context_safety_tokens: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise LLMConfigError(f"LLM endpoint: backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise LLMConfigError("LLM endpoint: model must be a non-empty string")
        if not isinstance(self.api_key_env, str) or not _ENV_NAME.match(self.api_key_env):
            raise LLMConfigError("LLM endpoint: api_key_env must be an environment variable name, not a key")
        parts = urlsplit(self.base_url) if isinstance(self.base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise LLMConfigError(f"LLM endpoint: base_url must be an http(s) URL, got {self.base_url!r}")
        # Anything that could carry a secret would end up in call records, so refuse it here.
        if parts.username or parts.password or parts.query or parts.fragment:
            raise LLMConfigError("LLM endpoint: base_url must not contain credentials, a query or a fragment")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        _positive_number(self.request_timeout_s, "LLM endpoint: request_timeout_s")
        _positive_number(self.connect_timeout_s, "LLM endpoint: connect_timeout_s")
        if self.context_window_tokens is not None:
            _positive_int(self.context_window_tokens, "LLM endpoint: context_window_tokens")
        safety = self.context_safety_tokens
        if isinstance(safety, bool) or not isinstance(safety, int) or safety < 0:
            raise LLMConfigError(f"LLM endpoint: context_safety_tokens must be an integer ≥ 0, got {safety!r}")

    @property
    def listed_model_id(self) -> str:
        """The id `/models` must list: the request id without OpenRouter routing suffixes such as `:nitro`."""
        if self.backend == "openrouter":
            for suffix in _OPENROUTER_ROUTING_SUFFIXES:
                if self.model.endswith(suffix):
                    return self.model[: -len(suffix)]
        return self.model

    def read_api_key(self) -> str:
        """The key from the environment, read now. Local servers accept a placeholder; hosted providers (OpenRouter,
        Anthropic) need a real key."""
        key = os.environ.get(self.api_key_env, "")
        if not key:
            if self.backend in _KEYED_BACKENDS:
                raise LLMConfigError(f"LLM endpoint: environment variable {self.api_key_env} is empty or unset")
            return LOCAL_PLACEHOLDER_KEY
        if any(ch.isspace() for ch in key):
            raise LLMConfigError(f"LLM endpoint: environment variable {self.api_key_env} contains whitespace")
        return key


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs of one call; None means "not sent". Backend-specific fields are dropped where unsupported:
    top_k, repetition_penalty and priority go to vLLM only, enable_thinking to any non-OpenRouter server,
    reasoning_effort to OpenRouter only.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # Not sampling but scheduling: the request's place in a priority-scheduling vLLM server's queue (lower first;
    # `mass_ops.critical_path.server_priority`). Sent to the vllm backend only.
    priority: int | None = None

    def __post_init__(self) -> None:
        def number(value: object) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

        if self.temperature is not None and (not number(self.temperature) or not 0 <= self.temperature <= 2):
            raise LLMConfigError(f"sampling: temperature must be in [0, 2], got {self.temperature!r}")
        if self.top_p is not None and (not number(self.top_p) or not 0 < self.top_p <= 1):
            raise LLMConfigError(f"sampling: top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1
        ):
            raise LLMConfigError(f"sampling: top_k must be -1 or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None:
            _positive_int(self.max_tokens, "sampling: max_tokens")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise LLMConfigError(f"sampling: seed must be an integer, got {self.seed!r}")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise LLMConfigError(f"sampling: enable_thinking must be a boolean, got {self.enable_thinking!r}")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise LLMConfigError(
                f"sampling: reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {self.reasoning_effort!r}"
            )
        if self.presence_penalty is not None and (not number(self.presence_penalty) or abs(self.presence_penalty) > 2):
            raise LLMConfigError(f"sampling: presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if self.repetition_penalty is not None and (
            not number(self.repetition_penalty) or self.repetition_penalty <= 0
        ):
            raise LLMConfigError(f"sampling: repetition_penalty must be positive, got {self.repetition_penalty!r}")
        if self.priority is not None and (isinstance(self.priority, bool) or not isinstance(self.priority, int)):
            raise LLMConfigError(f"sampling: priority must be an integer, got {self.priority!r}")
