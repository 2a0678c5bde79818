"""The RHI optimizer prompt (MASS_SPEC §3.3 step B): every section, in the reference order. The texts are the
templates ``optimizer_system.j2``, ``optimizer_user.j2`` and ``optimizer_parts.j2`` (`mass_ops.prompts`); this
module computes what they show: collapsed rationales, takeaways, recent diffs, the scoreboard and the checklist.

User prompt: 1 the query (task, current design, previous best with its rationale, the v0 root, save rules), 2 the
evidence of the current workspace, 2b execution metadata with the failure notice, 3 the history of verdicts against
the bare reference (takeaways, design diffs, W/L/T scoreboard), 3b the delta checklist, 4 instructions and schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.prompts import PromptSet, shipped_prompts
from mass_ops.workflow import START_MARKER

BEST_RATIONALE_CHARS = 2000
HISTORY_RATIONALE_CHARS = 2400
MAX_TAKEAWAYS = 6
RECENT_DIFFS = 3
RECENT_DIFF_CHARS = 1500
OLDER_DIFF_CHARS = 400

_TAKEAWAY_CUES = (
    "fail", "missing", "inconsistent", "mismatch", "not ", "lack", "weak", "nan", "null", "error", "defect",
    "reproducibility",
)  # fmt: skip

# Six recurring-defect buckets of the delta checklist: (name, pattern over a rationale).
DELTA_BUCKETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "report-metrics inconsistency",
        re.compile(r"inconsisten|mismatch|contradict|does(?: not|n't) match|disagree", re.IGNORECASE),
    ),
    (
        "missing deliverables or sections",
        re.compile(r"missing|absent|not (?:found|provided|included|present)|lacks? ", re.IGNORECASE),
    ),
    ("stability/robustness gap", re.compile(r"stabil|robust|variance|sensitiv|across seeds", re.IGNORECASE)),
    ("null/nan quality defect", re.compile(r"\bnan\b|\bnull\b|\bnone\b|placeholder|empty", re.IGNORECASE)),
    (
        "reproducibility gap",
        re.compile(r"reproduc|pinned|requirements|entry point|determinis|random seed", re.IGNORECASE),
    ),
    (
        "validation/test weakness",
        re.compile(r"validat|unit tests?|out-of-sample|hold-?out|leak|overfit|walk-forward", re.IGNORECASE),
    ),
)


def collapse(text: str, limit: int | None = None) -> str:
    """Whitespace collapsed to single spaces, cut to `limit` characters with an ellipsis."""
    flat = " ".join(text.split())
    if limit is not None and len(flat) > limit:
        return flat[: max(0, limit - 1)].rstrip() + "…"
    return flat


def sentences(text: str) -> list[str]:
    """Sentences of a whitespace-collapsed text."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", collapse(text)) if s.strip()]


def takeaways(rationale: str, limit: int = MAX_TAKEAWAYS) -> list[str]:
    """Actionable sentences of a rationale: those naming a failure, a gap or a defect (at most `limit`)."""
    found = [s for s in sentences(rationale) if any(cue in s.lower() for cue in _TAKEAWAY_CUES)]
    return found[:limit]


@dataclass(frozen=True)
class HistoryEntry:
    """One verdict of a version against the reference, with the design change behind it."""

    key: str
    version: int
    winner: str
    judge_model: str
    judged_at: str
    side_a: str
    side_b: str
    rationale: str
    diff: str | None = None


@dataclass(frozen=True)
class BestDesign:
    """The champion shown to the optimizer when it is not the current version."""

    version: int
    design: str
    rationale: str
    case: Literal["both_win_arbitration", "champion_only_win"]


@dataclass(frozen=True)
class OptimizerInputs:
    """Everything the optimizer prompt of step k is built from."""

    version: int
    task_text: str
    current_design: str
    evidence: str
    run_status: Mapping[str, Any]
    history: Sequence[HistoryEntry] = ()
    scoreboard: Sequence[tuple[int, str | None]] = ()
    retained: int | None = None
    best: BestDesign | None = None
    v0_design: str | None = None

    @property
    def baseline_mode(self) -> bool:
        """From step 1 on, history is framed as verdicts against the fixed bare reference."""
        return self.version >= 1


def optimizer_system_prompt(*, prompts: PromptSet | None = None) -> str:
    """System prompt of the optimizer (template ``optimizer_system.j2``)."""
    return (prompts or shipped_prompts()).render("optimizer_system.j2")


def run_failed(run_status: Mapping[str, Any]) -> bool:
    """A run failed when its exit code is neither 0 nor unknown, or its trace holds no success result."""
    return run_status.get("exit_code") not in (0, None) or run_status.get("trace_has_success_result") is not True


def failure_notice(run_status: Mapping[str, Any], *, prompts: PromptSet | None = None) -> str | None:
    """The FAILURE NOTICE (and prior-failure addenda) for a run that did not finish cleanly, else None (macro
    ``failure_notice`` of ``optimizer_parts.j2``)."""
    notice = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "failure_notice")
    return notice(run_failed(run_status), bool(run_status.get("prior_failures"))).strip("\n") or None


def _scoreboard_entries(scoreboard: Sequence[tuple[int, str | None]], retained: int | None) -> list[dict[str, Any]]:
    return [{"version": v, "verdict": verdict, "retained": v == retained} for v, verdict in scoreboard]


def scoreboard_line(
    scoreboard: Sequence[tuple[int, str | None]], retained: int | None, *, prompts: PromptSet | None = None
) -> str:
    """``Record vs no_harness: v0 W★ · v1 L · v2 T · …`` (W win, L loss, T tie, T! invalid judge answer counted as
    a tie, ? not judged; ★ marks the retained champion), macro ``scoreboard`` of ``optimizer_parts.j2``."""
    line = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "scoreboard")
    return line(_scoreboard_entries(scoreboard, retained)).strip("\n")


def delta_rows(rationales: Sequence[str]) -> list[dict[str, Any]]:
    """Recurring defect categories across the history rationales, most frequent first (ties in bucket order), each
    with its verdict count and an example sentence of the latest rationale that names it."""
    rows = []
    for order, (name, pattern) in enumerate(DELTA_BUCKETS):
        matching = [r for r in rationales if pattern.search(r)]
        if not matching:
            continue
        example = next((s for s in sentences(matching[-1]) if pattern.search(s)), collapse(matching[-1], 300))
        rows.append((-len(matching), order, {"name": name, "count": len(matching), "example": collapse(example, 300)}))
    return [row for _, _, row in sorted(rows, key=lambda item: item[:2])]


def delta_checklist(rationales: Sequence[str], *, prompts: PromptSet | None = None) -> str:
    """The delta checklist of `rationales` (macro ``delta_checklist`` of ``optimizer_parts.j2``)."""
    checklist = (prompts or shipped_prompts()).macro("optimizer_parts.j2", "delta_checklist")
    return checklist(delta_rows(rationales)).strip("\n")


def _history_entry(entry: HistoryEntry, diff_chars: int) -> dict[str, Any]:
    # The reference shortener collapses whitespace, so each diff reads as one line; kept for faithfulness.
    return {
        "key": entry.key,
        "version": entry.version,
        "winner": entry.winner,
        "judge_model": entry.judge_model,
        "judged_at": entry.judged_at,
        "side_a": entry.side_a,
        "side_b": entry.side_b,
        "rationale": collapse(entry.rationale, HISTORY_RATIONALE_CHARS),
        "takeaways": takeaways(entry.rationale),
        "diff": None if entry.diff is None else collapse(entry.diff, diff_chars),
    }


def optimizer_variables(inputs: OptimizerInputs) -> dict[str, Any]:
    """The variables of ``optimizer_user.j2`` for step k (documented in the template's header)."""
    with_diffs = [e for e in inputs.history if e.diff is not None]
    recent = {e.key for e in with_diffs[-RECENT_DIFFS:]}
    best = inputs.best
    return {
        "version": inputs.version,
        "task_text": inputs.task_text.strip(),
        "current_design": inputs.current_design.strip(),
        "best": None
        if best is None
        else {
            "version": best.version,
            "design": best.design.strip(),
            "rationale": collapse(best.rationale, BEST_RATIONALE_CHARS),
            "case": best.case,
        },
        "v0_design": None if inputs.v0_design is None else inputs.v0_design.strip(),
        "evidence": inputs.evidence.strip(),
        "run_status_json": json.dumps(dict(inputs.run_status), indent=2, default=str),
        "run_failed": run_failed(inputs.run_status),
        "prior_failures": bool(inputs.run_status.get("prior_failures")),
        "baseline_mode": inputs.baseline_mode,
        "scoreboard": _scoreboard_entries(inputs.scoreboard, inputs.retained),
        "history": [
            _history_entry(e, RECENT_DIFF_CHARS if e.key in recent else OLDER_DIFF_CHARS) for e in inputs.history
        ],
        "delta_rows": delta_rows([e.rationale for e in inputs.history]),
        "start_marker": START_MARKER,
    }


def optimizer_user_prompt(inputs: OptimizerInputs, *, prompts: PromptSet | None = None) -> str:
    """The user message of the optimizer call of step k (template ``optimizer_user.j2``)."""
    return (prompts or shipped_prompts()).render("optimizer_user.j2", **optimizer_variables(inputs))
