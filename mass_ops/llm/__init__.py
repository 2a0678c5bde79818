"""OpenAI-compatible chat client for the in-loop judge and optimizer calls (MASS_SPEC §3.3 "LLM backend").

One `LLMClient` per endpoint: system+user chat completions, JSON mode with the LM Studio fallback, the conservative
context guard (checked before any request), our own retry policy for transient failures only, and usage/cost
accounting. The API key is read from the environment variable named by the endpoint at call time; it is never stored
on objects, in requests, results or call records. Persistence is the caller's business: pass a `CallRecorder`.

Modules: `errors` (the `LLMError` family; imports no sibling), `settings` (endpoint, sampling), `retries` (policy
and the retry rule), `request` (context guard, request body per backend), `response` (result, call record, usage,
output validation), `client` (`LLMClient`), `responses` (`ResponsesClient`: the same contract over the OpenAI
Responses API) and `messages` (`MessagesClient`: over Anthropic's Messages API), both for external judges, `calls`
(call ledger: persistence and budgets of in-loop calls). Design notes: docs/llm.md.
"""

from mass_ops.llm.client import LLMClient
from mass_ops.llm.errors import (
    ContextBudgetError,
    LLMConfigError,
    LLMError,
    LLMOutputError,
    LLMRequestError,
    LLMUnavailableError,
)
from mass_ops.llm.messages import MessagesClient
from mass_ops.llm.request import enforce_context_budget, estimate_input_tokens
from mass_ops.llm.response import (
    CallGate,
    CallRecord,
    CallRecorder,
    ChatResult,
    JsonParsing,
    cached_prompt_tokens,
    extract_json_object,
    fenced_json_object,
    strict_json_object,
    whole_json_object,
)
from mass_ops.llm.responses import ResponsesClient
from mass_ops.llm.retries import RetryPolicy, http_failure, send_with_retries
from mass_ops.llm.settings import (
    BACKENDS,
    LOCAL_PLACEHOLDER_KEY,
    REASONING_EFFORTS,
    Backend,
    JsonMode,
    LLMEndpoint,
    SamplingParams,
)

__all__ = [
    "BACKENDS",
    "LOCAL_PLACEHOLDER_KEY",
    "REASONING_EFFORTS",
    "Backend",
    "CallGate",
    "CallRecord",
    "CallRecorder",
    "ChatResult",
    "ContextBudgetError",
    "JsonMode",
    "JsonParsing",
    "LLMClient",
    "LLMConfigError",
    "LLMEndpoint",
    "LLMError",
    "LLMOutputError",
    "LLMRequestError",
    "LLMUnavailableError",
    "MessagesClient",
    "ResponsesClient",
    "RetryPolicy",
    "SamplingParams",
    "cached_prompt_tokens",
    "enforce_context_budget",
    "estimate_input_tokens",
    "extract_json_object",
    "fenced_json_object",
    "http_failure",
    "send_with_retries",
    "strict_json_object",
    "whole_json_object",
]
