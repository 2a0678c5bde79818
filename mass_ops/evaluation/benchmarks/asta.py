"""AstaBench E2E-Bench-Hard adapter: tasks from a user-provided export of the task set, graded by AstaBench's own
scorer (an inspect-ai task) in a container from an image where `astabench` is installed.

Nothing is downloaded. The folder holds ``e2e_bench_hard.jsonl``: inspect-ai samples, one per line (``id``,
``input`` — the research task the agent receives). Each sample is one task ``asta_<id>`` in file order.

`astabench` and `inspect-ai` would change packages this project pins, so they live in the grader image, not here:
the grader job unpacks the agent's workspace into ``/submission`` and runs `score_command` (the user's wrapper
around ``inspect eval`` for that sample, e.g. with a solver that replays the submission), which prints an inspect-ai
JSON eval log between the result markers. `score_from_inspect_log` reads that log's format: the sample's
``scores`` (one scorer's ``value``), ``status`` and the evaluator's version from ``eval.packages``.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END, GraderJob, result_section
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkError,
    BenchmarkTask,
    json_lines,
    load_json,
)
from mass_ops.evaluation.benchmarks.tb2 import _tar

ASTA = "asta"
TASK_FILE = "e2e_bench_hard.jsonl"
SUBMISSION_TAR = "/tmp/mass_submission.tar"
GRADER_TIMEOUT_S = 3600.0


def load_asta_samples(root: str | Path) -> list[dict[str, Any]]:
    path = Path(root) / TASK_FILE
    if not path.is_file():
        raise BenchmarkError(f"AstaBench E2E-Bench-Hard: {path} is missing; export the task set there")
    samples = []
    for number, row in json_lines(path):
        if not isinstance(row, dict) or not row.get("id") or not isinstance(row.get("input"), str):
            raise BenchmarkError(f"{path}:{number}: a sample needs an id and a text input")
        samples.append(row)
    if not samples:
        raise BenchmarkError(f"{path}: no samples")
    return samples


def score_from_inspect_log(document: dict[str, Any], sample_id: str, scorer: str | None = None) -> tuple[float, str]:
    """(score, evaluator version) of `sample_id` in an inspect-ai JSON eval log."""
    where = f"AstaBench log for sample {sample_id}"
    if document.get("status") != "success":
        raise BenchmarkError(f"{where}: the evaluation status is {document.get('status')!r}, not 'success'")
    packages = (document.get("eval") or {}).get("packages") or {}
    version = ", ".join(f"{name} {packages[name]}" for name in sorted(packages)) or "unknown"
    sample = next((s for s in document.get("samples") or [] if str(s.get("id")) == sample_id), None)
    if sample is None:
        raise BenchmarkError(f"{where}: the log has no such sample")
    scores = sample.get("scores") or {}
    if not scores:
        raise BenchmarkError(f"{where}: the sample has no score")
    name = scorer or sorted(scores)[0]
    value = (scores.get(name) or {}).get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BenchmarkError(f"{where}: scorer {name!r} value {value!r} is not a finite number")
    return float(value), version


@dataclass(frozen=True)
class AstaE2EHard:
    root: Path
    image: str
    score_command: str
    scorer: str | None = None
    name: str = ASTA
    needs_container: bool = True

    def tasks(self) -> list[BenchmarkTask]:
        return [
            BenchmarkTask(ASTA, f"asta_{s['id']}", i, s["input"]) for i, s in enumerate(load_asta_samples(self.root))
        ]

    def evaluator(self) -> str:
        return f"astabench scorer in {self.image}"

    def grader_job(self, sample_id: str, workspace: Path | None) -> GraderJob:
        script = "\n".join(
            [
                f"mkdir -p /submission && tar -xf {SUBMISSION_TAR} -C /submission",
                f"{self.score_command} --sample-id {shlex.quote(sample_id)} --submission /submission"
                " > /tmp/mass_log.json",
                f"echo '{RESULT_BEGIN}'",
                "cat /tmp/mass_log.json",
                f"echo '{RESULT_END}'",
            ]
        )
        return GraderJob(ASTA, sample_id, self.image, script, {SUBMISSION_TAR: _tar(workspace)}, GRADER_TIMEOUT_S)

    def grade(self, task: BenchmarkTask, workspace: Path | None, runner: Any) -> tuple[float, dict[str, Any]]:
        sample_id = task.name.removeprefix("asta_")
        text = result_section(runner.run(self.grader_job(sample_id, workspace)), f"AstaBench sample {sample_id}")
        document = load_json(text, f"AstaBench sample {sample_id}: the grader's eval log")
        score, version = score_from_inspect_log(document, sample_id, self.scorer)
        return score, {"evaluator": version}
