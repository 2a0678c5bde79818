"""`MessagesClient`: the chat contract of `LLMClient` over Anthropic's Messages API (streamed ``messages.stream``).

The request is the reference's: the system prompt, one user message, the output cap (``max_tokens``, required by the
API: 4096 unless sampling sets one), adaptive thinking and, where configured, ``output_config.effort``; no seed and no
temperature. The answer is the final message's text blocks joined; its thinking blocks are the reasoning. Usage is
recorded with the chat-completions counters the ledger reads; the API reports no price, so the cost is unknown.

Everything else is `LLMClient`'s: the key read from the environment per call (never stored or recorded), no
redirects, the one retry rule (connection failures, a stream cut mid-message and 5xx — 529 overloaded included — are
retried; 4xx, 429 included, are not), the budget gate and the call records. The SDK's own retries are off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mass_ops.llm.client import LLMClient
from mass_ops.llm.errors import LLMOutputError
from mass_ops.llm.response import JsonParsing, extract_json_object, fenced_json_object
from mass_ops.llm.settings import JsonMode, LLMEndpoint, SamplingParams

if TYPE_CHECKING:
    import anthropic

# Where the SDK sends requests when no base URL is configured.
ANTHROPIC_API_URL = "https://api.anthropic.com"
# The output cap sent when sampling sets none (the API requires one; the reference's value).
DEFAULT_MAX_TOKENS = 4096


class MessagesClient(LLMClient):
    """`LLMClient` for an Anthropic Messages-API endpoint (``backend="anthropic"``); `effort` is sent as is."""

    default_provider = "anthropic"

    def __init__(self, endpoint: LLMEndpoint, *, effort: str | None = None, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self.effort = effort

    def __repr__(self) -> str:
        e = self.endpoint
        return f"{type(self).__name__}(model={e.model!r}, base_url={e.base_url!r})"

    def _new_http_pool(self) -> Any:
        import anthropic  # deferred: the SDK is large and only report judging needs it

        # No redirects: a redirect could forward the key to another host.
        return anthropic.DefaultHttpxClient(follow_redirects=False)

    def _api_key(self) -> str:
        """The key, read from the environment now."""
        return self.endpoint.read_api_key()

    def _sdk(self) -> anthropic.Anthropic:  # type: ignore[override]  # this route's SDK
        import anthropic

        # A fresh SDK object per call keeps the key out of long-lived state; the HTTP pool is shared.
        return anthropic.Anthropic(
            api_key=self._api_key(),
            base_url=self.endpoint.base_url,
            max_retries=0,
            timeout=self.endpoint.request_timeout_s,
            http_client=self._http,
        )

    def _sdk_errors(self) -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
        import anthropic
        import httpx2  # the SDK's HTTP layer: a stream cut mid-message surfaces as its transport error

        return (anthropic.APIStatusError,), (anthropic.APIConnectionError, httpx2.TransportError)

    def build_request(
        self,
        system: str,
        user: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments of ``messages.stream`` (also what gets recorded; never the key). JSON calls send no
        response format: the API has none, the object is read from the answer text."""
        request: dict[str, Any] = {
            "model": self.endpoint.model,
            "max_tokens": sampling.max_tokens or DEFAULT_MAX_TOKENS,
            "system": system,
            "messages": [{"role": "user", "content": user}],
            "thinking": {"type": "adaptive"},
        }
        if self.effort:
            request["output_config"] = {"effort": self.effort}
        return request

    def _post_completion(self, sdk: Any, body: dict[str, Any]) -> Any:
        with sdk.messages.stream(**body) as stream:
            return stream.get_final_message()

    def _send_with_fallback(
        self, sdk: Any, request: dict[str, Any], purpose: str, json_mode: JsonMode | None
    ) -> tuple[Any, int, Exception | None, dict[str, Any], dict[str, Any]]:
        """Send with transient retries; this route has no fallback and records the request as sent."""
        response, attempts, error = self._send(lambda: self._post_completion(sdk, request), purpose)
        return response, attempts, error, request, {}

    @staticmethod
    def _document(response: Any) -> dict[str, Any]:
        return dict(response.model_dump(mode="json"))

    def _read_answer(
        self, raw: dict[str, Any], json_mode: JsonMode | None, json_parsing: JsonParsing
    ) -> tuple[str, str | None, str | None, dict[str, Any] | None]:
        """The text blocks joined, the thinking blocks joined; JSON calls read the object from the text leniently, or
        (`json_parsing` strict) as the reference does: text blocks trimmed, joined by newlines, `fenced_json_object`."""
        blocks = raw.get("content") or []
        text = "".join(block.get("text", "") for block in blocks if block.get("type") == "text")
        thinking = "".join(block.get("thinking", "") for block in blocks if block.get("type") == "thinking") or None
        if not text.strip():
            reason = "output ceiling consumed by thinking" if thinking else "no text block"
            raise LLMOutputError(f"empty final content: {reason} (stop_reason {raw.get('stop_reason')})")
        if raw.get("stop_reason") == "refusal":
            raise LLMOutputError(f"model refused: {text[:500]}")
        parsed = None
        if json_mode is not None and json_parsing == "strict":
            parsed = fenced_json_object(_reference_text(blocks))
        elif json_mode is not None:
            parsed = extract_json_object(text)
        return text, thinking, raw.get("stop_reason"), parsed

    @staticmethod
    def _usage(raw: dict[str, Any]) -> dict[str, Any]:
        return messages_usage(raw.get("usage") or {})


def _reference_text(blocks: list[dict[str, Any]]) -> str:
    """The reference's answer text of a Messages response: each non-blank text block trimmed, joined by newlines."""
    texts = (str(block.get("text", "")).strip() for block in blocks if block.get("type") == "text")
    return "\n".join(text for text in texts if text)


def messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Messages-API usage with the chat-completions counters the ledger and reports read (cache reads and writes
    count as prompt tokens)."""
    prompt = int(usage.get("input_tokens") or 0)
    prompt += int(usage.get("cache_read_input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
