"""The errors of the LLM client: one root, `LLMError`, split into input errors (config, context, output) and
infrastructure errors (a rejected request, an endpoint that stayed unavailable). Imports no sibling module.
"""

from __future__ import annotations

from mass_ops.errors import InfrastructureError, InputError


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
