"""In-loop LLM calls of a cycle: the endpoint and sampling built from the config, and the call ledger.

Every judge, arbitration, optimizer and self-judge call is a unit of work keyed by a `CallUnit` (e.g.
``task51/rhi/v1_vs_no_harness``); each try is one attempt (``…/a1``, ``…/a2``) whose prompt and answer are published
to the artifact store under `layout.llm_call_prefix`, then recorded as one `llm_calls` row. A rerun reuses a
finished attempt's stored answer instead of calling the model again.

The ledger is also the client's `CallGate`: before each call it checks the cycle's budgets (`mass_ops.store.budgets`,
scopes `in_loop`, `cycle` and the call's task) and refuses with `BudgetExhaustedError` before anything is sent; each
answer's usage is added to those scopes as it arrives. Nothing secret is stored. Design notes: docs/llm.md.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.layout import llm_call_prefix, llm_call_prompt_key
from mass_ops.llm import (
    CallRecord,
    LLMClient,
    LLMEndpoint,
    LLMOutputError,
    RetryPolicy,
    SamplingParams,
    cached_prompt_tokens,
)
from mass_ops.prompts.capture import message_inputs
from mass_ops.store.artifacts import ArtifactStore
from mass_ops.store.budgets import (
    CYCLE_SCOPE,
    IN_LOOP_SCOPE,
    BudgetExhaustedError,
    BudgetLedger,
    BudgetLimits,
    task_scope,
)
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import CallPurpose, CallStatus, LLMCall

RESULT_FILE = "result.json"
# Attempt keys looked up per query: above the presets' retry budgets, so one query is the norm (more just loop).
_ATTEMPT_BATCH = 8


def endpoint_from_config(config: CycleConfig) -> LLMEndpoint:
    """The endpoint serving the current model, with the context guard armed from the config's token budgets."""
    inference = config.inference
    return LLMEndpoint(
        base_url=inference.endpoint,
        model=config.models.served_name,
        api_key_env=inference.api_key_env,
        backend=inference.backend,
        request_timeout_s=float(inference.request_timeout_s),
        context_window_tokens=inference.context_window_tokens,
        context_safety_tokens=inference.context_safety_tokens,
    )


def in_loop_sampling(config: CycleConfig, seed: int | None, *, priority: int | None = None) -> SamplingParams:
    """Sampling of optimizer and judge calls (MASS_SPEC §3.2, §5).

    Local servers get the Qwen sampling (temperature, top-p, top-k, thinking on) and the call's seed; OpenRouter
    gets the reasoning effort only — the reference omits temperature there and seeds are local-only. `priority` is
    the call's server priority (`critical_path.server_priority`), sent where the server schedules by it.
    """
    inference = config.inference
    if inference.backend == "openrouter":
        return SamplingParams(max_tokens=inference.max_output_tokens, reasoning_effort=inference.reasoning_effort)
    sampling = inference.sampling
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=inference.max_output_tokens,
        seed=seed,
        enable_thinking=sampling.enable_thinking,
        priority=priority,
    )


def open_client(config: CycleConfig, *, retry: RetryPolicy | None = None) -> LLMClient:
    """A client for the cycle's endpoint, carrying the cycle's budgets for the `CallLedger` that binds it; close it
    (or use it as a context manager) when done."""
    client = LLMClient(endpoint_from_config(config), retry=retry)
    client.budget_limits = BudgetLimits.from_mapping(config.budgets.model_dump())
    return client


@dataclass(frozen=True)
class CallUnit:
    """One logical call: `key` groups its attempts (``task51/rhi/v1_vs_no_harness``), `purpose` is a CallPurpose."""

    key: str
    purpose: str
    task_id: int | None = None

    def __post_init__(self) -> None:
        CallPurpose(self.purpose)  # raises ValueError naming the bad purpose

    def attempt_key(self, attempt: int) -> str:
        return f"{self.key}/a{attempt}"


@dataclass(frozen=True)
class StoredCall:
    """A finished attempt read back from the ledger: its row and the answer stored in the artifact store."""

    row: LLMCall
    attempt: int
    content: str | None
    parsed: dict[str, Any] | None
    extra: dict[str, Any]


@dataclass
class CallAttempt:
    """The attempt in progress. The caller sets `parsed` (and `extra`) after a good answer, or `mark_invalid`."""

    unit: CallUnit
    number: int
    record: CallRecord | None = None
    parsed: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    invalid_reason: str | None = None
    row: LLMCall | None = None

    @property
    def unit_key(self) -> str:
        return self.unit.attempt_key(self.number)

    def mark_invalid(self, reason: str) -> None:
        """The model answered, but the answer failed parsing or validation: the row gets status `invalid`."""
        self.invalid_reason = reason


_current_attempt: contextvars.ContextVar[CallAttempt | None] = contextvars.ContextVar("mass_ops_call", default=None)


class CallLedger:
    """Persists in-loop calls of one cycle; also the `CallRecorder` handed to the `LLMClient`.

    The client calls the recorder from inside `chat()`, in the calling thread; the attempt it belongs to is found in
    a context variable set by `attempt()`, so one client can serve many threads.
    """

    def __init__(
        self,
        repo: MetadataRepository,
        artifacts: ArtifactStore,
        cycle_id: int,
        cycle_name: str,
        *,
        limits: BudgetLimits | None = None,
    ) -> None:
        self.repo = repo
        self.artifacts = artifacts
        self.cycle_id = cycle_id
        self.cycle_name = cycle_name
        self.budgets: BudgetLedger | None = None
        if limits is not None:
            self.set_limits(limits)

    def set_limits(self, limits: BudgetLimits) -> None:
        """Check every call against `limits` and record its spend (kept: the first limits set win, one ledger per
        cycle process). Unlimited scopes are recorded too, without a read before each call: the cycle's spend is what
        `status` and the report show."""
        if self.budgets is None:
            self.budgets = BudgetLedger(self.repo, self.cycle_id, limits)

    def bind(self, client: LLMClient) -> LLMClient:
        """Make this ledger the client's recorder and gate (returns the client); the budgets come from the client
        (`open_client`) unless this ledger was given limits."""
        client.recorder = self
        limits = getattr(client, "budget_limits", None)
        if isinstance(limits, BudgetLimits):
            self.set_limits(limits)
        client.gate = self
        return client

    def budget_scopes(self, unit: CallUnit | None) -> tuple[str, ...]:
        """The budget scopes an in-loop call spends from: in-loop calls, the cycle, and its task when it has one."""
        task = (task_scope(unit.task_id),) if unit is not None and unit.task_id is not None else ()
        return (IN_LOOP_SCOPE, CYCLE_SCOPE, *task)

    def admit(self, purpose: str, need_tokens: int) -> Callable[[], None]:
        """`CallGate`: refuse (`BudgetExhaustedError`, nothing sent) when a budget has no room for the call."""
        if self.budgets is None:
            return _nothing
        current = _current_attempt.get()
        scopes = self.budget_scopes(current.unit if current is not None else None)
        refused = self.budgets.try_admit(scopes, need_tokens)
        if refused is not None:
            what = current.unit.key if current is not None else purpose
            raise BudgetExhaustedError(refused, f"in-loop call {what} not sent")
        budgets = self.budgets
        return lambda: budgets.release(scopes, need_tokens)

    def prompt_key(self, unit_key: str) -> str:
        return llm_call_prompt_key(self.cycle_name, unit_key)

    def result_key(self, unit_key: str) -> str:
        return f"{llm_call_prefix(self.cycle_name, unit_key)}/{RESULT_FILE}"

    def attempts(self, unit: CallUnit) -> list[LLMCall]:
        """Recorded attempts of a unit, first first (attempt numbers are dense: a1, a2, …).

        Looks the keys up a batch at a time: one query covers every unit within the usual retry budgets.
        """
        rows: list[LLMCall] = []
        while True:
            keys = [unit.attempt_key(number) for number in range(len(rows) + 1, len(rows) + 1 + _ATTEMPT_BATCH)]
            found = self.repo.get_llm_calls(self.cycle_id, keys)
            for key in keys:
                row = found.get(key)
                if row is None:
                    return rows
                rows.append(row)

    def finished(self, unit: CallUnit, attempts: list[LLMCall] | None = None) -> StoredCall | None:
        """The succeeded attempt of a unit with its stored answer, or None (`attempts`: rows already read)."""
        for number, row in enumerate(self.attempts(unit) if attempts is None else attempts, start=1):
            if row.status == CallStatus.SUCCEEDED:
                result = self.artifacts.get_json(self.result_key(row.unit_key))
                return StoredCall(
                    row=row,
                    attempt=number,
                    content=result.get("content"),
                    parsed=result.get("parsed"),
                    extra=result.get("extra") or {},
                )
        return None

    def invalid_attempts(self, unit: CallUnit) -> list[LLMCall]:
        """Attempts whose answer was unusable (they count against a bounded retry budget)."""
        return [row for row in self.attempts(unit) if row.status == CallStatus.INVALID]

    @contextmanager
    def attempt(self, unit: CallUnit, number: int | None = None) -> Iterator[CallAttempt]:
        """Run attempt `number` (default: the next one) of `unit`; on exit its prompt, answer and row are persisted
        if a request was sent.

        An `LLMOutputError` raised inside (empty, refused or non-JSON answer) records status `invalid`; any other
        exception records `failed`; both are re-raised. Nothing is recorded when no request reached the network
        (e.g. the context guard refused the prompt).
        """
        current = CallAttempt(unit=unit, number=number if number is not None else len(self.attempts(unit)) + 1)
        token = _current_attempt.set(current)
        try:
            yield current
        except LLMOutputError as exc:
            current.mark_invalid(str(exc))
            self._persist(current, failure=None)
            raise
        except Exception as exc:
            self._persist(current, failure=f"{type(exc).__name__}: {exc}")
            raise
        else:
            self._persist(current, failure=None)
        finally:
            _current_attempt.reset(token)

    def __call__(self, record: CallRecord) -> None:
        current = _current_attempt.get()
        if current is None:
            raise RuntimeError(f"LLM call {record.purpose!r} made outside CallLedger.attempt(); it would go unrecorded")
        current.record = record
        if self.budgets is not None and record.usage:
            # Spent as soon as it is answered, before the row: other processes see it at their next check.
            usage = record.usage
            tokens = sum(_int_or_none(usage.get(name)) or 0 for name in ("prompt_tokens", "completion_tokens"))
            self.budgets.record(self.budget_scopes(current.unit), tokens=tokens, cost_usd=record.cost_usd)

    def _persist(self, current: CallAttempt, failure: str | None) -> None:
        record = current.record
        if record is None:
            return
        error: str | None
        if current.invalid_reason is not None:
            status, error = CallStatus.INVALID, current.invalid_reason
        elif record.status == "error" or failure is not None:
            status, error = CallStatus.FAILED, record.error or failure
        else:
            status, error = CallStatus.SUCCEEDED, None
        unit_key = current.unit_key
        prompt = {
            "unit_key": unit_key,
            "purpose": current.unit.purpose,
            "task_id": current.unit.task_id,
            "backend": record.backend,
            "base_url": record.base_url,
            "model": record.model,
            "seed": record.seed,
            "request": record.request,
            # The template and variables behind each message, for `mass-ops prompts check --cycle`.
            "message_inputs": message_inputs(record.request),
        }
        result = {
            "unit_key": unit_key,
            "status": status.value,
            "error": error,
            "attempts": record.attempts,
            "latency_s": record.latency_s,
            "usage": record.usage,
            "cost_usd": record.cost_usd,
            "response": record.response,
            "content": _content(record.response),
            "parsed": current.parsed if status == CallStatus.SUCCEEDED else None,
            "extra": current.extra,
        }
        # The answer is paid for yet lives only in this process until its row is committed: a kill in between asks
        # (and pays) again on the rerun. Both documents are written side by side so that window is one put long.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="call-ledger") as beside:
            prompt_put = beside.submit(self.artifacts.put_json, self.prompt_key(unit_key), prompt)
            result_info = self.artifacts.put_json(self.result_key(unit_key), result)
            prompt_info = prompt_put.result()
        usage = record.usage or {}
        current.row = self.repo.record_llm_call(
            self.cycle_id,
            unit_key,
            purpose=current.unit.purpose,
            model=record.model,
            status=status.value,
            task_id=current.unit.task_id,
            provider=record.backend,
            seed=record.seed,
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            usage=usage or None,
            cost_usd=record.cost_usd,
            latency_s=record.latency_s,
            prompt_uri=prompt_info.uri,
            result_uri=result_info.uri,
            prompt_sha256=prompt_info.sha256,
            result_sha256=result_info.sha256,
            error=error,
            cached_prompt_tokens=cached_prompt_tokens(usage),
        )


def _nothing() -> None:
    """The release of a call no budget holds anything for."""


def _content(response: dict[str, Any] | None) -> str | None:
    if not response:
        return None
    choices = response.get("choices") or []
    if not choices:
        return None
    content = (choices[0].get("message") or {}).get("content")
    return content if isinstance(content, str) else None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
