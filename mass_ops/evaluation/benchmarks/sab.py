"""ScienceAgentBench adapter (MASS_SPEC §10): tasks from a user-provided dataset folder, scoring by the official
evaluator.

Nothing is downloaded. The folder holds the annotation sheet (``ScienceAgentBench.jsonl`` or ``.csv``) and the
official ``benchmark/`` folder; an instance's agent starts with its dataset at ``benchmark/datasets/<name>/`` and
writes ``pred_programs/pred_<gold name>`` and ``pred_results/``. Scoring runs the official harness from a configured
checkout (with Docker); without one the scorer raises `EvaluatorNotInstalledError` instead of inventing a score.
Dataset layout and scoring details: docs/public-benchmarks.md (`mass_ops.evaluation.benchmarks.sab`).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkError,
    BenchmarkTask,
    EvaluatorNotInstalledError,
    TaskScore,
    TrialResult,
    json_lines,
    materialized_workspaces,
    workspace_text,
)
from mass_ops.evaluation.benchmarks.seeds import FolderSeed
from mass_ops.runtime.episode import EpisodeOutcome

SAB = "sab"
SHEET_NAMES = ("ScienceAgentBench.jsonl", "ScienceAgentBench.csv")
REQUIRED_FIELDS = ("instance_id", "task_inst", "gold_program_name", "output_fname")
OPTIONAL_FIELDS = ("domain", "domain_knowledge", "dataset_folder_tree", "dataset_preview", "eval_script_name")
PRED_PROGRAMS = "pred_programs"
PRED_RESULTS = "pred_results"
MISSING_PROGRAM = "ERROR"
EVALUATOR_ENV = "MASS_SAB_EVALUATOR"
HARNESS_MODULE = "evaluation.harness.run_evaluation"
PROGRAM_TIME_LIMIT_S = 900
DATASETS_DIR = "benchmark/datasets"  # where the official setup puts an instance's dataset, in the dataset folder too


@dataclass(frozen=True)
class SABInstance:
    """One row of the annotation sheet."""

    instance_id: int
    task_inst: str
    gold_program_name: str
    output_fname: str
    domain: str = ""
    domain_knowledge: str = ""
    dataset_folder_tree: str = ""
    dataset_preview: str = ""
    eval_script_name: str = ""

    @property
    def name(self) -> str:
        """Episode task id: ``sab_<instance_id>``."""
        return f"sab_{self.instance_id}"

    @property
    def program_path(self) -> str:
        return f"{PRED_PROGRAMS}/pred_{self.gold_program_name}"


def _read_sheet(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    rows = []
    for number, row in json_lines(path):
        if not isinstance(row, dict):
            raise BenchmarkError(f"{path}:{number}: a row must be a JSON object")
        rows.append(row)
    return rows


def load_sab_instances(root: str | Path) -> list[SABInstance]:
    """The instances of the annotation sheet in `root`, sorted by instance id."""
    folder = Path(root)
    sheet = next((folder / name for name in SHEET_NAMES if (folder / name).is_file()), None)
    if sheet is None:
        raise BenchmarkError(
            f"ScienceAgentBench: {folder} holds neither {' nor '.join(SHEET_NAMES)}; put the official annotation "
            "sheet there (nothing is downloaded)"
        )
    instances = []
    for number, row in enumerate(_read_sheet(sheet), start=1):
        missing = [name for name in REQUIRED_FIELDS if not str(row.get(name) or "").strip()]
        if missing:
            raise BenchmarkError(f"{sheet}: row {number} lacks {missing}")
        try:
            instance_id = int(row["instance_id"])
        except (TypeError, ValueError):
            raise BenchmarkError(
                f"{sheet}: row {number}: instance_id {row['instance_id']!r} is not an integer"
            ) from None
        gold = str(row["gold_program_name"]).strip()
        if "/" in gold or gold.startswith("."):
            raise BenchmarkError(f"{sheet}: row {number}: gold_program_name {gold!r} must be a plain file name")
        instances.append(
            SABInstance(
                instance_id=instance_id,
                task_inst=str(row["task_inst"]).strip(),
                gold_program_name=gold,
                output_fname=str(row["output_fname"]).strip(),
                **{name: str(row.get(name) or "").strip() for name in OPTIONAL_FIELDS},
            )
        )
    ids = [i.instance_id for i in instances]
    if len(set(ids)) != len(ids):
        raise BenchmarkError(f"{sheet}: instance ids repeat")
    if not instances:
        raise BenchmarkError(f"{sheet}: no instances")
    return sorted(instances, key=lambda i: i.instance_id)


def sab_instruction(instance: SABInstance, *, use_knowledge: bool = False) -> str:
    """The agent's prompt for one instance (official-style: write, run and fix one program)."""
    parts = [instance.task_inst]
    if use_knowledge and instance.domain_knowledge:
        parts.append(f"Domain knowledge:\n{instance.domain_knowledge}")
    if instance.dataset_folder_tree:
        parts.append(f"Dataset folder structure:\n```\n{instance.dataset_folder_tree}\n```")
    if instance.dataset_preview:
        parts.append(f"Dataset preview:\n{instance.dataset_preview}")
    parts.append(
        "Write one self-contained Python program that solves the task and save it as "
        f"`{instance.program_path}` in your working directory. The program must write its outputs to "
        f"`{PRED_RESULTS}/` (the expected output is `{instance.output_fname}`). Run the program yourself and fix it "
        "until it finishes without errors. Do not start background processes; stop when the program and its "
        "outputs are in place."
    )
    return "\n\n".join(parts)


def dataset_name(instance: SABInstance) -> str | None:
    """The instance's dataset folder: the first line of its ``dataset_folder_tree`` (``|-- clintox/``)."""
    lines = instance.dataset_folder_tree.strip().splitlines()
    name = lines[0].strip().lstrip("|").lstrip("-").strip().rstrip("/") if lines else ""
    return name if name and "/" not in name and name not in (".", "..") else None


def sab_seed(instance: SABInstance, dataset_root: Path) -> FolderSeed | None:
    """The instance's dataset as the official setup gives it: ``benchmark/datasets/<name>/`` in the workspace."""
    name = dataset_name(instance)
    if name is None:
        return None
    folder = dataset_root / DATASETS_DIR / name
    return FolderSeed(folder, f"{DATASETS_DIR}/{name}", f"ScienceAgentBench instance {instance.instance_id} dataset")


def sab_tasks(
    instances: Sequence[SABInstance], *, use_knowledge: bool = False, dataset_root: str | Path | None = None
) -> list[BenchmarkTask]:
    """Benchmark tasks in instance order; the task index of the seed formula is the position (sab_1 → 0). With
    `dataset_root` (the folder holding ``benchmark/``) each starts with its dataset in its workspace."""
    root = None if dataset_root is None else Path(dataset_root)
    return [
        BenchmarkTask(
            SAB,
            instance.name,
            index,
            sab_instruction(instance, use_knowledge=use_knowledge),
            seed=None if root is None else sab_seed(instance, root),
        )
        for index, instance in enumerate(instances)
    ]


def collect_predictions(
    instances: Sequence[SABInstance], workspaces: Mapping[str, Path | None], dest: Path
) -> dict[str, bool]:
    """Copy each instance's program into `dest` as ``pred_<gold name>`` (missing or empty → ``ERROR``), with
    ``/workspace`` paths rewritten to ``.``; returns which instances had a program."""
    dest.mkdir(parents=True, exist_ok=True)
    found = {}
    for instance in instances:
        root = workspaces.get(instance.name)
        program = root / instance.program_path if root is not None else None
        text = workspace_text(program)
        found[instance.name] = bool(text.strip())
        content = text.replace("/workspace", ".") if text.strip() else MISSING_PROGRAM
        (dest / f"pred_{instance.gold_program_name}").write_text(content, encoding="utf-8")
    return found


@dataclass(frozen=True)
class SABEvaluator:
    """The official evaluation harness: a checkout of the ScienceAgentBench repository and the Python that runs it."""

    repo: Path
    python: str = sys.executable
    max_workers: int = 4
    timeout_s: float = 6 * 3600
    extra_args: tuple[str, ...] = ("--cache_level", "base")

    @classmethod
    def locate(cls, repo: str | Path | None = None, **options: Any) -> SABEvaluator:
        """The harness at `repo` (default: ``$MASS_SAB_EVALUATOR``); EvaluatorNotInstalledError when absent."""
        where = repo if repo is not None else os.environ.get(EVALUATOR_ENV)
        if not where:
            raise EvaluatorNotInstalledError(
                "ScienceAgentBench evaluator not installed: set MASS_SAB_EVALUATOR to a checkout of the official "
                "ScienceAgentBench repository (it needs Docker); no score was computed"
            )
        root = Path(where).expanduser().resolve()
        harness = root / Path(*HARNESS_MODULE.split(".")).with_suffix(".py")
        if not harness.is_file():
            raise EvaluatorNotInstalledError(
                f"ScienceAgentBench evaluator not installed: {harness} does not exist; no score was computed"
            )
        return cls(repo=root, **options)

    def command(self, benchmark_path: Path, pred_dir: Path, log_path: Path, run_id: str) -> list[str]:
        """The harness command line; every path absolute (the harness changes directories)."""
        return [
            self.python,
            "-m",
            HARNESS_MODULE,
            "--benchmark_path",
            str(benchmark_path.resolve()),
            "--pred_program_path",
            str(pred_dir.resolve()),
            "--log_fname",
            str(log_path.resolve()),
            "--run_id",
            run_id,
            "--max_workers",
            str(self.max_workers),
            *self.extra_args,
        ]

    def evaluate(self, benchmark_path: Path, pred_dir: Path, log_path: Path, run_id: str) -> list[dict[str, Any]]:
        """Run the harness and return its log rows."""
        if not benchmark_path.is_dir():
            raise BenchmarkError(f"ScienceAgentBench: {benchmark_path} (the official benchmark/ folder) is missing")
        result = subprocess.run(
            self.command(benchmark_path, pred_dir, log_path, run_id),
            cwd=self.repo,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
        )
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise BenchmarkError(f"ScienceAgentBench evaluator exited with {result.returncode}: {' | '.join(tail)}")
        if not log_path.is_file():
            raise BenchmarkError(f"ScienceAgentBench evaluator wrote no log at {log_path}")
        return [row for _number, row in json_lines(log_path)]


def _number(row: Mapping[str, Any], name: str, where: str) -> float:
    value = row.get(name)
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise BenchmarkError(f"{where}: {name} is {value!r}, not a number")
    return float(value)


def score_sab_trial(
    ctx: CycleContext,
    instances: Sequence[SABInstance],
    outcomes: Sequence[EpisodeOutcome],
    dataset_root: str | Path,
    *,
    generation: str,
    trial: int,
    evaluator: SABEvaluator | None = None,
) -> TrialResult:
    """Score one trial with the official evaluator: per task success (0/1), plus SR, VER and CBS means."""
    harness = evaluator or SABEvaluator.locate()
    by_task = {str(o.request.unit.task_id): o for o in outcomes}
    missing = [i.name for i in instances if i.name not in by_task]
    if missing:
        raise BenchmarkError(f"ScienceAgentBench trial {trial}: no episode for {missing}")
    with (
        materialized_workspaces(ctx, [by_task[i.name] for i in instances]) as roots,
        tempfile.TemporaryDirectory(prefix="mass-sab-eval-") as scratch,
    ):
        pred_dir = Path(scratch) / PRED_PROGRAMS
        found = collect_predictions(instances, roots, pred_dir)
        run_id = f"{ctx.cycle_name}-{generation}-t{trial}"
        rows = harness.evaluate(Path(dataset_root) / "benchmark", pred_dir, Path(scratch) / "eval_log.jsonl", run_id)
    if len(rows) != len(instances):
        raise BenchmarkError(
            f"ScienceAgentBench trial {trial}: the evaluator logged {len(rows)} rows for {len(instances)} tasks"
        )
    scores = []
    for instance, row in zip(instances, rows, strict=True):
        where = f"evaluator row of {instance.name}"
        scores.append(
            TaskScore(
                task=instance.name,
                score=_number(row, "success_rate", where),
                episode_id=by_task[instance.name].episode_id,
                details={
                    "valid_program": _number(row, "valid_program", where),
                    "codebert_score": _number(row, "codebert_score", where),
                    "program_found": found[instance.name],
                },
            )
        )
    n = len(scores)
    metrics = {
        "SR": sum(float(s.score or 0.0) for s in scores) / n,
        "VER": sum(s.details["valid_program"] for s in scores) / n,
        "CBS": sum(s.details["codebert_score"] for s in scores) / n,
        "programs_found": sum(found.values()),
    }
    return TrialResult(SAB, generation, trial, tuple(scores), metrics)
