"""Judge position bias: how often a verdict changes when the two workspaces are shown in the other order.

A pair is *order-checked* when the call ledger holds a usable verdict for both presentations of it: the forward call
``<key>/a<n>`` and the swapped call ``<key>/swapped/a<n>`` (made for every pair by swap-consistent judging, for a
hash-picked share by `judge.position_bias_sample`; see `mass_ops.judge.pairwise`). The swapped verdict is mapped
back to the forward orientation before comparing.

Flip: the two verdicts differ — an A/B reversal, or a tie in one order and a decisive verdict in the other (a tie
in both orders is consistent). A *reversal* is the decisive kind only; among reversals, the first-shown workspace won
both times when the forward verdict was A (its mirror, B, means the second-shown one won both times). A pair
whose verdict is invalid in either order (after the judge's retries) has no comparison to make and is left out; the
count of those is reported beside the rate. The flip rate is flips / order-checked pairs with a 95% Wilson
interval (pairs are independent: each has its own two calls).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.evaluation.stats import wilson_interval
from mass_ops.judge.verdicts import JudgeOutputError, recorded_verdict
from mass_ops.llm.calls import CallLedger
from mass_ops.store.artifacts import ArtifactNotFoundError
from mass_ops.store.schema import CallStatus, LLMCall

Outcome = Literal["A", "B", "tie"]
_FLIP: dict[str, Outcome] = {"A": "B", "B": "A", "tie": "tie"}
_ATTEMPT = re.compile(r"^(?P<unit>.+)/a(?P<n>\d+)$")
_SWAPPED = "/swapped"
# In-loop ledgers in unit keys ``task<q>/<ledger>/<key>``, named as the report names their judging stages.
IN_LOOP_STAGES = {"rhi": "search: vs reference", "champion": "search: arbitration", "ranking": "rank: self-judge"}


@dataclass(frozen=True)
class OrderCheck:
    """One pair judged in both presentations: `forward` as first shown, `swapped_back` the swapped presentation's
    verdict mapped back to that orientation; None for a presentation without a usable verdict."""

    stage: str
    judge: str
    unit_key: str
    forward: Outcome | None
    swapped_back: Outcome | None

    @property
    def usable(self) -> bool:
        return self.forward is not None and self.swapped_back is not None

    @property
    def flipped(self) -> bool:
        """The verdict changes with the order (ties included, see the module docstring)."""
        return self.usable and self.forward != self.swapped_back

    @property
    def reversed(self) -> bool:
        """A decisive verdict turned into the opposite decisive one."""
        return self.flipped and self.forward != "tie" and self.swapped_back != "tie"

    @property
    def first_shown_won_twice(self) -> bool:
        """A reversal in which the workspace shown first won in both presentations."""
        return self.reversed and self.forward == "A"


@dataclass(frozen=True)
class FlipRate:
    """Order checks of one judge in one stage: flips among usable checks, with a 95% Wilson interval."""

    stage: str
    judge: str
    checked: int
    flips: int
    reversals: int
    first_shown_won_twice: int
    unusable: int

    @property
    def rate(self) -> float | None:
        return self.flips / self.checked if self.checked else None

    @property
    def wilson(self) -> tuple[float, float] | None:
        return wilson_interval(self.flips, self.checked)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "judge": self.judge,
            "checked": self.checked,
            "flips": self.flips,
            "reversals": self.reversals,
            "first_shown_won_twice": self.first_shown_won_twice,
            "unusable": self.unusable,
            "flip_rate": self.rate,
            "wilson_95": list(self.wilson) if self.wilson else None,
        }


def flip_rate(checks: Sequence[OrderCheck], *, stage: str = "", judge: str = "") -> FlipRate:
    """The flip rate of `checks` (all of one judge and stage, or any group the caller chose)."""
    usable = [c for c in checks if c.usable]
    return FlipRate(
        stage=stage,
        judge=judge,
        checked=len(usable),
        flips=sum(c.flipped for c in usable),
        reversals=sum(c.reversed for c in usable),
        first_shown_won_twice=sum(c.first_shown_won_twice for c in usable),
        unusable=len(checks) - len(usable),
    )


def flip_rates(checks: Iterable[OrderCheck]) -> list[FlipRate]:
    """One flip rate per (stage, judge), in-loop stages in cycle order first, then evaluate's judges by name."""
    groups: dict[tuple[str, str], list[OrderCheck]] = defaultdict(list)
    for check in checks:
        groups[(check.stage, check.judge)].append(check)
    order = list(IN_LOOP_STAGES.values())

    def position(group: tuple[str, str]) -> tuple[int, str, str]:
        stage, judge = group
        return (order.index(stage) if stage in order else len(order), stage, judge)

    return [flip_rate(groups[g], stage=g[0], judge=g[1]) for g in sorted(groups, key=position)]


def stage_and_judge(unit_key: str, model: str) -> tuple[str, str] | None:
    """Where a judged pair's unit key belongs: ``eval/external/<pair>/<judge>/<seed>`` → ("evaluate", judge);
    ``task<q>/<ledger>/<key>`` → (the ledger's stage, the serving model). None for other calls (optimizer)."""
    parts = unit_key.split("/")
    if parts[0] == "eval" and len(parts) == 5:
        return "evaluate", parts[3]
    if len(parts) >= 3 and parts[0].startswith("task") and parts[1] in IN_LOOP_STAGES:
        return IN_LOOP_STAGES[parts[1]], model
    return None


def _winner(parsed: Any) -> Outcome | None:
    # A succeeded attempt's answer passed the cycle's judge.verdict_parsing when it was recorded; read it either way.
    try:
        return recorded_verdict(parsed).winner
    except JudgeOutputError:
        return None


def _stored_winner(ledger: CallLedger, row: LLMCall | None) -> Outcome | None:
    """The verdict of a succeeded attempt as its stored answer holds it; None without one (or without its answer
    document)."""
    if row is None:
        return None
    try:
        stored = ledger.artifacts.get_json(ledger.result_key(row.unit_key))
    except ArtifactNotFoundError:
        return None  # a row whose answer document is gone (deleted by hand): nothing to compare, not a crash
    return _winner(stored.get("parsed") if isinstance(stored, dict) else None)


def order_checks(ledger: CallLedger, calls: Iterable[LLMCall]) -> list[OrderCheck]:
    """The order checks among a cycle's recorded calls: every judged unit with a swapped twin that has at least one
    attempt, its stored answers read back from the artifact store (two reads per pair)."""
    succeeded: dict[str, LLMCall] = {}
    attempted: set[str] = set()
    for call in calls:
        match = _ATTEMPT.match(call.unit_key)
        if match is None:
            continue
        attempted.add(match["unit"])
        if call.status == CallStatus.SUCCEEDED:
            succeeded[match["unit"]] = call
    checks = []
    for unit in sorted(attempted):
        base = unit.removesuffix(_SWAPPED)
        if base == unit or base not in attempted:
            continue
        known = succeeded.get(base) or succeeded.get(unit)
        placed = stage_and_judge(base, known.model if known else "")
        if placed is None:
            continue
        back = _stored_winner(ledger, succeeded.get(unit))
        forward = _stored_winner(ledger, succeeded.get(base))
        checks.append(OrderCheck(placed[0], placed[1], base, forward, None if back is None else _FLIP[back]))
    return checks
