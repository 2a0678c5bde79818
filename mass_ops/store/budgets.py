"""The budget ledger of a cycle: spend per scope in the metadata store, and the check made before each paid request.

Scopes: ``cycle``, ``task:<id>`` and ``in_loop``; every process adds its spend with atomic increments and reads the
same rows before a request. `BudgetLedger.refusal`: a request needing `need` tokens is refused when spent + in
flight + need would exceed a scope's token limit, or when its cost limit is reached; the overshoot is bounded by one
request per concurrent request. On Kubernetes pods are admitted only while their scopes have room and charged when
recorded (`charge_episode`). Alerts (`BudgetAlert`) fire once per cycle at 50% and 80% of a limit.
The rule, its bounds and the Kubernetes case: docs/storage.md (`mass_ops.store.budgets`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mass_ops.errors import InfrastructureError
from mass_ops.store.repository import MetadataRepository

CYCLE_SCOPE = "cycle"
IN_LOOP_SCOPE = "in_loop"
EPISODE_SCOPE = "episode"  # held by an episode's proxy in memory, never in the store
TASK_PREFIX = "task:"
ALERT_PERCENTS = (50, 80)  # a budget alert fires when spend first reaches these shares of a limit
ALERT_PREFIX = "alert:"  # the key prefix of alert markers in `budget_charges`
MEASURES = {"tokens": "tokens", "USD": "cost_usd"}  # unit → the limit's suffix in the config and in alert keys

logger = logging.getLogger(__name__)


def task_scope(task_id: object) -> str:
    """The scope of one task's spend, e.g. ``task:51``."""
    return f"{TASK_PREFIX}{task_id}"


def episode_scopes(task_id: object) -> tuple[str, ...]:
    """The shared scopes an agent episode of `task_id` spends from: its task's and the cycle's."""
    return (task_scope(task_id), CYCLE_SCOPE)


@dataclass(frozen=True)
class BudgetLimits:
    """The configured limits (`budgets` section of the config); None = unlimited. Tokens are prompt + completion."""

    episode_tokens: int | None = None
    task_tokens: int | None = None
    task_cost_usd: float | None = None
    cycle_tokens: int | None = None
    cycle_cost_usd: float | None = None
    in_loop_tokens: int | None = None
    in_loop_cost_usd: float | None = None
    alert_callback: str | None = None  # dotted path, validated by the config (`budgets.alert_callback`)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BudgetLimits:
        """From `config.budgets.model_dump()` (unknown keys are ignored: the config validated them)."""
        return cls(**{name: values.get(name) for name in cls.__dataclass_fields__})

    def for_scope(self, scope: str) -> tuple[int | None, float | None, str]:
        """(token limit, cost limit, config key prefix) of a scope."""
        if scope == CYCLE_SCOPE:
            return self.cycle_tokens, self.cycle_cost_usd, "budgets.cycle"
        if scope == IN_LOOP_SCOPE:
            return self.in_loop_tokens, self.in_loop_cost_usd, "budgets.in_loop"
        if scope == EPISODE_SCOPE:
            return self.episode_tokens, None, "budgets.episode"
        if scope.startswith(TASK_PREFIX):
            return self.task_tokens, self.task_cost_usd, "budgets.task"
        raise ValueError(f"unknown budget scope {scope!r}")

    def limited(self, scopes: Sequence[str]) -> list[str]:
        """The scopes among `scopes` that have a limit at all."""
        return [s for s in scopes if any(limit is not None for limit in self.for_scope(s)[:2])]

    @property
    def any(self) -> bool:
        """Whether any limit is set (an alert callback alone limits nothing)."""
        return any(getattr(self, name) is not None for name in self.__dataclass_fields__ if name != "alert_callback")

    def measures(self, scope: str) -> list[tuple[str, float]]:
        """(unit, limit) of each limit a scope has: ``tokens`` and/or ``USD``."""
        tokens, cost, _ = self.for_scope(scope)
        return [(unit, limit) for unit, limit in (("tokens", tokens), ("USD", cost)) if limit is not None]


@dataclass(frozen=True)
class Refusal:
    """Why a request may not be sent: which scope and limit, what was spent, what the request needed."""

    scope: str
    setting: str  # the config key that would have to be raised, e.g. budgets.task_tokens
    limit: float
    spent: float
    need: float
    unit: str  # "tokens" or "USD"

    @property
    def message(self) -> str:
        what = _scope_words(self.scope)
        if self.unit == "USD":
            amounts = f"has cost ${self.spent:.4f} of {self.setting} = ${self.limit:.4f}"
        else:
            amounts = (
                f"has used {int(self.spent):,} of {self.setting} = {int(self.limit):,} tokens and the next request "
                f"needs up to {int(self.need):,}"
            )
        return (
            f"budget exhausted: {what} {amounts}; raise {self.setting} in the config and rerun (finished units are "
            "reused)"
        )


def _scope_words(scope: str) -> str:
    """A scope as a person reads it: ``the cycle``, ``task 51``, ``in-loop``."""
    return "the cycle" if scope == CYCLE_SCOPE else scope.replace(":", " ").replace("_", "-")


@dataclass(frozen=True)
class BudgetAlert:
    """A scope's spend has reached `percent` % of one of its limits (raised once per cycle, scope, limit, share)."""

    cycle_id: int
    scope: str
    setting: str  # the config key of the limit, e.g. budgets.cycle_tokens
    percent: int
    limit: float
    spent: float
    unit: str  # "tokens" or "USD"

    @property
    def key(self) -> str:
        """The alert's marker key in the store, e.g. ``alert:task:51:tokens:50``."""
        return f"{ALERT_PREFIX}{self.scope}:{MEASURES[self.unit]}:{self.percent}"

    @property
    def message(self) -> str:
        if self.unit == "USD":
            amounts = f"has cost ${self.spent:,.2f} of {self.setting} = ${self.limit:,.2f}"
        else:
            amounts = f"has used {int(self.spent):,} of {self.setting} = {int(self.limit):,} tokens"
        share = 100 * self.spent / self.limit if self.limit else 100.0
        return f"budget alert: {_scope_words(self.scope)} {amounts} ({share:.0f}%, past {self.percent}%)"


@dataclass(frozen=True)
class RecordedAlert:
    """An alert as the store keeps it (what a report shows): scope, measure, share and when it was first crossed."""

    scope: str
    unit: str
    percent: int
    at: datetime


def due_alerts(
    cycle_id: int, limits: BudgetLimits, spend: Mapping[str, Any], scopes: Sequence[str]
) -> list[BudgetAlert]:
    """Every alert that `spend` (rows by scope, with `tokens` and `cost_usd`) has reached in `scopes`, whether or not
    it was raised before."""
    due = []
    for scope in limits.limited(scopes):
        row = spend.get(scope)
        prefix = limits.for_scope(scope)[2]
        for unit, limit in limits.measures(scope):
            spent = float((row.tokens if unit == "tokens" else row.cost_usd) if row else 0)
            setting = f"{prefix}_{MEASURES[unit]}"
            due += [
                BudgetAlert(cycle_id, scope, setting, percent, float(limit), spent, unit)
                for percent in ALERT_PERCENTS
                if spent >= limit * percent / 100
            ]
    return due


def _notify(alert: BudgetAlert, callback_path: str | None) -> None:
    """Log the alert and call the configured callback; a failing callback is logged, never raised (a broken
    notifier must not stop the cycle's work)."""
    logger.warning(alert.message)
    if callback_path is None:
        return
    from mass_ops.config import import_callable  # only when a callback is configured (validated at config load)

    try:
        callback: Callable[[BudgetAlert], Any] = import_callable(callback_path)
        callback(alert)
    except Exception as exc:
        logger.error("budget alert callback %s failed: %s: %s", callback_path, type(exc).__name__, exc)


def raise_alerts(
    repo: MetadataRepository,
    cycle_id: int,
    limits: BudgetLimits,
    scopes: Sequence[str],
    spend: Mapping[str, Any] | None = None,
    *,
    known: set[str] | None = None,
) -> list[BudgetAlert]:
    """Raise the alerts the spend of `scopes` has reached and nobody raised yet (read from the store unless `spend` is
    given): each is marked in the store first, so only the one process whose mark lands logs it and calls the
    callback. `known` (keys already marked, by anyone) is read and extended to save store round trips."""
    limited = limits.limited(scopes)
    if not limited:
        return []
    if spend is None:
        spend = repo.budget_spend(cycle_id, limited)
    raised = []
    for alert in due_alerts(cycle_id, limits, spend, limited):
        if known is not None and alert.key in known:
            continue
        if repo.mark_budget_once(cycle_id, alert.key):
            _notify(alert, limits.alert_callback)
            raised.append(alert)
        if known is not None:
            known.add(alert.key)
    return raised


def recorded_alerts(repo: MetadataRepository, cycle_id: int) -> list[RecordedAlert]:
    """The budget alerts raised in a cycle, in the order they were first crossed."""
    units = {suffix: unit for unit, suffix in MEASURES.items()}
    alerts = []
    for mark in repo.budget_marks(cycle_id, ALERT_PREFIX):
        scope, suffix, percent = mark.charge_key.removeprefix(ALERT_PREFIX).rsplit(":", 2)
        alerts.append(RecordedAlert(scope, units.get(suffix, suffix), int(percent), mark.created_at))
    return alerts


class BudgetExhaustedError(InfrastructureError):
    """A budget refuses the next paid request. Not a fault to retry: raise the budget and rerun the stage."""

    def __init__(self, refusal: Refusal, detail: str = "") -> None:
        self.refusal = refusal
        super().__init__(refusal.message + (f" ({detail})" if detail else ""))


class BudgetLedger:
    """Checks and records the spend of one cycle's scopes (thread-safe; one per process is enough).

    Requests this ledger admitted but whose spend is not recorded yet count as in flight (by their `need`), so
    threads of one process never overshoot together; other processes see them once recorded.
    """

    def __init__(self, repo: MetadataRepository, cycle_id: int, limits: BudgetLimits) -> None:
        self.repo = repo
        self.cycle_id = cycle_id
        self.limits = limits
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._alerted: set[str] = set()  # alert keys known to be raised (here or elsewhere): never checked again

    def refusal(self, scopes: Sequence[str], need_tokens: int, *, extra_tokens: int = 0) -> Refusal | None:
        """The first scope that refuses a request needing `need_tokens` (plus `extra_tokens` spent elsewhere but
        not yet recorded), or None when every scope admits it."""
        limited = self.limits.limited(scopes)
        if not limited:
            return None
        spend = self.repo.budget_spend(self.cycle_id, limited)
        for scope in limited:
            token_limit, cost_limit, prefix = self.limits.for_scope(scope)
            row = spend.get(scope)
            tokens = (row.tokens if row else 0) + self._in_flight.get(scope, 0) + extra_tokens
            cost = row.cost_usd if row else 0.0
            if token_limit is not None and tokens + need_tokens > token_limit:
                return Refusal(scope, f"{prefix}_tokens", token_limit, tokens, need_tokens, "tokens")
            if cost_limit is not None and cost >= cost_limit:
                return Refusal(scope, f"{prefix}_cost_usd", cost_limit, cost, 0.0, "USD")
        return None

    def check(self, scopes: Sequence[str], need_tokens: int) -> None:
        """Raise `BudgetExhaustedError` when a scope refuses the request (see `refusal`)."""
        refused = self.refusal(scopes, need_tokens)
        if refused is not None:
            raise BudgetExhaustedError(refused)

    def try_admit(self, scopes: Sequence[str], need_tokens: int) -> Refusal | None:
        """Check, and on success hold `need_tokens` as in flight in this process until `release`; the refusal
        otherwise. Check and hold happen together: two threads here cannot both take the last tokens."""
        limited = self.limits.limited(scopes)
        with self._lock:
            refused = self.refusal(limited, need_tokens)
            if refused is None:
                for scope in limited:
                    self._in_flight[scope] = self._in_flight.get(scope, 0) + need_tokens
        if refused is not None and refused.unit == "tokens":
            self.repo.note_budget_refusal(self.cycle_id, refused.scope, int(refused.need))
        return refused

    def release(self, scopes: Sequence[str], need_tokens: int) -> None:
        """End the hold `try_admit` took (after the request's spend is recorded, or when it was not sent)."""
        with self._lock:
            for scope in self.limits.limited(scopes):
                self._in_flight[scope] = self._in_flight.get(scope, 0) - need_tokens

    @contextmanager
    def admitted(self, scopes: Sequence[str], need_tokens: int) -> Iterator[None]:
        """`try_admit` … `release` around a block (record the spend inside it); `BudgetExhaustedError` when refused."""
        refused = self.try_admit(scopes, need_tokens)
        if refused is not None:
            raise BudgetExhaustedError(refused)
        try:
            yield
        finally:
            self.release(scopes, need_tokens)

    def record(self, scopes: Sequence[str], *, tokens: int, cost_usd: float | None = None) -> None:
        """Add what one request spent to every scope (all of them, limited or not: status and reports read it)."""
        if tokens <= 0 and not cost_usd:
            return
        self.repo.add_budget_spend(self.cycle_id, scopes, tokens=max(tokens, 0), cost_usd=cost_usd or 0.0)
        self.alert(scopes)

    def alert(self, scopes: Sequence[str], spend: Mapping[str, Any] | None = None) -> list[BudgetAlert]:
        """Raise the alerts (50%, 80% of a limit) the spend of `scopes` reached first (see `raise_alerts`); no store
        round trip once every alert of these scopes is known to be raised."""
        limited = self.limits.limited(scopes)
        possible = {
            f"{ALERT_PREFIX}{scope}:{MEASURES[unit]}:{percent}"
            for scope in limited
            for unit, _ in self.limits.measures(scope)
            for percent in ALERT_PERCENTS
        }
        with self._lock:
            if possible <= self._alerted:
                return []
            known = set(self._alerted)
        raised = raise_alerts(self.repo, self.cycle_id, self.limits, limited, spend, known=known)
        with self._lock:
            self._alerted |= known
        return raised

    def exhausted(self, scopes: Sequence[str]) -> Refusal | None:
        """A scope that has no room for the request it last refused (in any process; with no refusal yet, for one
        more token): what stops scheduling new units of that scope. Raising the limit clears it."""
        limited = self.limits.limited(scopes)
        if not limited:
            return None
        spend = self.repo.budget_spend(self.cycle_id, limited)
        self.alert(limited, spend)  # a pod's spend reaches the ledger only as it ends: this check notices it
        for scope in limited:
            token_limit, cost_limit, prefix = self.limits.for_scope(scope)
            row = spend.get(scope)
            tokens, cost = (row.tokens, row.cost_usd) if row else (0, 0.0)
            need = (row.refused_need if row and row.refused_need else 0) or 1
            if token_limit is not None and tokens + need > token_limit:
                return Refusal(scope, f"{prefix}_tokens", token_limit, tokens, need, "tokens")
            if cost_limit is not None and cost >= cost_limit:
                return Refusal(scope, f"{prefix}_cost_usd", cost_limit, cost, 0.0, "USD")
        return None


def charge_episode(
    repo: MetadataRepository,
    cycle_id: int,
    task_id: object,
    *,
    charge_key: str,
    tokens: int,
    cost_usd: float = 0.0,
    requests: int = 0,
) -> bool:
    """Add what one whole episode attempt spent to its task's and the cycle's scopes (one transaction): how a
    Kubernetes pod's spend reaches the ledger, since its proxy had no store. `charge_key` names the attempt: a key
    charged before adds nothing, so every ingest of the attempt may call this. Returns whether it charged."""
    if tokens <= 0 and cost_usd <= 0 and requests <= 0:
        return False
    return repo.add_budget_spend(
        cycle_id,
        episode_scopes(task_id),
        tokens=max(tokens, 0),
        cost_usd=max(cost_usd, 0.0),
        requests=requests,
        charge_key=charge_key,
    )
