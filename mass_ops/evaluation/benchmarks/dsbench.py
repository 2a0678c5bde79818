"""DSBench adapter (data-analysis tasks): questions and answers from a user-provided copy of the dataset, graded
in this process.

Nothing is downloaded. The folder holds DSBench's ``data.json`` (one JSON object per line: ``id``, ``questions`` —
question file names — and ``answers``, in the same order) and ``data/<id>/`` with each question's text
(``<question>.txt``) and the task's data files. Every question is one task, named ``ds_<id>_<question>``, indexed in
file order (ds is benchmark index 2). The agent starts with the task's data files (every file of ``data/<id>/`` but
the question texts, the ones its prompt names) in its workspace (`ds_seed`) and writes its final answer to
``answer.txt`` there.

DSBench has no package on the index; its reference scorer asks an LLM whether the answer matches. This grader is
deterministic instead — the answer matches when, after trimming case, whitespace and a trailing period, the strings
are equal, or both read as numbers within a relative 1e-2 (``EVALUATOR`` says so with every result).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.evaluation.benchmarks.scoring import BenchmarkError, BenchmarkTask, json_lines, workspace_text
from mass_ops.evaluation.benchmarks.seeds import FileSeed

DS = "ds"
DATA_FILE = "data.json"
ANSWER_FILE = "answer.txt"
EVALUATOR = "mass-ops dsbench exact-or-numeric match (rel 1e-2); DSBench's LLM answer check not reproduced"
REL_TOLERANCE = 1e-2
_NUMBER = re.compile(r"^[-+]?[$€£]?\d[\d,]*(\.\d+)?%?$|^[-+]?\.\d+%?$")


@dataclass(frozen=True)
class DSQuestion:
    task_id: str
    question: str
    text: str
    answer: str
    data_dir: Path

    @property
    def name(self) -> str:
        return f"ds_{self.task_id}_{self.question}"


def load_ds_questions(root: str | Path) -> list[DSQuestion]:
    folder = Path(root)
    path = folder / DATA_FILE
    if not path.is_file():
        raise BenchmarkError(f"DSBench: {path} is missing; put the dataset there (nothing is downloaded)")
    questions = []
    for number, row in json_lines(path):
        if not isinstance(row, dict):
            raise BenchmarkError(f"{path}:{number}: a row must be a JSON object")
        names, answers = row.get("questions"), row.get("answers")
        if not isinstance(names, list) or not isinstance(answers, list) or len(names) != len(answers):
            raise BenchmarkError(f"{path}:{number}: questions and answers must be lists of the same length")
        data_dir = folder / "data" / str(row.get("id"))
        for name, answer in zip(names, answers, strict=True):
            text_path = data_dir / f"{name}.txt"
            if not text_path.is_file():
                raise BenchmarkError(f"DSBench: question text {text_path} is missing")
            questions.append(DSQuestion(str(row["id"]), str(name), text_path.read_text("utf-8"), str(answer), data_dir))
    if not questions:
        raise BenchmarkError(f"{path}: no questions")
    return questions


def data_files(question: DSQuestion) -> list[Path]:
    """The task's data files: every file of its folder but the question texts."""
    return sorted(p for p in question.data_dir.iterdir() if p.is_file() and p.suffix != ".txt")


def ds_seed(question: DSQuestion) -> FileSeed | None:
    """The data files the prompt names, at the workspace's top (None when the task has none)."""
    files = tuple((path.name, path) for path in data_files(question))
    return FileSeed(files, f"DSBench task {question.task_id} data") if files else None


def ds_instruction(question: DSQuestion) -> str:
    files = [p.name for p in data_files(question)]
    return (
        f"{question.text.strip()}\n\nThe data files for this question are: {', '.join(files) or 'none'} "
        f"(from DSBench task {question.task_id}), in your working directory. Analyse them and write only your final "
        f"answer to `{ANSWER_FILE}` there."
    )


def _as_number(text: str) -> float | None:
    cleaned = text.strip().rstrip(".")
    if not _NUMBER.match(cleaned):
        return None
    percent = cleaned.endswith("%")
    value = float(re.sub(r"[,$€£%]", "", cleaned))
    return value / 100 if percent else value


def answers_match(given: str, expected: str) -> bool:
    """Deterministic answer check (see the module docstring)."""
    a, b = (" ".join(s.strip().rstrip(".").lower().split()) for s in (given, expected))
    if a == b and a:
        return True
    x, y = _as_number(a), _as_number(b)
    if x is None or y is None:
        return False
    return math.isclose(x, y, rel_tol=REL_TOLERANCE, abs_tol=1e-9)


@dataclass(frozen=True)
class DSBench:
    root: Path
    name: str = DS
    needs_container: bool = False

    def tasks(self) -> list[BenchmarkTask]:
        return [
            BenchmarkTask(DS, q.name, i, ds_instruction(q), seed=ds_seed(q))
            for i, q in enumerate(load_ds_questions(self.root))
        ]

    def evaluator(self) -> str:
        return EVALUATOR

    def grade(self, task: BenchmarkTask, workspace: Path | None, runner: Any) -> tuple[float, dict[str, Any]]:
        question = next(q for q in load_ds_questions(self.root) if q.name == task.name)
        answer_path = workspace / ANSWER_FILE if workspace is not None else None
        given = workspace_text(answer_path)
        matched = bool(given.strip()) and answers_match(given, question.answer)
        return (1.0 if matched else 0.0), {"answer": given.strip()[:500], "evaluator": EVALUATOR}
