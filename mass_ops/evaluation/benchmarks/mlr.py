"""MLR-Bench adapter, the reference's 12-task subset (MASS_SPEC §10): tasks and the official overall rubric from a
user-provided mlrbench folder, scoring by two external rubric judges.

Nothing is downloaded. The folder holds one task description per task (``tasks/<name>.md``) and the official review
module ``evals/overall_review.py`` whose ``OVERALL_RUBRIC`` string is the rubric (read with `ast`, never executed);
``overall_rubric.md`` at the top of the folder may stand in for it.

Each task's paper is ``results/paper.md`` in the agent's workspace. A missing paper or one under 200 bytes scores 0
on every criterion without a judge call. Otherwise every judge (two are required) reviews the paper and the code
(``code/`` files up to 20,000 characters each, 60,000 in total; the paper up to 120,000) and returns Clarity,
Novelty, Soundness, Significance, Overall and Confidence; an unusable answer is retried up to 3 attempts. Reviews
are cached in the call ledger, so a rerun never asks a judge twice. A task's score is the mean of the judges'
Overall; a task lacking a judge's review has no score, and summarizing such a trial is an error.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.errors import BenchmarkError
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkTask,
    TaskScore,
    TrialResult,
    TrialSummary,
    materialized_workspaces,
    summarize_trials,
    workspace_text,
)
from mass_ops.evaluation.external import ReportJudge
from mass_ops.llm import LLMOutputError, SamplingParams
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.runtime.episode import EpisodeOutcome

MLR = "mlr"
MLR_SUBSET = (
    "iclr2023_dg",
    "iclr2024_dmlr",
    "iclr2024_gem",
    "iclr2025_financial_ai",
    "icml2023_frontiers4lcd",
    "icml2024_ai4science",
    "neurips2023_dlde",
    "neurips2023_gcrl",
    "neurips2023_heavytails",
    "neurips2023_tgl",
    "neurips2024_ai4mat",
    "neurips2024_opt",
)
PAPER_PATH = "results/paper.md"
CODE_DIR = "code"
MIN_PAPER_BYTES = 200
PAPER_MAX_CHARS = 120_000
CODE_FILE_MAX_CHARS = 20_000
CODE_TOTAL_MAX_CHARS = 60_000
CODE_SUFFIXES = frozenset({".py", ".md", ".txt", ".sh", ".yaml", ".yml", ".json", ".toml", ".cfg", ".ipynb"})
CRITERIA = ("Clarity", "Novelty", "Soundness", "Significance", "Overall", "Confidence")
JUDGES_REQUIRED = 2
REVIEW_ATTEMPTS = 3
REVIEW_MAX_TOKENS = 16_000
RUBRIC_MODULE = "evals/overall_review.py"
RUBRIC_FILE = "overall_rubric.md"


@dataclass(frozen=True)
class MLRTask:
    name: str
    description: str


def load_mlr_tasks(root: str | Path, names: Sequence[str] = MLR_SUBSET) -> list[MLRTask]:
    """The task descriptions ``tasks/<name>.md`` of `names` (default: the 12-task subset), sorted by name."""
    folder = Path(root) / "tasks"
    if len(set(names)) != len(names) or not names:
        raise BenchmarkError("MLR-Bench: task names must be a non-empty list without repeats")
    missing = [name for name in names if not (folder / f"{name}.md").is_file()]
    if missing:
        raise BenchmarkError(f"MLR-Bench: {folder} lacks task descriptions for {missing} (nothing is downloaded)")
    tasks = []
    for name in sorted(names):
        text = (folder / f"{name}.md").read_text(encoding="utf-8").strip()
        if not text:
            raise BenchmarkError(f"MLR-Bench: {folder / f'{name}.md'} is empty")
        tasks.append(MLRTask(name, text))
    return tasks


def load_overall_rubric(root: str | Path) -> str:
    """The official OVERALL_RUBRIC string of ``evals/overall_review.py`` (parsed, not run), else
    ``overall_rubric.md``."""
    folder = Path(root)
    module = folder / RUBRIC_MODULE
    if module.is_file():
        try:
            tree = ast.parse(module.read_text(encoding="utf-8"), filename=str(module))
        except SyntaxError as exc:
            raise BenchmarkError(f"MLR-Bench: {module} does not parse ({exc.msg})") from None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            if any(isinstance(t, ast.Name) and t.id == "OVERALL_RUBRIC" for t in node.targets):
                value = node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.strip():
                    return value.value.strip()
                raise BenchmarkError(f"MLR-Bench: OVERALL_RUBRIC in {module} is not a plain string")
        raise BenchmarkError(f"MLR-Bench: {module} defines no OVERALL_RUBRIC")
    fallback = folder / RUBRIC_FILE
    if fallback.is_file() and fallback.read_text(encoding="utf-8").strip():
        return fallback.read_text(encoding="utf-8").strip()
    raise BenchmarkError(f"MLR-Bench: no rubric in {folder} (expected {RUBRIC_MODULE} or {RUBRIC_FILE})")


def mlr_instruction(task: MLRTask) -> str:
    """The agent's prompt: a CPU-only, end-to-end mini research project within two hours."""
    return (
        f"{task.description}\n\n"
        "Carry out a small but complete research project on this topic in your working directory, on CPU only, "
        "within two hours:\n"
        "1. idea.md — the research idea and why it matters.\n"
        "2. proposal.md — the plan: method, data, baselines, metrics.\n"
        "3. code/ — the experiment code with a README.md explaining how to run it.\n"
        "4. results/ — the run log, the figures, results.md with the numbers, and results/paper.md: a paper with "
        "the sections Title, Abstract, Introduction, Related Work, Methodology, Experiment Setup, Experiment "
        "Results, Analysis and Conclusion.\n"
        "Run every experiment you report. Never invent or fake results: report what the code produced, including "
        "failures and limitations."
    )


def mlr_tasks(tasks: Sequence[MLRTask]) -> list[BenchmarkTask]:
    """Benchmark tasks in sorted-name order; the seed's task index is the position."""
    return [BenchmarkTask(MLR, task.name, index, mlr_instruction(task)) for index, task in enumerate(tasks)]


def _cap_bytes(limit: int) -> int:
    """Bytes read of a submission file capped at `limit` characters: one more character's worth in UTF-8's widest
    encoding, so the cap still sees that the file is longer (the omitted count then counts only what was read)."""
    return 4 * (limit + 1)


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} characters omitted ...]"


def read_submission(root: Path | None) -> tuple[str | None, str]:
    """(paper text, or None when missing / under 200 bytes; code excerpt) of a workspace."""
    if root is None:
        return None, ""
    paper_path = root / PAPER_PATH
    paper = None
    if paper_path.is_file() and paper_path.stat().st_size >= MIN_PAPER_BYTES:
        paper = _cap(workspace_text(paper_path, max_bytes=_cap_bytes(PAPER_MAX_CHARS)), PAPER_MAX_CHARS)
    code_root = root / CODE_DIR
    parts: list[str] = []
    used = 0
    omitted: list[str] = []
    if code_root.is_dir():
        files = sorted(p for p in code_root.rglob("*") if p.is_file() and p.suffix.lower() in CODE_SUFFIXES)
        for path in files:
            relative = path.relative_to(root).as_posix()
            text = _cap(workspace_text(path, max_bytes=_cap_bytes(CODE_FILE_MAX_CHARS)), CODE_FILE_MAX_CHARS)
            if used + len(text) > CODE_TOTAL_MAX_CHARS:
                omitted.append(relative)
                continue
            used += len(text)
            parts.append(f"### {relative}\n```\n{text}\n```")
    if omitted:
        parts.append(f"(omitted, code budget of {CODE_TOTAL_MAX_CHARS} characters reached: {', '.join(omitted)})")
    return paper, "\n\n".join(parts) or "(no code files)"


REVIEW_SYSTEM = (
    "You are an experienced area chair of a machine-learning venue reviewing an automatically produced research "
    "paper together with its code. Apply the rubric strictly, reward only claims the paper and code support, and "
    "answer with one JSON object and nothing else."
)


def review_prompt(rubric: str, task: MLRTask, paper: str, code: str) -> str:
    """The rubric judge's user message."""
    keys = ", ".join(f'"{name}": <integer 1-10>' for name in CRITERIA[:-1])
    return "\n\n".join(
        [
            f"# Rubric\n{rubric}",
            f"# Task description\n{task.description}",
            f"# Paper (results/paper.md)\n{paper}",
            f"# Code\n{code}",
            "# Output\nReturn exactly one JSON object: {" + keys + ', "Confidence": <integer 1-5>, '
            '"justification": "<short reasons>"}',
        ]
    )


def parse_review(answer: Any) -> dict[str, float]:
    """The six criteria of a review as numbers; ValueError naming what is wrong."""
    if not isinstance(answer, dict):
        raise ValueError(f"review must be a JSON object, got {type(answer).__name__}")
    scores = {}
    for name in CRITERIA:
        value = answer.get(name)
        if isinstance(value, dict):  # some judges nest {"score": n, "justification": …}
            value = value.get("score")
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                value = None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"review: {name} is {answer.get(name)!r}, not a number")
        limit = 5 if name == "Confidence" else 10
        if not 0 <= value <= limit:
            raise ValueError(f"review: {name} = {value} is outside 0-{limit}")
        scores[name] = float(value)
    return scores


def review_unit(generation: str, trial: int, task: str, judge: str) -> CallUnit:
    return CallUnit(f"eval/mlr/{generation}/t{trial}/{task}/{judge}", "external_judge", None)


def request_review(judge: ReportJudge, ledger: CallLedger, unit: CallUnit, user: str) -> dict[str, float] | None:
    """A judge's review from the ledger, else from up to 3 attempts with usable answers; None when all were
    unusable. Infrastructure failures raise (a rerun resumes)."""
    stored = ledger.finished(unit)
    if stored is not None:
        return parse_review(stored.parsed)
    ledger.bind(judge.client)
    while len(ledger.invalid_attempts(unit)) < REVIEW_ATTEMPTS:
        review = None
        try:
            with ledger.attempt(unit) as attempt:
                result = judge.client.chat(
                    REVIEW_SYSTEM,
                    user,
                    purpose=unit.purpose,
                    sampling=SamplingParams(max_tokens=REVIEW_MAX_TOKENS),
                    json_mode="json_object",
                )
                try:
                    review = parse_review(result.parsed_json)
                except ValueError as exc:
                    attempt.mark_invalid(str(exc))
                else:
                    attempt.parsed = result.parsed_json
        except LLMOutputError:
            continue
        if review is not None:
            return review
    return None


def score_mlr_trial(
    ctx: CycleContext,
    tasks: Sequence[MLRTask],
    outcomes: Sequence[EpisodeOutcome],
    judges: Sequence[ReportJudge],
    rubric: str,
    *,
    generation: str,
    trial: int,
) -> TrialResult:
    """Score one trial: per task the mean of the judges' Overall (0 without a paper); metrics: mean Overall,
    papers delivered."""
    if len(judges) < JUDGES_REQUIRED:
        raise BenchmarkError(
            f"MLR-Bench scoring needs {JUDGES_REQUIRED} judges, got {len(judges)}: configure evaluation.judges"
        )
    if len({j.name for j in judges}) != len(judges):
        raise BenchmarkError("MLR-Bench scoring: judge names must differ")
    by_task = {str(o.request.unit.task_id): o for o in outcomes}
    missing = [t.name for t in tasks if t.name not in by_task]
    if missing:
        raise BenchmarkError(f"MLR-Bench trial {trial}: no episode for {missing}")
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    scores = []
    with materialized_workspaces(ctx, [by_task[t.name] for t in tasks]) as roots:
        submissions = {t.name: read_submission(roots.get(t.name)) for t in tasks}
    for task in tasks:
        paper, code = submissions[task.name]
        episode_id = by_task[task.name].episode_id
        if paper is None:
            zero = dict.fromkeys(CRITERIA, 0.0)
            details: dict[str, Any] = {"paper": False, "reviews": {j.name: zero for j in judges}}
            scores.append(TaskScore(task.name, 0.0, episode_id, details))
            continue
        user = review_prompt(rubric, task, paper, code)
        reviews: Mapping[str, dict[str, float] | None] = {
            judge.name: request_review(judge, ledger, review_unit(generation, trial, task.name, judge.name), user)
            for judge in judges
        }
        absent = sorted(name for name, review in reviews.items() if review is None)
        score = None if absent else sum(r["Overall"] for r in reviews.values() if r) / len(judges)
        details = {"paper": True, "reviews": dict(reviews), "missing_judges": absent}
        scores.append(TaskScore(task.name, score, episode_id, details))
    overall = [s.score for s in scores if s.score is not None]
    metrics = {
        "mean_overall": sum(overall) / len(scores) if len(overall) == len(scores) else None,
        "papers_delivered": sum(1 for s in scores if s.details.get("paper")),
        "tasks": len(scores),
        "judges": [j.name for j in judges],
    }
    return TrialResult(MLR, generation, trial, tuple(scores), metrics)


def summarize_mlr(results: Sequence[TrialResult]) -> TrialSummary:
    """Mean ± sample SD of the trial means; every task with a paper needs a review from both judges."""
    for result in results:
        if result.benchmark != MLR:
            raise BenchmarkError(f"summarize_mlr: trial {result.trial} is a {result.benchmark} result")
        for score in result.scores:
            if not score.details.get("paper"):
                continue
            reviews = score.details.get("reviews") or {}
            present = [name for name, review in reviews.items() if review]
            if len(present) < JUDGES_REQUIRED or score.score is None:
                raise BenchmarkError(
                    f"MLR-Bench trial {result.trial} of {result.generation}: task {score.task} is missing a judge "
                    f"(reviews from {present or 'none'}; {JUDGES_REQUIRED} required)"
                )
    return summarize_trials(results)
