"""How many verdicts of a stage may stay invalid (`judge.max_invalid_fraction`), and the failure when more do.

A verdict is invalid when every attempt of its judge call, retries included, answered with something that is not a
usable verdict under `judge.verdict_parsing` (strict or lenient: the retries and this budget are the same in both).
Within the budget it is recorded as ``invalid`` and counts as a tie; beyond it the stage fails before recording it,
so a rerun judges that pair again (with fresh derived seeds) while every recorded verdict and every finished call is
reused.

The budget is fixed up front from the verdicts the stage plans — a task's versions in search (plus its recorded
arbitrations), a task's tournament in rank, a judge's (pair, seed) judgments in evaluate — so a stage fails as soon
as its final invalid share is certain to exceed the limit, never on an early unlucky verdict.
"""

from __future__ import annotations

import math
import threading

from mass_ops.errors import InputError

# A fraction times a count is compared with a small slack, so 0.25 × 4 allows exactly 1 despite float rounding.
_SLACK = 1e-9


class TooManyInvalidVerdictsError(InputError):
    """A stage's judge left more verdicts invalid than `judge.max_invalid_fraction` allows.

    An input error: the judge's output (the model, its prompts, its token budget) is what must change; the platform
    worked, and a rerun after the fix continues where this one stopped.
    """


class InvalidVerdictBudget:
    """The invalid verdicts one stage scope may keep. Thread-safe: concurrent judge calls share one budget."""

    def __init__(self, scope: str, *, max_fraction: float, planned: int, already_invalid: int = 0) -> None:
        """`scope` names the stage and its unit in messages (``rank task 51``); `planned` is the number of verdicts
        the scope will hold when done; `already_invalid` counts those recorded invalid by earlier runs."""
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be within [0, 1], got {max_fraction}")
        self.scope = scope
        self.max_fraction = max_fraction
        self.planned = max(planned, 0)
        self.invalid = already_invalid
        # At 1.0 every verdict may be invalid, including ones beyond a planned count that is a lower bound.
        self.allowed = None if max_fraction >= 1.0 else math.floor(max_fraction * self.planned + _SLACK)
        self._lock = threading.Lock()

    def admit(self, key: str, reason: str) -> None:
        """Count one more invalid verdict (`key`: its ledger key, `reason`: why it is invalid), or raise
        `TooManyInvalidVerdictsError` — without counting it — when that would exceed the budget."""
        with self._lock:
            if self.allowed is not None and self.invalid + 1 > self.allowed:
                raise TooManyInvalidVerdictsError(
                    f"{self.scope}: verdict {key} is invalid ({_one_line(reason)}); {self.invalid + 1} invalid of "
                    f"{self.planned} planned verdicts exceeds judge.max_invalid_fraction = {self.max_fraction:g} "
                    f"(at most {self.allowed}); finished verdicts stay recorded — fix the judge's output (model, "
                    "endpoint, inference.max_output_tokens, judge.verdict_parsing) and rerun to judge only the "
                    "missing ones"
                )
            self.invalid += 1


def _one_line(text: str, limit: int = 300) -> str:
    """`text` on one line, shortened to `limit` characters: it is quoted inside a one-line error."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
