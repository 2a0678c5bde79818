"""The retry rule of every LLM client: transient failures (connection, timeout, 5xx) are retried with exponential
backoff until the policy's attempts are spent; permanent ones (any other HTTP status, 429 included) are returned at
once. `http_failure` is the one reading of an HTTP error status, whichever SDK raised it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mass_ops.llm.errors import LLMConfigError, LLMRequestError, LLMUnavailableError
from mass_ops.llm.settings import _positive_int


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


def http_failure(what: str, status_code: int, body: object, message: str) -> LLMRequestError | str:
    """An HTTP error status as `send_with_retries` classifies it: a 5xx is transient (its reason is returned); any
    other status (4xx, 429 included, and redirects) is a permanent LLMRequestError. The reason carries the response
    body (JSON), else the SDK's `message`, cut to 2000 characters."""
    detail = json.dumps(body, default=str) if body is not None else message
    reason = f"HTTP {status_code}: {detail}"[:2000]
    if status_code >= 500:
        return reason
    return LLMRequestError(f"{what} rejected: {reason}", status_code)


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
