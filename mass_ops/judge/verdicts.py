"""The pairwise verdict schema and its two readings (`judge.verdict_parsing`, MASS_SPEC §5).

* ``strict`` — the reference's schema exactly: ``winner`` is the string ``A``, ``B`` or ``tie`` as written (no case
  folding, no trimming) and ``rationale`` a string of at least one character, kept as written (a rationale of spaces
  passes; one holding a lone UTF-16 surrogate does not, as the reference's validator refuses it).
* ``lenient`` — mass-ops' earlier reading: the winner is matched after trimming and ignoring case (``" Tie "``),
  the rationale must hold a non-space character and is stored trimmed.

Which JSON object is read out of the answer text is the client's business (`mass_ops.llm.response`); both modes see
the same object here. An answer that is not a valid verdict raises `JudgeOutputError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.errors import InputError

Winner = Literal["A", "B", "tie"]
WINNERS: tuple[str, ...] = ("A", "B", "tie")
VerdictParsing = Literal["strict", "lenient"]
VERDICT_PARSINGS: tuple[str, ...] = ("strict", "lenient")
# Each winner under its exact spelling (strict) and case-folded (lenient): lookups that also give the Literal type.
_EXACT_WINNERS: dict[str, Winner] = {"A": "A", "B": "B", "tie": "tie"}
_FOLDED_WINNERS: dict[str, Winner] = {w.lower(): w for w in _EXACT_WINNERS.values()}


class JudgeOutputError(InputError):
    """The judge answered with JSON that is not a valid verdict."""


@dataclass(frozen=True)
class PairwiseVerdict:
    """A valid judge answer."""

    winner: Winner
    rationale: str


def parse_verdict(answer: dict[str, Any] | None, *, parsing: VerdictParsing = "lenient") -> PairwiseVerdict:
    """Validate a parsed judge answer against {winner: A|B|tie, rationale: non-empty string} under `parsing`
    (see the module docstring); anything else raises JudgeOutputError."""
    if parsing not in VERDICT_PARSINGS:
        raise ValueError(f"verdict parsing must be one of {list(VERDICT_PARSINGS)}, got {parsing!r}")
    if not isinstance(answer, dict):
        raise JudgeOutputError(f"judge answer must be a JSON object, got {type(answer).__name__}")
    winner = answer.get("winner")
    rationale = answer.get("rationale")
    if parsing == "strict":
        exact = _EXACT_WINNERS.get(winner) if isinstance(winner, str) else None
        if exact is None:
            raise JudgeOutputError(f"judge answer: 'winner' must be exactly one of A, B, tie; got {winner!r}")
        if not isinstance(rationale, str) or not rationale:
            raise JudgeOutputError("judge answer: 'rationale' must be a string of at least one character")
        if not _is_unicode(rationale):
            raise JudgeOutputError("judge answer: 'rationale' holds a lone UTF-16 surrogate (not Unicode text)")
        return PairwiseVerdict(winner=exact, rationale=rationale)
    normalised = _FOLDED_WINNERS.get(winner.strip().lower()) if isinstance(winner, str) else None
    if normalised is None:
        raise JudgeOutputError(f"judge answer: 'winner' must be one of A, B, tie; got {winner!r}")
    if not isinstance(rationale, str) or not rationale.strip():
        raise JudgeOutputError("judge answer: 'rationale' must be a non-empty string")
    return PairwiseVerdict(winner=normalised, rationale=rationale.strip())


def recorded_verdict(answer: dict[str, Any] | None, *, parsing: VerdictParsing = "lenient") -> PairwiseVerdict:
    """The verdict of an answer a judge call already accepted: read under `parsing`, else under the other mode.

    A recorded answer passed the mode of the run that recorded it; both modes give the same winner wherever both
    accept, so reading a record never depends on which mode wrote it. Raises JudgeOutputError when neither accepts.
    """
    try:
        return parse_verdict(answer, parsing=parsing)
    except JudgeOutputError:
        other: VerdictParsing = "lenient" if parsing == "strict" else "strict"
        return parse_verdict(answer, parsing=other)


def _is_unicode(text: str) -> bool:
    """Whether `text` is encodable as UTF-8 (JSON's ``\\ud800`` escapes decode to lone surrogates that are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
