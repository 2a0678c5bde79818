"""What comes back from a call: the result, the record a recorder persists, usage and cost read from the response,
and the validation of the answer (empty or refused content, the JSON object of a JSON call).

The JSON object of a JSON call is read in one of two ways (`JsonParsing`, chosen per call): ``lenient`` tries the
whole text, its outermost {...} slice and every fenced block (`extract_json_object`); ``strict`` reads it exactly as
the reference does on the call's route — `strict_json_object` for chat completions, `whole_json_object` for the
Responses API, `fenced_json_object` for Anthropic's Messages API.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mass_ops.llm.errors import LLMOutputError
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

_FENCED_JSON = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL | re.IGNORECASE)
# The reference's fence: case-sensitive, an object right after the fence's optional tag, only the first match used.
_STRICT_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)

_SURROGATE = re.compile("[\ud800-\udfff]")

JsonParsing = Literal["lenient", "strict"]
JSON_PARSINGS: tuple[str, ...] = ("lenient", "strict")


@dataclass(frozen=True)
class ChatResult:
    """A successful call: final content apart from reasoning, the parsed JSON object for JSON calls, accounting."""

    content: str
    reasoning_content: str | None
    parsed_json: dict[str, Any] | None
    usage: dict[str, Any]
    cost_usd: float | None
    latency_s: float
    model: str
    served_model: str | None
    attempts: int
    request: dict[str, Any] = field(repr=False)
    finish_reason: str | None = None
    provider: str | None = None
    response_id: str | None = None

    @property
    def cached_prompt_tokens(self) -> int | None:
        """Prompt tokens the server served from its prompt cache, where it reports them."""
        return cached_prompt_tokens(self.usage)


@dataclass(frozen=True)
class CallRecord:
    """What a recorder receives after every call that reached the network, successful or not (never the key)."""

    purpose: str
    backend: str
    base_url: str
    model: str
    seed: int | None
    status: Literal["ok", "error"]
    attempts: int
    latency_s: float
    usage: dict[str, Any] | None
    cost_usd: float | None
    request: dict[str, Any]
    response: dict[str, Any] | None
    error: str | None = None


class CallGate(Protocol):
    """Admits a call before it is sent (budgets): returns a release to call once the call has ended, or raises
    (e.g. `mass_ops.store.budgets.BudgetExhaustedError`) so that nothing is sent."""

    def admit(self, purpose: str, need_tokens: int) -> Callable[[], None]: ...


def cached_prompt_tokens(usage: dict[str, Any] | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (prompt-cache hits) where the server reports it, else None."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


class CallRecorder(Protocol):
    """Persists call records (artifact store + metadata DB in the stage layer)."""

    def __call__(self, record: CallRecord) -> None: ...


def extract_json_object(text: str | None) -> dict[str, Any]:
    """The JSON object in a model answer: the whole text, else its outermost {...} slice, else a ```json block.

    Raises LLMOutputError for empty text, for JSON that is not an object, or when no candidate parses.
    """
    if text is None or not text.strip():
        raise LLMOutputError("empty final content")
    candidates = [text]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    candidates.extend(match.group(1) for match in _FENCED_JSON.finditer(text))
    for candidate in candidates:
        try:
            value = loads_untrusted(candidate, what="model output")
        except UntrustedInputError:  # not JSON, or a degenerate "[[[[…" answer nested past the depth limit
            continue
        if not isinstance(value, dict):
            raise LLMOutputError(f"model output must be a JSON object, got {type(value).__name__}")
        return value
    raise LLMOutputError(f"model output contains no JSON object: {text[:200]!r}")


def strict_json_object(text: str | None) -> dict[str, Any]:
    """The JSON object of a chat-completions JSON call as the reference reads it (`JsonParsing` ``strict``).

    The trimmed text as one JSON document; only when that is not JSON, its outermost {...} slice, then the first
    fenced block holding an object (a later fenced block is never tried). A document that parses to something
    other than an object is an error, with no fallback. Raises LLMOutputError.
    """
    stripped = (text or "").strip()
    if not stripped:
        raise LLMOutputError("empty final content")
    try:
        value = loads_untrusted(stripped, what="model output")
    except UntrustedInputError:
        candidates = []
        start, end = stripped.find("{"), stripped.rfind("}")
        if start >= 0 and end > start:
            candidates.append(stripped[start : end + 1])
        fenced = _STRICT_FENCE.search(stripped)
        if fenced:
            candidates.append(fenced.group(1))
        value = _first_parsed(candidates)
        if value is None:
            raise LLMOutputError(f"model output contains no JSON object: {stripped[:200]!r}") from None
    if not isinstance(value, dict):
        raise LLMOutputError(f"model output must be a JSON object, got {type(value).__name__}")
    return value


def whole_json_object(text: str | None) -> dict[str, Any]:
    """The trimmed text as one JSON object and nothing else: the reference's reading of a Responses-API answer (a
    JSON-mode validation of the whole text: no extraction, and no lone UTF-16 surrogate in any string)."""
    stripped = (text or "").strip()
    if not stripped:
        raise LLMOutputError("empty final content")
    try:
        value = loads_untrusted(stripped, what="model output")
    except UntrustedInputError as exc:
        raise LLMOutputError(f"model output is not one JSON document ({exc}): {stripped[:200]!r}") from None
    if not isinstance(value, dict):
        raise LLMOutputError(f"model output must be a JSON object, got {type(value).__name__}")
    if _holds_surrogate(value):
        raise LLMOutputError("model output holds a lone UTF-16 surrogate escape")
    return value


def fenced_json_object(text: str | None) -> dict[str, Any]:
    """The reference's reading of an Anthropic answer: the first fenced block holding an object, else the outermost
    {...} slice, else the whole trimmed text — then that candidate exactly as `whole_json_object` reads it."""
    stripped = (text or "").strip()
    fenced = _STRICT_FENCE.search(stripped)
    start, end = stripped.find("{"), stripped.rfind("}")
    if fenced:
        candidate = fenced.group(1)
    elif start != -1 and end > start:
        candidate = stripped[start : end + 1]
    else:
        candidate = stripped
    return whole_json_object(candidate)


def json_object(text: str | None, parsing: JsonParsing) -> dict[str, Any]:
    """The JSON object of a chat-completions answer under `parsing` (see the module docstring)."""
    if parsing not in JSON_PARSINGS:
        raise ValueError(f"json parsing must be one of {list(JSON_PARSINGS)}, got {parsing!r}")
    return strict_json_object(text) if parsing == "strict" else extract_json_object(text)


def _first_parsed(candidates: list[str]) -> Any:
    """The first candidate that parses as JSON, or None."""
    for candidate in candidates:
        try:
            return loads_untrusted(candidate, what="model output")
        except UntrustedInputError:
            continue
    return None


def _holds_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in a parsed JSON document holds a surrogate code point, without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _reported_cost(usage: dict[str, Any], backend: str) -> float | None:
    cost = usage.get("cost")
    if isinstance(cost, int | float) and not isinstance(cost, bool) and math.isfinite(cost):
        return float(cost)
    # A local vLLM server costs nothing per call; other providers that do not report a cost stay unknown.
    return 0.0 if backend == "vllm" else None


def _response_document(response: Any) -> dict[str, Any]:
    """The JSON object of a completion response; LLMOutputError when the body is not one."""
    try:
        document = loads_untrusted(response.content, what="response body")
    except UntrustedInputError:
        raise LLMOutputError(f"response body is not JSON: {response.content[:200]!r}") from None
    if not isinstance(document, dict):
        raise LLMOutputError(f"response body must be a JSON object, got {type(document).__name__}")
    return document


def final_content(raw: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """(content, reasoning, finish_reason) of the first choice; empty or refused answers are errors."""
    if raw.get("error"):
        raise LLMOutputError(f"response carries an error: {json.dumps(raw['error'], default=str)[:500]}")
    choices = raw.get("choices") or []
    if not choices:
        raise LLMOutputError("response has no choices")
    message = choices[0].get("message") or {}
    # vLLM's reasoning parser uses reasoning_content (newer releases: reasoning); OpenRouter uses reasoning.
    reasoning = message.get("reasoning_content") or message.get("reasoning") or None
    if message.get("refusal"):
        raise LLMOutputError(f"model refused: {str(message['refusal'])[:500]}")
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        if reasoning:
            raise LLMOutputError("empty final content: output ceiling consumed by reasoning")
        raise LLMOutputError("empty final content")
    return content, reasoning, choices[0].get("finish_reason")
