"""The one retry rule of every LLM client: how an HTTP error status is classified, whichever SDK raised it."""

from __future__ import annotations

import pytest

from mass_ops.llm import LLMRequestError, LLMUnavailableError, RetryPolicy, http_failure, send_with_retries


@pytest.mark.parametrize("status", [500, 502, 503, 529])
def test_a_5xx_is_transient_and_its_reason_carries_the_body(status: int) -> None:
    assert http_failure("judge", status, {"error": "busy"}, "ignored") == f'HTTP {status}: {{"error": "busy"}}'


@pytest.mark.parametrize("status", [307, 400, 401, 404, 422, 429])
def test_any_other_status_is_permanent(status: int) -> None:
    failure = http_failure("judge", status, None, "the SDK's message")
    assert isinstance(failure, LLMRequestError) and failure.status_code == status
    assert str(failure) == f"judge rejected: HTTP {status}: the SDK's message"


def test_the_reason_is_cut_to_2000_characters() -> None:
    assert len(http_failure("judge", 503, "x" * 5000, "")) == 2000
    rejected = str(http_failure("judge", 400, "x" * 5000, ""))
    assert rejected.startswith("judge rejected: HTTP 400: ") and len(rejected) == 2000 + len("judge rejected: ")


def test_send_with_retries_retries_transient_statuses_and_returns_permanent_ones() -> None:
    statuses = [503, 529, 429]
    sleeps: list[float] = []

    def action() -> None:
        raise RuntimeError(statuses.pop(0))

    def classify(error: Exception) -> LLMRequestError | str | None:
        return http_failure("judge", int(str(error)), None, "m")

    result, attempts, error = send_with_retries(action, classify, RetryPolicy(), sleeps.append, what="judge", where="x")
    assert (result, attempts, sleeps) == (None, 3, [2.0, 4.0])
    assert isinstance(error, LLMRequestError) and error.status_code == 429
    statuses[:] = [503] * 4
    _, attempts, error = send_with_retries(action, classify, RetryPolicy(max_attempts=2), sleeps.append,
                                           what="judge", where="http://h")  # fmt: skip
    assert attempts == 2 and isinstance(error, LLMUnavailableError)
    assert str(error) == "judge failed after 2 attempts at http://h: HTTP 503: m"
