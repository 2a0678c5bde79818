"""LLM calls (judge, optimizer, arbitration) and the comparisons of the judged pairs in each ledger."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    RepositoryBase,
    TaskId,
    UsageTotal,
    _document,
    _member,
    _sha256,
    _task,
)
from mass_ops.store.schema import (
    CallPurpose,
    CallStatus,
    Comparison,
    Ledger,
    LLMCall,
    Verdict,
)


class CallRecords(RepositoryBase):
    """Rows of `llm_calls` and `comparisons`."""

    def record_llm_call(
        self,
        cycle_id: int,
        unit_key: str,
        *,
        purpose: str,
        model: str,
        status: str = CallStatus.SUCCEEDED,
        task_id: TaskId | None = None,
        provider: str | None = None,
        seed: int | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        usage: Mapping[str, Any] | None = None,
        cost_usd: float | None = None,
        latency_s: float | None = None,
        prompt_uri: str | None = None,
        result_uri: str | None = None,
        error: str | None = None,
        prompt_sha256: str | None = None,
        result_sha256: str | None = None,
        cached_prompt_tokens: int | None = None,
    ) -> LLMCall:
        """One judge / optimizer / arbitration call, keyed by a caller-chosen `unit_key` unique in the cycle."""
        values = {
            "purpose": _member(CallPurpose, purpose, "LLM call purpose"),
            "model": model,
            "status": _member(CallStatus, status, "LLM call status"),
            "task_id": _task(task_id) if task_id is not None else None,
            "provider": provider,
            "seed": seed,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "usage": _document(usage, "usage"),
            "cost_usd": cost_usd,
            "latency_s": latency_s,
            "prompt_uri": prompt_uri,
            "result_uri": result_uri,
            "error": error,
            "prompt_sha256": _sha256(prompt_sha256, "LLM call prompt_sha256"),
            "result_sha256": _sha256(result_sha256, "LLM call result_sha256"),
            "cached_prompt_tokens": cached_prompt_tokens,
        }
        return self._record(
            LLMCall, {"cycle_id": cycle_id, "unit_key": unit_key}, values, must_match=("purpose", "model")
        )

    def get_llm_call(self, cycle_id: int, unit_key: str) -> LLMCall | None:
        return self._one(sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id, LLMCall.unit_key == unit_key))

    def get_llm_calls(self, cycle_id: int, unit_keys: Sequence[str]) -> dict[str, LLMCall]:
        """The recorded calls among `unit_keys`, by key (absent keys are missing): one query for many lookups."""
        if not unit_keys:
            return {}
        statement = sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id, LLMCall.unit_key.in_(list(unit_keys)))
        return {row.unit_key: row for row in self._all(statement)}

    def llm_calls(self, cycle_id: int, *, purpose: str | None = None) -> list[LLMCall]:
        statement = sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id).order_by(LLMCall.id)
        if purpose is not None:
            statement = statement.where(LLMCall.purpose == _member(CallPurpose, purpose, "LLM call purpose"))
        return self._all(statement)

    def llm_usage(self, cycle_id: int) -> list[UsageTotal]:
        """Tokens and cost of a cycle's LLM calls per purpose (cost None when no call of the group reported one)."""
        statement = (
            sa.select(
                LLMCall.purpose,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(LLMCall.prompt_tokens), 0),
                sa.func.coalesce(sa.func.sum(LLMCall.completion_tokens), 0),
                sa.func.sum(LLMCall.cost_usd),
            )
            .where(LLMCall.cycle_id == cycle_id)
            .group_by(LLMCall.purpose)
            .order_by(LLMCall.purpose)
        )
        with self.store.read() as session:
            rows = session.execute(statement).all()
        return [
            UsageTotal(purpose, int(n), int(p or 0), int(c or 0), float(cost) if cost is not None else None)
            for purpose, n, p, c, cost in rows
        ]

    def record_comparison(
        self,
        cycle_id: int,
        task_id: TaskId,
        ledger: str,
        key: str,
        *,
        side_a: str,
        side_b: str,
        judge_model: str,
        verdict: str,
        episode_a_id: int | None = None,
        episode_b_id: int | None = None,
        judge_provider: str | None = None,
        seed: int | None = None,
        swapped: bool = False,
        rationale: str | None = None,
        rationale_uri: str | None = None,
        llm_call_id: int | None = None,
        usage: Mapping[str, Any] | None = None,
        rationale_sha256: str | None = None,
    ) -> Comparison:
        """One judged pair in a ledger; `verdict` is in the A/B orientation of `side_a`/`side_b` (after any swap)."""
        row_key = {
            "cycle_id": cycle_id,
            "task_id": _task(task_id),
            "ledger": _member(Ledger, ledger, "ledger"),
            "key": key,
        }
        values = {
            "side_a": side_a,
            "side_b": side_b,
            "episode_a_id": episode_a_id,
            "episode_b_id": episode_b_id,
            "judge_model": judge_model,
            "judge_provider": judge_provider,
            "seed": seed,
            "swapped": swapped,
            "verdict": _member(Verdict, verdict, "verdict"),
            "rationale": rationale,
            "rationale_uri": rationale_uri,
            "llm_call_id": llm_call_id,
            "usage": _document(usage, "usage"),
            "rationale_sha256": _sha256(rationale_sha256, "comparison rationale_sha256"),
        }
        return self._record(
            Comparison, row_key, values, must_match=("side_a", "side_b", "episode_a_id", "episode_b_id")
        )

    def get_comparison(self, cycle_id: int, task_id: TaskId, ledger: str, key: str) -> Comparison | None:
        return self._one(
            sa.select(Comparison).where(
                Comparison.cycle_id == cycle_id,
                Comparison.task_id == _task(task_id),
                Comparison.ledger == _member(Ledger, ledger, "ledger"),
                Comparison.key == key,
            )
        )

    def comparisons(self, cycle_id: int, ledger: str, *, task_id: TaskId | None = None) -> list[Comparison]:
        """A ledger in recording order (the order the reference release appends its JSONL ledgers)."""
        statement = (
            sa.select(Comparison)
            .where(Comparison.cycle_id == cycle_id, Comparison.ledger == _member(Ledger, ledger, "ledger"))
            .order_by(Comparison.id)
        )
        if task_id is not None:
            statement = statement.where(Comparison.task_id == _task(task_id))
        return self._all(statement)

    def task_comparisons(self, cycle_id: int, task_id: TaskId, ledgers: Sequence[str]) -> list[Comparison]:
        """One task's rows of several ledgers in recording order (one query where `comparisons` would take one per
        ledger)."""
        names = [_member(Ledger, ledger, "ledger") for ledger in ledgers]
        statement = (
            sa.select(Comparison)
            .where(
                Comparison.cycle_id == cycle_id,
                Comparison.task_id == _task(task_id),
                Comparison.ledger.in_(names),
            )
            .order_by(Comparison.id)
        )
        return self._all(statement)
