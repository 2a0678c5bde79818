"""What one episode's proxy may spend (docs/proxy.md, "Budgets"): `EpisodeBudget` admits a generation request's need
before it is forwarded and settles it with the response's reported usage; `usage_tokens` and `usage_cost` read an
OpenAI `usage` object. Unreported spend is never counted as 0 when the server may have generated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from mass_ops.store.budgets import EPISODE_SCOPE, BudgetLedger, Refusal

logger = logging.getLogger(__name__)

# A request refused by a budget: 402 (payment required), which OpenAI clients and qwen-code do not retry as they do a
# 429, and an error code no server uses, so neither the agent nor the classifier can take it for anything else.
BUDGET_STATUS = 402
BUDGET_ERROR_CODE = "budget_exhausted"


def usage_tokens(usage: Any) -> tuple[int, int | None]:
    """(tokens, cached prompt tokens or None) of an OpenAI `usage` object (zeros if absent). Tokens are prompt +
    completion (Chat/Completions) or input + output (Responses), or `total_tokens` where that is larger."""

    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    if not isinstance(usage, dict):
        return 0, None
    total = max(
        count(usage.get("prompt_tokens")) + count(usage.get("completion_tokens")),
        count(usage.get("input_tokens")) + count(usage.get("output_tokens")),
        count(usage.get("total_tokens")),
    )
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return total, cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def usage_cost(usage: Any) -> float:
    """The server-reported cost of a response in USD (OpenRouter's `usage.cost`), else 0."""
    cost = usage.get("cost") if isinstance(usage, dict) else None
    return float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) and cost > 0 else 0.0


class EpisodeBudget:
    """What one episode's proxy enforces before forwarding a completion (docs/proxy.md, "Budgets").

    `episode_tokens` is held here in memory (the proxy sees all of the episode's requests); `ledger` + `scopes`
    are the cycle's shared budgets (the task's and the cycle's). Thread-safe: records are settled on worker threads.
    """

    def __init__(
        self,
        *,
        episode_tokens: int | None,
        default_max_tokens: int,
        ledger: BudgetLedger | None = None,
        scopes: Sequence[str] = (),
    ) -> None:
        self.episode_tokens = episode_tokens
        self.default_max_tokens = default_max_tokens
        self.ledger = ledger if ledger is not None and ledger.limits.limited(scopes) else None
        self.ledger_scopes = tuple(scopes)
        self.spent = 0  # tokens of this episode's responses so far
        self.in_flight = 0  # needs of admitted requests whose spend is not settled yet
        self.refusals = 0
        self._lock = threading.Lock()

    @property
    def uses_store(self) -> bool:
        """Whether admitting a request reads the metadata store (then call `admit` off the event loop)."""
        return self.ledger is not None

    def admit(self, need: int) -> Refusal | None:
        """Hold `need` in flight and return None, or return why the request may not be sent."""
        with self._lock:
            used = self.spent + self.in_flight
            if self.episode_tokens is not None and used + need > self.episode_tokens:
                self.refusals += 1
                return Refusal(EPISODE_SCOPE, "budgets.episode_tokens", self.episode_tokens, used, need, "tokens")
            self.in_flight += need
        if self.ledger is not None:
            refused = self.ledger.try_admit(self.ledger_scopes, need)
            if refused is not None:
                with self._lock:
                    self.in_flight -= need
                    self.refusals += 1
                return refused
        return None

    def settle(self, need: int, usage: Any, *, server_may_have_generated: bool = True) -> None:
        """The admitted request of `need` ended with `usage` (None when it failed): add its spend, end its hold.

        Without reported tokens the request is charged its whole `need` unless the server surely generated nothing
        (it was never reached, or refused the request): unreported spend is never counted as 0."""
        tokens, _cached = usage_tokens(usage)
        if tokens == 0 and server_may_have_generated:
            tokens = need
        try:
            if self.ledger is not None:
                self.ledger.record(self.ledger_scopes, tokens=tokens, cost_usd=usage_cost(usage))
        except Exception as exc:  # the record must still be written; the spend stays counted for this episode
            logger.warning("episode proxy: could not record %d tokens in the budget ledger: %s", tokens, exc)
        finally:
            with self._lock:
                self.spent += tokens
                self.in_flight -= need
            if self.ledger is not None:
                self.ledger.release(self.ledger_scopes, need)
