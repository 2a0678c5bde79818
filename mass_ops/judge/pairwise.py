"""The pairwise judge: one JSON call per pair (or two with swap-consistent judging), bounded retries of unusable
answers, every attempt in the call ledger (MASS_SPEC §5; ARCHITECTURE: optional swap-consistent judging).

Contract: an unusable answer is retried up to `invalid_retries` times with fresh seeds, then the outcome is
``invalid`` (the stage records it as a tie or fails); infrastructure failures raise and are not retried here. A pair
in the position-bias sample is judged once more swapped, as a measurement only. A refused workspace loses the pair
without a call (both refused: a tie). `judge.verdict_parsing` picks ``strict`` or ``lenient`` reading.
Retry seeds, the bias sample and refusals in depth: docs/evaluation.md (`mass_ops.judge.pairwise`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from mass_ops.judge.evidence import EvidenceBundle
from mass_ops.judge.prompts import judge_system_prompt, judge_user_prompt
from mass_ops.judge.verdicts import (
    VERDICT_PARSINGS,
    PairwiseVerdict,
    VerdictParsing,
    Winner,
    parse_verdict,
    recorded_verdict,
)
from mass_ops.llm import LLMClient, LLMOutputError, SamplingParams
from mass_ops.llm.calls import CallAttempt, CallLedger, CallUnit
from mass_ops.prompts import PromptSet, shipped_prompts
from mass_ops.seeds import judge_retry_seed
from mass_ops.store.schema import CallStatus

Verdict = Literal["A", "B", "tie", "invalid"]
_FLIP: dict[Winner, Winner] = {"A": "B", "B": "A", "tie": "tie"}
SWAPPED_SUFFIX = "/swapped"


def in_position_bias_sample(unit_key: str, fraction: float) -> bool:
    """Whether the pair judged under `unit_key` is in the position-bias sample of size `fraction` (0..1).

    The first 8 bytes of SHA-256(`unit_key`) as a number in [0, 1) below `fraction`: deterministic across processes
    and reruns (no RNG state, no dependence on which pairs a run happens to judge), independent of every seed.
    """
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    digest = hashlib.sha256(unit_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def swapped_unit(unit: CallUnit) -> CallUnit:
    """The call unit of a pair judged with A and B swapped (swap-consistent judging or the position-bias sample)."""
    return CallUnit(f"{unit.key}{SWAPPED_SUFFIX}", unit.purpose, unit.task_id)


@dataclass(frozen=True)
class PairwiseCase:
    """One pair to judge: A and B evidence of one task, their labels, the call unit and the sampling seed; `priority`
    is the calls' server priority (`critical_path.server_priority`; None: not sent)."""

    unit: CallUnit
    task_id: int
    task_text: str
    label_a: str
    label_b: str
    bundle_a: EvidenceBundle
    bundle_b: EvidenceBundle
    seed: int | None
    priority: int | None = None


@dataclass(frozen=True)
class JudgeOutcome:
    """The verdict of a pair in the A/B orientation of the case; `invalid` counts as a tie."""

    verdict: Verdict
    rationale: str
    call_id: int | None
    usage: dict[str, Any] | None
    calls: int
    # The swapped order's verdict mapped back to A/B orientation, when the pair was judged in both orders
    # (swap-consistent judging or the position-bias sample); never used for `verdict` outside swap-consistent judging.
    swapped_verdict: Verdict | None = None

    @property
    def effective(self) -> Literal["A", "B", "tie"]:
        """The verdict as consumers score it: an invalid verdict is a tie."""
        return "tie" if self.verdict == "invalid" else self.verdict


@dataclass(frozen=True)
class _OrderResult:
    verdict: PairwiseVerdict | None
    reason: str
    call_id: int | None
    usage: dict[str, Any]
    calls: int


class PairwiseJudge:
    """Judges pairs with one model through one client; attempts are recorded by the ledger bound to the client."""

    def __init__(
        self,
        client: LLMClient,
        ledger: CallLedger,
        sampling: Callable[[int | None], SamplingParams],
        *,
        invalid_retries: int = 2,
        swap_consistent: bool = False,
        position_bias_sample: float = 0.0,
        prompts: PromptSet | None = None,
        verdict_parsing: VerdictParsing = "lenient",
    ) -> None:
        if invalid_retries < 0:
            raise ValueError(f"invalid_retries must be ≥ 0, got {invalid_retries}")
        if not 0.0 <= position_bias_sample <= 1.0:
            raise ValueError(f"position_bias_sample must lie in [0, 1], got {position_bias_sample}")
        if verdict_parsing not in VERDICT_PARSINGS:
            raise ValueError(f"verdict_parsing must be one of {list(VERDICT_PARSINGS)}, got {verdict_parsing!r}")
        self.client = ledger.bind(client)
        self.ledger = ledger
        self.sampling = sampling
        self.invalid_retries = invalid_retries
        self.swap_consistent = swap_consistent
        self.position_bias_sample = position_bias_sample
        self.prompts = prompts or shipped_prompts()
        self.verdict_parsing: VerdictParsing = verdict_parsing

    def judge(self, case: PairwiseCase) -> JudgeOutcome:
        """The verdict of `case`, reusing any finished attempt already in the ledger."""
        refused = refused_outcome(case)
        if refused is not None:
            return refused
        system = judge_system_prompt(case.task_id, prompts=self.prompts)
        forward = self._judge_order(
            case.unit,
            system,
            judge_user_prompt(
                case.task_text, case.label_a, case.label_b, case.bundle_a, case.bundle_b, prompts=self.prompts
            ),
            case.seed,
            case.priority,
        )

        def backward_prompt() -> str:
            return judge_user_prompt(
                case.task_text, case.label_b, case.label_a, case.bundle_b, case.bundle_a, prompts=self.prompts
            )

        if not self.swap_consistent:
            if forward.verdict is None:
                # An invalid verdict has nothing to compare a swapped one with: no position-bias call for it.
                return JudgeOutcome("invalid", forward.reason, forward.call_id, forward.usage, forward.calls)
            checked: Verdict | None = None
            calls = forward.calls
            if in_position_bias_sample(case.unit.key, self.position_bias_sample):
                # A measurement only: recorded in the ledger, never folded into the verdict, usage or rationale.
                check = self._judge_order(swapped_unit(case.unit), system, backward_prompt(), case.seed, case.priority)
                checked = "invalid" if check.verdict is None else _FLIP[check.verdict.winner]
                calls += check.calls
            return JudgeOutcome(
                forward.verdict.winner,
                forward.verdict.rationale,
                forward.call_id,
                forward.usage,
                calls,
                swapped_verdict=checked,
            )
        backward = self._judge_order(swapped_unit(case.unit), system, backward_prompt(), case.seed, case.priority)
        usage = _add_usage(forward.usage, backward.usage)
        calls = forward.calls + backward.calls
        if forward.verdict is None or backward.verdict is None:
            reason = forward.reason if forward.verdict is None else backward.reason
            mapped: Verdict | None = None if backward.verdict is None else _FLIP[backward.verdict.winner]
            return JudgeOutcome("invalid", reason, forward.call_id, usage, calls, swapped_verdict=mapped)
        mapped_back = _FLIP[backward.verdict.winner]
        verdict: Verdict = forward.verdict.winner if forward.verdict.winner == mapped_back else "tie"
        rationale = (
            f"[A/B order: {forward.verdict.winner}] {forward.verdict.rationale}\n"
            f"[swapped order, mapped back: {mapped_back}] {backward.verdict.rationale}"
        )
        if verdict == "tie" and forward.verdict.winner != mapped_back:
            rationale = "The two presentation orders disagree, so the pair is a tie.\n" + rationale
        return JudgeOutcome(verdict, rationale, forward.call_id, usage, calls, swapped_verdict=mapped_back)

    def _judge_order(
        self, unit: CallUnit, system: str, user: str, seed: int | None, priority: int | None
    ) -> _OrderResult:
        """One presentation order: a finished attempt, else new attempts until a valid verdict or until
        1 + `invalid_retries` answers of this round were unusable."""
        attempts = self.ledger.attempts(unit)
        stored = self.ledger.finished(unit, attempts)
        if stored is not None:
            recorded = recorded_verdict(stored.parsed, parsing=self.verdict_parsing)
            return _OrderResult(recorded, "", stored.row.id, _usage(stored.row.usage), 0)
        calls = 0
        usage: dict[str, Any] = {}
        unusable = sum(1 for row in attempts if row.status == CallStatus.INVALID)  # earlier runs' included
        invalid_now = 0
        while True:
            verdict: PairwiseVerdict | None = None
            attempt: CallAttempt | None = None
            try:
                with self.ledger.attempt(unit, len(attempts) + 1) as attempt:
                    calls += 1
                    sampling = self.sampling(judge_retry_seed(seed, unusable))
                    if priority is not None:
                        sampling = replace(sampling, priority=priority)
                    result = self.client.chat(
                        system,
                        user,
                        purpose=unit.purpose,
                        sampling=sampling,
                        json_mode="json_object",
                        json_parsing=self.verdict_parsing,
                    )
                    usage = _add_usage(usage, result.usage)
                    try:
                        verdict = parse_verdict(result.parsed_json, parsing=self.verdict_parsing)
                    except ValueError as exc:
                        attempt.mark_invalid(str(exc))
                    else:
                        attempt.parsed = result.parsed_json
            except LLMOutputError:
                pass  # recorded as an invalid attempt; the loop decides whether to try again
            if attempt is None or attempt.row is None:  # every answered call is recorded; never loop unrecorded
                raise RuntimeError(f"judge call {unit.key} returned without a recorded attempt")
            attempts.append(attempt.row)
            if verdict is not None:
                return _OrderResult(verdict, "", attempt.row.id, usage, calls)
            unusable += 1
            invalid_now += 1
            if invalid_now > self.invalid_retries:
                reason = f"judge output invalid after {invalid_now} attempts (last: {attempt.row.error})"
                return _OrderResult(None, reason, attempt.row.id, usage, calls)


def refused_outcome(case: PairwiseCase) -> JudgeOutcome | None:
    """The outcome of a pair with a refused workspace (see the module docstring); None when both were unpacked."""
    a, b = case.bundle_a.refused, case.bundle_b.refused
    if a is None and b is None:
        return None
    verdict: Verdict = "tie" if a is not None and b is not None else ("B" if a is not None else "A")
    reasons = [f"workspace {label} was not judged: {why}" for label, why in (("A", a), ("B", b)) if why is not None]
    return JudgeOutcome(verdict, "; ".join(reasons), None, None, 0)


def _usage(value: dict[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


def _add_usage(left: dict[str, Any], right: dict[str, Any] | None) -> dict[str, Any]:
    """Sum of the token counters of two usage documents."""
    total = dict(left)
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = (right or {}).get(name)
        if isinstance(value, int):
            total[name] = int(total.get(name, 0)) + value
    return total
