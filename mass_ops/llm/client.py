"""`LLMClient`: the sync chat client of one endpoint (request, retries, LM Studio fallback, recording, validation).

Other routes (the Responses API, Anthropic's Messages API) subclass it and override only the route: request body,
transport, SDK errors and the reading of the answer; the retry rule, budget gate and call records stay this class's.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from mass_ops.llm.errors import ContextBudgetError, LLMConfigError, LLMOutputError, LLMRequestError
from mass_ops.llm.request import _wire_body, chat_request, enforce_context_budget, estimate_input_tokens
from mass_ops.llm.response import (
    JSON_PARSINGS,
    CallGate,
    CallRecord,
    CallRecorder,
    ChatResult,
    JsonParsing,
    _reported_cost,
    _response_document,
    final_content,
    json_object,
)
from mass_ops.llm.retries import RetryPolicy, http_failure, send_with_retries
from mass_ops.llm.settings import JsonMode, LLMEndpoint, SamplingParams

if TYPE_CHECKING:
    import openai


_LM_STUDIO_FORMAT_REJECTION = re.compile(r"response_format\.type'?\s+must be\s+'json_schema'\s+or\s+'text'")


class LLMClient:
    """Sync chat client for one endpoint; reuse it across calls (it pools connections) and close it when done.

    `http_client` replaces the client's own connection pool (which follows no redirects); it is closed with it.
    """

    # What `ChatResult.provider` says when the response names no provider.
    default_provider: str | None = None

    def __init__(
        self,
        endpoint: LLMEndpoint,
        *,
        retry: RetryPolicy | None = None,
        recorder: CallRecorder | None = None,
        sleep: Callable[[float], None] = time.sleep,
        http_client: Any = None,
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

        self._http = http_client if http_client is not None else self._new_http_pool()
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

    def _new_http_pool(self) -> Any:
        """The connection pool every call of this client shares."""
        import openai  # deferred: the SDK takes seconds to import and DAG files must parse fast

        # No redirects: a redirect could forward the bearer token to another host.
        return openai.DefaultHttpxClient(follow_redirects=False)

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
        return chat_request(self.endpoint, system, user, sampling, json_mode, schema)

    def _sdk_errors(self) -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
        """(HTTP status errors, connection errors, timeouts included) of this client's SDK."""
        import openai

        return (openai.APIStatusError,), (openai.APIConnectionError,)

    def _send(self, action: Callable[[], Any], what: str) -> tuple[Any, int, Exception | None]:
        """Run `action`, retrying transient failures; returns (result, attempts, None) or (None, attempts, error)."""
        status_errors, connection_errors = self._sdk_errors()

        def classify(error: Exception) -> LLMRequestError | str | None:
            if isinstance(error, status_errors):
                failed: Any = error  # every SDK's status error carries status_code, body and message
                return http_failure(what, failed.status_code, failed.body, failed.message)
            if isinstance(error, connection_errors):
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
        json_parsing: JsonParsing = "lenient",
    ) -> ChatResult:
        """One system+user chat completion. JSON calls return the parsed object in `parsed_json`, read from the
        answer under `json_parsing` (`mass_ops.llm.response`: lenient, or strict as the reference reads it).

        Order: context guard and key check (no request on failure), request with transient retries, LM Studio
        fallback without response_format (JSON calls on local backends, once), output validation. Every call that
        reached the network is passed to the recorder, including failed ones, before the error is raised.
        """
        if not isinstance(purpose, str) or not purpose.strip():
            raise LLMConfigError("chat: purpose must name the calling stage, e.g. 'rank.judge'")
        if json_parsing not in JSON_PARSINGS:
            raise LLMConfigError(f"chat: json_parsing must be one of {list(JSON_PARSINGS)}, got {json_parsing!r}")
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
            return self._chat(
                sdk, request, purpose=purpose, sampling=sampling, json_mode=json_mode, json_parsing=json_parsing
            )
        finally:
            if release is not None:
                release()

    def _send_with_fallback(
        self, sdk: openai.OpenAI, request: dict[str, Any], purpose: str, json_mode: JsonMode | None
    ) -> tuple[Any, int, Exception | None, dict[str, Any], dict[str, Any]]:
        """Send `request` with transient retries; a JSON call that LM Studio refuses for its response_format is sent
        once more without it. Returns (response, attempts, error, the request last sent, the fallback note that is
        recorded with the request)."""
        attempts = 0
        fallback_used = False
        while True:
            body = _wire_body(request)
            response, used, error = self._send(functools.partial(self._post_completion, sdk, body), purpose)
            attempts += used
            if (
                isinstance(error, LLMRequestError)
                and error.status_code == 400
                and json_mode is not None
                and not fallback_used
                and self.endpoint.backend != "openrouter"
                and _LM_STUDIO_FORMAT_REJECTION.search(str(error))
            ):
                fallback_used = True
                request = {k: v for k, v in request.items() if k != "response_format"}
                continue
            return response, attempts, error, request, {"response_format_fallback": fallback_used}

    def _record_call(
        self,
        *,
        purpose: str,
        seed: int | None,
        attempts: int,
        latency_s: float,
        request: dict[str, Any],
        status: Literal["ok", "error"],
        usage: dict[str, Any] | None,
        cost: float | None,
        response: dict[str, Any] | None,
        failure: str | None,
    ) -> None:
        """Hand the call's record to the recorder, if there is one."""
        if self.recorder is not None:
            e = self.endpoint
            self.recorder(
                CallRecord(
                    purpose=purpose,
                    backend=e.backend,
                    base_url=e.base_url,
                    model=e.model,
                    seed=seed,
                    status=status,
                    attempts=attempts,
                    latency_s=latency_s,
                    usage=usage,
                    cost_usd=cost,
                    request=request,
                    response=response,
                    error=failure,
                )
            )

    def _chat(
        self,
        sdk: openai.OpenAI,
        request: dict[str, Any],
        *,
        purpose: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None,
        json_parsing: JsonParsing = "lenient",
    ) -> ChatResult:
        """`chat` from the first request on (retries, fallback, recording, output validation)."""
        e = self.endpoint
        started = time.monotonic()
        response, attempts, error, request, note = self._send_with_fallback(sdk, request, purpose, json_mode)
        recorded_request = dict(request, **note)
        latency = time.monotonic() - started
        record = functools.partial(
            self._record_call,
            purpose=purpose,
            seed=request.get("seed"),  # the seed sent: routes that take none record none
            attempts=attempts,
            latency_s=latency,
            request=recorded_request,
        )
        if error is not None:
            record(status="error", usage=None, cost=None, response=None, failure=str(error))
            raise error
        try:
            raw = self._document(response)
        except LLMOutputError as output_error:
            record(status="error", usage=None, cost=None, response=None, failure=str(output_error))
            raise
        usage = self._usage(raw)
        cost = _reported_cost(usage, e.backend)
        try:
            content, reasoning, finish, parsed = self._read_answer(raw, json_mode, json_parsing)
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
            provider=raw.get("provider", self.default_provider),
            response_id=raw.get("id"),
        )

    def _read_answer(
        self, raw: dict[str, Any], json_mode: JsonMode | None, json_parsing: JsonParsing
    ) -> tuple[str, str | None, str | None, dict[str, Any] | None]:
        """(content, reasoning, finish reason, the JSON object of a JSON call) of a response document; an unusable
        answer is an LLMOutputError."""
        content, reasoning, finish = self._final_content(raw)
        return content, reasoning, finish, self._json_object(content, json_parsing) if json_mode is not None else None

    # The route's readings of a response document; a client for another route (the Responses API) overrides them.
    _document = staticmethod(_response_document)
    _final_content = staticmethod(final_content)
    _json_object = staticmethod(json_object)

    @staticmethod
    def _usage(raw: dict[str, Any]) -> dict[str, Any]:
        """The usage document of a response, with the chat-completions counters the ledger reads."""
        usage = raw.get("usage")
        return usage if isinstance(usage, dict) else {}

    def verify_model(self) -> list[str]:
        """Check that `/models` lists the endpoint's model (OpenRouter: without `:nitro`); returns the listed ids."""
        e = self.endpoint
        sdk = self._sdk()
        listed: list[str]
        listed, _, error = self._send(lambda: [model.id for model in sdk.models.list()], "model listing")
        if error is not None:
            raise error
        if e.listed_model_id not in listed:
            shown = ", ".join(sorted(listed)[:10]) or "none"
            raise LLMConfigError(f"model {e.listed_model_id!r} is not served at {e.base_url} (listed: {shown})")
        return listed
