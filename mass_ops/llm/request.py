"""Request building: the context guard checked before any request, and the body of a chat completion per backend
(which sampling fields each backend accepts, JSON mode).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from mass_ops.llm.errors import ContextBudgetError, LLMConfigError
from mass_ops.llm.settings import JsonMode, LLMEndpoint, SamplingParams


def estimate_input_tokens(system: str, user: str) -> int:
    """Conservative token estimate of a system+user prompt: max(1, (chars + 3) // 4)."""
    return max(1, (len(system) + len(user) + 3) // 4)


def enforce_context_budget(
    system: str,
    user: str,
    max_output_tokens: int,
    context_window: int,
    safety: int,
    stage: str,
) -> int:
    """Refuse a call whose estimated input + output ceiling exceeds context_window − safety; return the estimate.

    Prompts are never truncated silently: an oversized prompt is an error naming the stage and the numbers.
    """
    estimate = estimate_input_tokens(system, user)
    limit = context_window - safety
    if estimate + max_output_tokens > limit:
        raise ContextBudgetError(
            f"context guard failed for {stage}: estimated input {estimate} + max output {max_output_tokens} = "
            f"{estimate + max_output_tokens} tokens exceeds context window {context_window} - safety {safety} = {limit}"
        )
    return estimate


def _wire_body(request: dict[str, Any]) -> dict[str, Any]:
    """The JSON body `chat.completions.create(**request)` would send: the fields, with `extra_body` merged in."""
    body = {name: copy.deepcopy(value) for name, value in request.items() if name != "extra_body"}
    body.update(copy.deepcopy(request.get("extra_body") or {}))
    return body


def chat_request(
    endpoint: LLMEndpoint,
    system: str,
    user: str,
    sampling: SamplingParams,
    json_mode: JsonMode | None = None,
    schema: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of `chat.completions.create` for `endpoint`'s backend (also what gets recorded)."""
    request: dict[str, Any] = {
        "model": endpoint.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    for name in ("temperature", "top_p", "max_tokens", "seed", "presence_penalty"):
        value = getattr(sampling, name)
        if value is not None:
            request[name] = value
    extra: dict[str, Any] = {}
    if endpoint.backend == "openrouter":
        if sampling.reasoning_effort is not None:
            extra["reasoning"] = {"effort": sampling.reasoning_effort}
    else:
        if sampling.enable_thinking is not None:
            extra["chat_template_kwargs"] = {"enable_thinking": sampling.enable_thinking}
        # vLLM's sampling extensions; other OpenAI-compatible servers (e.g. `transformers serve`) reject them
        # with HTTP 422, so they only go to the vllm backend.
        if sampling.top_k is not None and endpoint.backend == "vllm":
            extra["top_k"] = sampling.top_k
        if sampling.repetition_penalty is not None and endpoint.backend == "vllm":
            extra["repetition_penalty"] = sampling.repetition_penalty
        if sampling.priority is not None and endpoint.backend == "vllm":
            extra["priority"] = sampling.priority
    if extra:
        request["extra_body"] = extra
    if json_mode == "json_object":
        request["response_format"] = {"type": "json_object"}
    elif json_mode == "json_schema":
        if not isinstance(schema, dict) or not schema:
            raise LLMConfigError("json_mode 'json_schema' needs a non-empty schema object")
        name = re.sub(r"[^A-Za-z0-9_-]", "_", str(schema.get("title", "response")))[:64] or "response"
        request["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    elif json_mode is not None:
        raise LLMConfigError(f"json_mode must be None, 'json_object' or 'json_schema', got {json_mode!r}")
    return request
