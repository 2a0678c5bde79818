"""`ResponsesClient`: the chat contract of `LLMClient` over the OpenAI Responses API (``POST /responses``).

The reference's external gpt-5.5 judge speaks this API: the system prompt as ``instructions``, the user message as
``input``, ``text.format`` json_object for JSON calls, ``reasoning.effort`` as configured (e.g. ``xhigh``) and an
output cap (``max_output_tokens``) only where one is configured. Like the reference, a request whose
``temperature`` or ``reasoning`` the model rejects (HTTP 400 naming it) is sent again without that parameter; the
dropped names are recorded with the request.

Everything else is `LLMClient`'s: the key read from the environment per call (never stored or recorded), no
redirects, timeouts, transient retries, the budget gate and call records. The answer is the concatenated
``output_text`` parts of the output messages; usage (``input_tokens``/``output_tokens``) is recorded with the
chat-completions counters (``prompt_tokens``/``completion_tokens``) the ledger and reports read.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from mass_ops.llm.client import LLMClient
from mass_ops.llm.errors import LLMConfigError, LLMOutputError, LLMRequestError
from mass_ops.llm.response import JsonParsing, extract_json_object, whole_json_object
from mass_ops.llm.settings import JsonMode, LLMEndpoint, SamplingParams

if TYPE_CHECKING:
    import openai

# Parameters the reference drops, one at a time, when the model rejects them with HTTP 400.
_DROPPABLE = ("temperature", "reasoning")


class ResponsesClient(LLMClient):
    """`LLMClient` for an OpenAI Responses-API endpoint (external judges); `reasoning_effort` is sent as is."""

    def __init__(self, endpoint: LLMEndpoint, *, reasoning_effort: str | None = None, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self.reasoning_effort = reasoning_effort

    def __repr__(self) -> str:
        e = self.endpoint
        return f"ResponsesClient(base_url={e.base_url!r}, model={e.model!r})"

    def build_request(
        self,
        system: str,
        user: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of ``POST /responses`` (also what gets recorded; never the key). The Responses API takes no
        seed, top-k or thinking switch: those sampling fields are not sent."""
        request: dict[str, Any] = {"model": self.endpoint.model, "instructions": system, "input": user}
        if json_mode == "json_object":
            request["text"] = {"format": {"type": "json_object"}}
        elif json_mode == "json_schema":
            if not isinstance(schema, dict) or not schema:
                raise LLMConfigError("json_mode 'json_schema' needs a non-empty schema object")
            name = str(schema.get("title") or "response")[:64]
            request["text"] = {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}}
        elif json_mode is not None:
            raise LLMConfigError(f"json_mode must be None, 'json_object' or 'json_schema', got {json_mode!r}")
        if sampling.temperature is not None:
            request["temperature"] = sampling.temperature
        if sampling.top_p is not None:
            request["top_p"] = sampling.top_p
        if self.reasoning_effort:
            request["reasoning"] = {"effort": self.reasoning_effort}
        if sampling.max_tokens is not None:
            request["max_output_tokens"] = sampling.max_tokens
        return request

    def _post_completion(self, sdk: openai.OpenAI, body: dict[str, Any]) -> Any:
        return sdk.post("/responses", body=body, cast_to=self._raw_response)

    def _send_with_fallback(
        self, sdk: openai.OpenAI, request: dict[str, Any], purpose: str, json_mode: JsonMode | None
    ) -> tuple[Any, int, Exception | None, dict[str, Any], dict[str, Any]]:
        """Send with transient retries; drop `temperature`/`reasoning` once each when a 400 names it."""
        attempts = 0
        dropped: list[str] = []
        while True:
            body = dict(request)
            response, used, error = self._send(functools.partial(self._post_completion, sdk, body), purpose)
            attempts += used
            if isinstance(error, LLMRequestError) and error.status_code == 400:
                message = str(error).lower()
                rejected = next((name for name in _DROPPABLE if name in request and name in message), None)
                if rejected is not None:
                    dropped.append(rejected)
                    request = {k: v for k, v in request.items() if k != rejected}
                    continue
            return response, attempts, error, request, {"dropped_parameters": dropped}

    @staticmethod
    def _final_content(raw: dict[str, Any]) -> tuple[str, str | None, str | None]:
        return responses_content(raw)

    @staticmethod
    def _json_object(text: str | None, parsing: JsonParsing) -> dict[str, Any]:
        # Strict: the reference validates the whole answer text as the verdict JSON, with no extraction.
        return whole_json_object(text) if parsing == "strict" else extract_json_object(text)

    @staticmethod
    def _usage(raw: dict[str, Any]) -> dict[str, Any]:
        return responses_usage(raw.get("usage"))


def responses_content(raw: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """(answer text, reasoning summary, status) of a Responses-API document; failed, refused or empty answers are
    LLMOutputError.

    The answer is the document's ``output_text`` where a server provides it, else the ``output_text`` parts of its
    ``message`` items joined (what the OpenAI SDK's ``output_text`` gives), trimmed.
    """
    if raw.get("error"):
        raise LLMOutputError(f"response carries an error: {json.dumps(raw['error'], default=str)[:500]}")
    status = raw.get("status") if isinstance(raw.get("status"), str) else None
    if status in ("failed", "cancelled"):
        raise LLMOutputError(f"response {status}")
    texts: list[str] = []
    refusals: list[str] = []
    summaries: list[str] = []
    for item in raw.get("output") or []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "reasoning":
            summaries.extend(str(part.get("text", "")) for part in item.get("summary") or [] if isinstance(part, dict))
        if item.get("type") != "message":
            continue
        for part in item.get("content") or []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "refusal":
                refusals.append(str(part.get("refusal", "")))
    given = raw.get("output_text")
    text = (given if isinstance(given, str) and given.strip() else "".join(texts)).strip()
    reasoning = "\n".join(summary for summary in summaries if summary) or None
    if not text:
        if refusals:
            raise LLMOutputError(f"model refused: {' '.join(refusals)[:500]}")
        details = raw.get("incomplete_details")
        why = f" (incomplete: {json.dumps(details, default=str)[:200]})" if status == "incomplete" else ""
        raise LLMOutputError(f"empty final content{why}")
    return text, reasoning, status


def responses_usage(usage: Any) -> dict[str, Any]:
    """Responses-API usage with the chat-completions counters added (prompt, completion, total, cached prompt and
    reasoning tokens), so the ledger, budgets and reports read it like any other call's."""
    if not isinstance(usage, dict):
        return {}

    def count(document: Any, name: str) -> int | None:
        value = document.get(name) if isinstance(document, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    prompt, completion = count(usage, "input_tokens"), count(usage, "output_tokens")
    mapped: dict[str, Any] = dict(usage)
    if prompt is not None:
        mapped["prompt_tokens"] = prompt
    if completion is not None:
        mapped["completion_tokens"] = completion
    total = count(usage, "total_tokens")
    if total is None and prompt is not None and completion is not None:
        total = prompt + completion
    if total is not None:
        mapped["total_tokens"] = total
    cached = count(usage.get("input_tokens_details"), "cached_tokens")
    if cached is not None:
        mapped["prompt_tokens_details"] = {"cached_tokens": cached}
    reasoning = count(usage.get("output_tokens_details"), "reasoning_tokens")
    if reasoning is not None:
        mapped["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return mapped
