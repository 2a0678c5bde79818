"""OpenAI-compatible chat client for the in-loop judge and optimizer calls (MASS_SPEC §3.3 "LLM backend").

One `LLMClient` per endpoint: system+user chat completions, JSON mode with the LM Studio fallback, the conservative
context guard (checked before any request), our own retry policy for transient failures only, and usage/cost
accounting. The API key is read from the environment variable named by the endpoint at call time; it is never stored
on objects, in requests, results or call records. Persistence is the caller's business: pass a `CallRecorder`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

from mass_ops.errors import InfrastructureError, InputError

if TYPE_CHECKING:
    import openai

Backend = Literal["vllm", "openai-compatible", "openrouter"]
JsonMode = Literal["json_object", "json_schema"]

BACKENDS: tuple[str, ...] = ("vllm", "openai-compatible", "openrouter")
REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high")
# vLLM's own default when a server runs without --api-key.
LOCAL_PLACEHOLDER_KEY = "EMPTY"
# OpenRouter routing shortcuts that are accepted in requests but absent from /models.
_OPENROUTER_ROUTING_SUFFIXES = (":nitro", ":floor")
# LM Studio rejects json_object: "'response_format.type' must be 'json_schema' or 'text'".
_LM_STUDIO_FORMAT_REJECTION = re.compile(r"response_format\.type'?\s+must be\s+'json_schema'\s+or\s+'text'")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FENCED_JSON = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL | re.IGNORECASE)


class LLMError(Exception):
    """Base of every failure raised by this module."""


class LLMConfigError(LLMError, InputError):
    """The endpoint or call is misconfigured (bad URL, missing key, unknown model, bad sampling values)."""


class ContextBudgetError(LLMError, InputError):
    """The prompt plus the output ceiling would not fit the context window; raised before any request."""


class LLMOutputError(LLMError, InputError):
    """The model answered, but the answer is unusable (empty, refused, not a JSON object)."""


class LLMRequestError(LLMError, InfrastructureError):
    """The server rejected the request with a non-retryable HTTP status (4xx, redirects)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class LLMUnavailableError(LLMError, InfrastructureError):
    """Transient failures (connection, timeout, 5xx) persisted through every allowed attempt."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


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
        """The key from the environment, read now. Local servers accept a placeholder; OpenRouter needs a real key."""
        key = os.environ.get(self.api_key_env, "")
        if not key:
            if self.backend == "openrouter":
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


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per request for transient failures and the exponential backoff between them."""

    max_attempts: int = 4
    initial_backoff_s: float = 2.0
    multiplier: float = 2.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        _positive_int(self.max_attempts, "retry: max_attempts")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise LLMConfigError(f"retry: {name} must be a number ≥ 0, got {value!r}")
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float) or self.multiplier < 1:
            raise LLMConfigError(f"retry: multiplier must be ≥ 1, got {self.multiplier!r}")

    def backoff_s(self, failures: int) -> float:
        """Delay after the `failures`-th consecutive transient failure (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (failures - 1))


def send_with_retries(
    action: Callable[[], Any],
    classify: Callable[[Exception], LLMRequestError | str | None],
    retry: RetryPolicy,
    sleep: Callable[[float], None],
    *,
    what: str,
    where: str,
) -> tuple[Any, int, Exception | None]:
    """The retry rule of every LLM client: run `action`; `classify` turns a failure into a permanent error (returned
    at once, never retried), a transient reason (retried with `retry`'s backoff until its attempts are spent, then an
    LLMUnavailableError) or None (not ours: re-raised). Returns (result, attempts, None) or (None, attempts, error)."""
    failures = 0
    while True:
        try:
            return action(), failures + 1, None
        except Exception as error:
            verdict = classify(error)
            if verdict is None:
                raise
            if isinstance(verdict, LLMRequestError):
                return None, failures + 1, verdict
            reason = verdict
        failures += 1
        if failures >= retry.max_attempts:
            return (
                None,
                failures,
                LLMUnavailableError(f"{what} failed after {failures} attempts at {where}: {reason}", failures),
            )
        sleep(retry.backoff_s(failures))


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
            value = json.loads(candidate)
        except (json.JSONDecodeError, RecursionError):  # a degenerate "[[[[…" answer nests past the parser's stack
            continue
        if not isinstance(value, dict):
            raise LLMOutputError(f"model output must be a JSON object, got {type(value).__name__}")
        return value
    raise LLMOutputError(f"model output contains no JSON object: {text[:200]!r}")


def _reported_cost(usage: dict[str, Any], backend: str) -> float | None:
    cost = usage.get("cost")
    if isinstance(cost, int | float) and not isinstance(cost, bool) and math.isfinite(cost):
        return float(cost)
    # A local vLLM server costs nothing per call; other providers that do not report a cost stay unknown.
    return 0.0 if backend == "vllm" else None


def _wire_body(request: dict[str, Any]) -> dict[str, Any]:
    """The JSON body `chat.completions.create(**request)` would send: the fields, with `extra_body` merged in."""
    body = {name: copy.deepcopy(value) for name, value in request.items() if name != "extra_body"}
    body.update(copy.deepcopy(request.get("extra_body") or {}))
    return body


def _response_document(response: Any) -> dict[str, Any]:
    """The JSON object of a completion response; LLMOutputError when the body is not one."""
    try:
        document = json.loads(response.content)
    except (ValueError, RecursionError):
        raise LLMOutputError(f"response body is not JSON: {response.content[:200]!r}") from None
    if not isinstance(document, dict):
        raise LLMOutputError(f"response body must be a JSON object, got {type(document).__name__}")
    return document


def _status_message(error: openai.APIStatusError) -> str:
    body = error.body
    detail = json.dumps(body, default=str) if body is not None else error.message
    return f"HTTP {error.status_code}: {detail}"[:2000]


class LLMClient:
    """Sync chat client for one endpoint; reuse it across calls (it pools connections) and close it when done."""

    def __init__(
        self,
        endpoint: LLMEndpoint,
        *,
        retry: RetryPolicy | None = None,
        recorder: CallRecorder | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.endpoint = endpoint
        self.retry = retry or RetryPolicy()
        self.recorder = recorder
        # Budgets: `gate` admits every call before it is sent; `budget_limits` are the cycle's limits that
        # `llm.calls.open_client` attaches for the `CallLedger` that binds this client.
        self.gate: CallGate | None = None
        self.budget_limits: Any = None
        self._sleep = sleep
        import httpx  # deferred with the SDK; imported here, once, because a first import racing in threads fails
        import openai  # deferred: the SDK takes seconds to import and DAG files must parse fast

        # No redirects: a redirect could forward the bearer token to another host.
        self._http = openai.DefaultHttpxClient(follow_redirects=False)
        self._raw_response: type = httpx.Response

    def __repr__(self) -> str:
        e = self.endpoint
        return f"LLMClient(backend={e.backend!r}, base_url={e.base_url!r}, model={e.model!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sdk(self) -> openai.OpenAI:
        # A fresh SDK object per call keeps the key out of long-lived state; the HTTP pool is shared.
        import openai

        e = self.endpoint
        return openai.OpenAI(
            api_key=e.read_api_key(),
            base_url=e.base_url,
            max_retries=0,
            timeout=openai.Timeout(e.request_timeout_s, connect=e.connect_timeout_s),
            http_client=self._http,
        )

    def _post_completion(self, sdk: openai.OpenAI, body: dict[str, Any]) -> Any:
        """POST /chat/completions through the SDK's transport (auth, timeouts, status errors); the raw response.

        The typed `chat.completions.create` costs about a millisecond of CPU per call to validate the request and
        build response models that are dumped back to a dict at once: in a process making hundreds of calls from
        many threads that is CPU the other threads wait for. The body is the same document, built by `build_request`.
        """
        return sdk.post("/chat/completions", body=body, cast_to=self._raw_response)

    def build_request(
        self,
        system: str,
        user: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of `chat.completions.create` for this backend (also what gets recorded)."""
        request: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        for name in ("temperature", "top_p", "max_tokens", "seed", "presence_penalty"):
            value = getattr(sampling, name)
            if value is not None:
                request[name] = value
        extra: dict[str, Any] = {}
        if self.endpoint.backend == "openrouter":
            if sampling.reasoning_effort is not None:
                extra["reasoning"] = {"effort": sampling.reasoning_effort}
        else:
            if sampling.enable_thinking is not None:
                extra["chat_template_kwargs"] = {"enable_thinking": sampling.enable_thinking}
            # vLLM's sampling extensions; other OpenAI-compatible servers (e.g. `transformers serve`) reject them
            # with HTTP 422, so they only go to the vllm backend.
            if sampling.top_k is not None and self.endpoint.backend == "vllm":
                extra["top_k"] = sampling.top_k
            if sampling.repetition_penalty is not None and self.endpoint.backend == "vllm":
                extra["repetition_penalty"] = sampling.repetition_penalty
            if sampling.priority is not None and self.endpoint.backend == "vllm":
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

    def _send(self, action: Callable[[], Any], what: str) -> tuple[Any, int, Exception | None]:
        """Run `action`, retrying transient failures; returns (result, attempts, None) or (None, attempts, error)."""
        import openai

        def classify(error: Exception) -> LLMRequestError | str | None:
            if isinstance(error, openai.APIStatusError):
                if error.status_code < 500:
                    return LLMRequestError(f"{what} rejected: {_status_message(error)}", error.status_code)
                return _status_message(error)
            if isinstance(error, openai.APIConnectionError):  # includes timeouts
                return f"{type(error).__name__}: {error}"
            return None

        return send_with_retries(action, classify, self.retry, self._sleep, what=what, where=self.endpoint.base_url)

    def chat(
        self,
        system: str,
        user: str,
        *,
        purpose: str,
        sampling: SamplingParams | None = None,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
    ) -> ChatResult:
        """One system+user chat completion. JSON calls return the parsed object in `parsed_json`.

        Order: context guard and key check (no request on failure), request with transient retries, LM Studio
        fallback without response_format (JSON calls on local backends, once), output validation. Every call that
        reached the network is passed to the recorder, including failed ones, before the error is raised.
        """
        if not isinstance(purpose, str) or not purpose.strip():
            raise LLMConfigError("chat: purpose must name the calling stage, e.g. 'rank.judge'")
        sampling = sampling or SamplingParams()
        e = self.endpoint
        if e.context_window_tokens is not None:
            if sampling.max_tokens is None:
                raise ContextBudgetError(f"context guard for {purpose}: sampling.max_tokens must be set")
            enforce_context_budget(
                system, user, sampling.max_tokens, e.context_window_tokens, e.context_safety_tokens, purpose
            )
        request = self.build_request(system, user, sampling, json_mode, schema)
        sdk = self._sdk()
        release = None
        if self.gate is not None:  # after every local check, before the network: a refused call sends nothing
            release = self.gate.admit(purpose, estimate_input_tokens(system, user) + (sampling.max_tokens or 0))
        try:
            return self._chat(sdk, request, purpose=purpose, sampling=sampling, json_mode=json_mode)
        finally:
            if release is not None:
                release()

    def _chat(
        self,
        sdk: openai.OpenAI,
        request: dict[str, Any],
        *,
        purpose: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None,
    ) -> ChatResult:
        """`chat` from the first request on (retries, fallback, recording, output validation)."""
        e = self.endpoint
        started = time.monotonic()
        attempts = 0
        fallback_used = False
        while True:
            body = _wire_body(request)
            response, used, error = self._send(lambda body=body: self._post_completion(sdk, body), purpose)
            attempts += used
            if (
                isinstance(error, LLMRequestError)
                and error.status_code == 400
                and json_mode is not None
                and not fallback_used
                and e.backend != "openrouter"
                and _LM_STUDIO_FORMAT_REJECTION.search(str(error))
            ):
                fallback_used = True
                request = {k: v for k, v in request.items() if k != "response_format"}
                continue
            break
        recorded_request = dict(request, response_format_fallback=fallback_used)
        latency = time.monotonic() - started

        def record(
            *,
            status: Literal["ok", "error"],
            usage: dict[str, Any] | None,
            cost: float | None,
            response: dict[str, Any] | None,
            failure: str | None,
        ) -> None:
            if self.recorder is not None:
                self.recorder(
                    CallRecord(
                        purpose=purpose,
                        backend=e.backend,
                        base_url=e.base_url,
                        model=e.model,
                        seed=sampling.seed,
                        status=status,
                        attempts=attempts,
                        latency_s=latency,
                        usage=usage,
                        cost_usd=cost,
                        request=recorded_request,
                        response=response,
                        error=failure,
                    )
                )

        if error is not None:
            record(status="error", usage=None, cost=None, response=None, failure=str(error))
            raise error
        try:
            raw = _response_document(response)
        except LLMOutputError as output_error:
            record(status="error", usage=None, cost=None, response=None, failure=str(output_error))
            raise
        usage = raw.get("usage") or {}
        cost = _reported_cost(usage, e.backend)
        try:
            content, reasoning, finish = self._final_content(raw)
            parsed = extract_json_object(content) if json_mode is not None else None
        except LLMOutputError as output_error:
            record(status="error", usage=usage, cost=cost, response=raw, failure=str(output_error))
            raise
        record(status="ok", usage=usage, cost=cost, response=raw, failure=None)
        return ChatResult(
            content=content,
            reasoning_content=reasoning,
            parsed_json=parsed,
            usage=usage,
            cost_usd=cost,
            latency_s=latency,
            model=e.model,
            served_model=raw.get("model"),
            attempts=attempts,
            request=recorded_request,
            finish_reason=finish,
            provider=raw.get("provider"),
            response_id=raw.get("id"),
        )

    @staticmethod
    def _final_content(raw: dict[str, Any]) -> tuple[str, str | None, str | None]:
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

    def verify_model(self) -> list[str]:
        """Check that `/models` lists the endpoint's model (OpenRouter: without `:nitro`); returns the listed ids."""
        e = self.endpoint
        sdk = self._sdk()
        listed, _, error = self._send(lambda: [model.id for model in sdk.models.list()], "model listing")
        if error is not None:
            raise error
        if e.listed_model_id not in listed:
            shown = ", ".join(sorted(listed)[:10]) or "none"
            raise LLMConfigError(f"model {e.listed_model_id!r} is not served at {e.base_url} (listed: {shown})")
        return listed
