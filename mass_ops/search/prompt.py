"""The RHI optimizer prompt (MASS_SPEC §3.3 step B): every section, in the reference order.

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

from mass_ops.workflow import START_MARKER

RULE = "-" * 100
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
_SCOREBOARD_MARK = {"B": "W", "A": "L", "tie": "T", "invalid": "T!"}

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


def optimizer_system_prompt() -> str:
    """System prompt of the optimizer."""
    return (
        "You are a principal prompt engineer for autonomous coding agents. You improve ONLY the multi-agent design "
        "block of a research task prompt so that the agent team executing it produces deliverables of higher "
        "quality.\n"
        "Prioritise what a multi-agent system can do and a single agent cannot: decomposition into parallel "
        "specialists, critique across agents, agent-to-agent communication and iterative reconciliation of "
        "their outputs.\n"
        "Two priorities above all:\n"
        '1. Stronger agent-to-agent communication contracts: every subagent\'s "Output to orchestrator" schema '
        "states exactly what it returns (paths, checks run and their results, open issues).\n"
        "2. More orchestrator-subagent hops: the orchestrator recalls subagents and re-delegates narrower work "
        "with updated acceptance criteria instead of accepting a single pass.\n"
        "Ground every change in concrete evidence from the workspace and the judge history. Return valid JSON only."
    )


def failure_notice(run_status: Mapping[str, Any]) -> str | None:
    """The FAILURE NOTICE (and prior-failure addenda) for a run that did not finish cleanly, else None.

    A run failed when its exit code is neither 0 nor unknown, or its trace holds no success result.
    """
    exit_code = run_status.get("exit_code")
    failed = exit_code not in (0, None) or run_status.get("trace_has_success_result") is not True
    prior = run_status.get("prior_failures")
    parts: list[str] = []
    if failed:
        parts.append(
            "FAILURE NOTICE: the current run did not finish (it was force-quit or ended without a success result). "
            "Treat this as first-order evidence about the design. The next design must make the run finish: "
            'tighter completion and acceptance criteria in every subagent\'s "Output to orchestrator", '
            "orchestrator progress checks with recovery and re-delegation, and shared rules for detecting and "
            "breaking repeated tool-call loops — while still improving the quality of the work. Do not add "
            "numerical caps (on agents, calls, rounds or time) and do not collapse the team into a single agent."
        )
        if prior:
            parts.append(
                "RECURRENT FAILURE: earlier runs of this task failed as well. Restructure the design materially "
                "instead of adjusting wording."
            )
    elif prior:
        parts.append(
            "RESOLVED FAILURE HISTORY: earlier runs failed but this one finished. Preserve the provisions that "
            "fixed the failure while you improve quality."
        )
    return "\n\n".join(parts) or None


def scoreboard_line(scoreboard: Sequence[tuple[int, str | None]], retained: int | None) -> str:
    """``Record vs no_harness: v0 W★ · v1 L · v2 T · …`` (W win, L loss, T tie, T! invalid judge answer counted as
    a tie, ? not judged; ★ marks the retained champion)."""
    marks = []
    for version, verdict in scoreboard:
        mark = _SCOREBOARD_MARK.get(verdict or "", "?")
        marks.append(f"v{version} {mark}{'★' if version == retained else ''}")
    return "Record vs no_harness: " + " · ".join(marks)


def delta_checklist(rationales: Sequence[str]) -> str:
    """Recurring defect categories across the history rationales, most frequent first, each with an example."""
    rows = []
    for order, (name, pattern) in enumerate(DELTA_BUCKETS):
        matching = [r for r in rationales if pattern.search(r)]
        if not matching:
            continue
        example = next((s for s in sentences(matching[-1]) if pattern.search(s)), collapse(matching[-1], 300))
        rows.append((-len(matching), order, f'- {name}: {len(matching)} verdict(s); e.g. "{collapse(example, 300)}"'))
    if not rows:
        return "(no recurring defect category found in the verdict rationales)"
    return "\n".join(row for _, _, row in sorted(rows))


def _history_block(entry: HistoryEntry, diff_chars: int) -> str:
    lines = [
        f"- comparison: reference (A) vs multi-agent-design-v{entry.version} (B)",
        f"  key: {entry.key}",
        f"  winner: {entry.winner}"
        + (" (invalid judge answer, counted as a tie)" if entry.winner == "invalid" else ""),
        f"  judge model: {entry.judge_model}",
        f"  judged at: {entry.judged_at}",
        f"  repo A: {entry.side_a}",
        f"  repo B: {entry.side_b}",
        f"  rationale: {collapse(entry.rationale, HISTORY_RATIONALE_CHARS)}",
    ]
    found = takeaways(entry.rationale)
    if found:
        lines.append("  actionable takeaways:")
        lines += [f"    * {sentence}" for sentence in found]
    if entry.diff is not None:
        # The reference shortener collapses whitespace, so each diff reads as one line; kept for faithfulness.
        lines.append(f"  design diff v{entry.version - 1} -> v{entry.version}: {collapse(entry.diff, diff_chars)}")
    lines.append("  reminder: preserve the traits that won and fix the defects listed above.")
    return "\n".join(lines)


def history_section(inputs: OptimizerInputs) -> str:
    """Section 3: framing and scoreboard (baseline mode), then one block per verdict."""
    if not inputs.baseline_mode:
        title = "3. Pairwise history summary"
        body = [] if inputs.history else ["(no pairwise comparisons yet)"]
    else:
        title = "3. Pairwise history summary vs the no-harness baseline"
        body = [
            scoreboard_line(inputs.scoreboard, inputs.retained),
            "★ marks the retained champion: the best version that beat the baseline, confirmed by direct "
            "arbitration against earlier winners.",
            "Each entry compares that version's output with a FIXED bare single-agent baseline run of the same "
            "task (A = baseline, B = the version; winner B means the version beat the baseline). The diffs show "
            "what changed between consecutive versions. Trends across versions matter more than a single flip.",
        ]
        if not inputs.history:
            body.append("(no verdicts recorded yet)")
    with_diffs = [e for e in inputs.history if e.diff is not None]
    recent = {e.key for e in with_diffs[-RECENT_DIFFS:]}
    for entry in inputs.history:
        body.append(_history_block(entry, RECENT_DIFF_CHARS if entry.key in recent else OLDER_DIFF_CHARS))
    return "\n".join([title, *body])


def _save_rules() -> str:
    return (
        "# Save rules\n"
        "The prompt's closing rules stay as they are: use uv for every Python workflow (`uv add` for dependencies, "
        "`uv run` for scripts and tests, `uvx` for one-off tools) and keep logs.txt in the workspace root with the "
        "plan, the execution steps and a reflection, documenting every spawned agent, the inter-agent workflow "
        "(an outline or diagram) and which agents actually executed."
    )


def _instructions(inputs: OptimizerInputs) -> str:
    k = inputs.version
    goal = f"Improve the multi-agent design from v{k} to v{k + 1}."
    if inputs.baseline_mode:
        goal += f" The explicit goal is to decisively outperform the no-harness single-agent baseline, not merely v{k}."
    if inputs.best is not None:
        goal += (
            f" Combine the strengths of the previous best design (v{inputs.best.version}) with the genuinely "
            f"useful changes of the current design (v{k})."
        )
    schema = {
        "improved_multi_agent_design": f"{START_MARKER} ... (the full replacement design block)",
        "changes_from_previous": ["..."],
        "why_it_should_improve": ["..."],
        "evidence_used": ["..."],
        "expected_impact": ["..."],
        "verification_checks": ["..."],
    }
    return "\n".join(
        [
            "4. Instructions",
            goal,
            "- Preserve the intent of the task and every required deliverable.",
            '- Strengthen each subagent\'s "Output to orchestrator" contract: exact paths, checks run with their '
            "results, and open issues.",
            "- Increase orchestrator-subagent feedback loops: the orchestrator verifies each report and recalls "
            "earlier subagents on narrower scopes with updated acceptance criteria.",
            "- Prioritise genuine multi-agent advantages (parallel specialists, cross-agent critique, "
            "reconciliation) over changes a single agent could make.",
            "- Be specific and grounded in the evidence and the verdict history above; avoid generic claims.",
            "- Do not change anything outside the design block (task text, deliverables, save rules).",
            "",
            "Output schema (return exactly one JSON object with these keys):",
            json.dumps(schema, indent=2, ensure_ascii=False),
            f'`improved_multi_agent_design` must start with "{START_MARKER}" and contain the complete design '
            "block, not a diff.",
        ]
    )


def optimizer_user_prompt(inputs: OptimizerInputs) -> str:
    """The user message of the optimizer call of step k."""
    k = inputs.version
    sections = [
        "1. Query executed by the coding agent",
        RULE,
        f"# Task\n{inputs.task_text.strip()}",
        f"# Current multi agent design (v{k})\n{inputs.current_design.strip()}",
    ]
    if inputs.best is not None:
        best = inputs.best
        if best.case == "both_win_arbitration":
            why = (
                f"Both v{best.version} and v{k} beat the baseline, but in direct arbitration the judge preferred "
                f"v{best.version}. Arbitration rationale:"
            )
        else:
            why = f"v{best.version} beat the baseline and v{k} did not. Rationale of v{k}'s verdict:"
        sections.append(
            f"# Previous best multi agent design (v{best.version})\n{best.design.strip()}\n\n{why}\n"
            f"{collapse(best.rationale, BEST_RATIONALE_CHARS)}\n\n"
            "Refer to both designs: keep what made the previous best strong and merge only the genuinely useful "
            f"changes of v{k}."
        )
    if inputs.v0_design is not None:
        sections.append(
            f"# Original design (v0)\n{inputs.v0_design.strip()}\n\nv0 is the root of this version track, shown for "
            "orientation. Do not revert to it wholesale."
        )
    sections += [
        _save_rules(),
        RULE,
        f"2. Current submission code repo for multi-agent-design-v{k} (evidence only)\n{inputs.evidence.strip()}",
        "2b. Execution metadata\n```json\n" + json.dumps(dict(inputs.run_status), indent=2, default=str) + "\n```",
    ]
    notice = failure_notice(inputs.run_status)
    if notice:
        sections.append(notice)
    sections += [
        history_section(inputs),
        "3b. Pairwise history delta checklist\n" + delta_checklist([e.rationale for e in inputs.history]),
        _instructions(inputs),
    ]
    return "\n\n".join(sections)
