"""Benchmark hooks shared by the adapters: tasks, requests, trials, scores and their summary (MASS_SPEC §10).

A benchmark trial runs every task of the benchmark once with one generation; its episodes are kind ``benchmark``
with seed `benchmark_seed(benchmark, trial, task_index)` — shared across generations for paired comparison — and
condition ``<benchmark>_<generation>_t<trial>``. An adapter turns the trial's workspaces into per-task scores; the
trial's result is an ``evaluations`` row (kind ``benchmark``), and a benchmark's figure over trials is the mean and
the sample standard deviation of the per-trial means.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.errors import BenchmarkError as BenchmarkError
from mass_ops.evaluation.benchmarks.errors import EvaluatorNotInstalledError as EvaluatorNotInstalledError
from mass_ops.evaluation.benchmarks.seeds import SeedSource, check_seeds, store_seed
from mass_ops.evaluation.efficiency import ScoredEpisode
from mass_ops.judge.workspaces import StoredWorkspace
from mass_ops.layout import EpisodeUnit, report_prefix
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest
from mass_ops.seeds import BENCHMARK_INDEX, benchmark_seed
from mass_ops.store.artifacts import UnsafeArchiveError
from mass_ops.store.untrusted import JSON_MAX_BYTES, UntrustedInputError, loads_untrusted, read_capped

logger = logging.getLogger(__name__)

BENCHMARK_KIND = "benchmark"


# The most of one workspace file a grader reads (an answer, a program, a patch, a paper): what the agent wrote is
# read within a bound whatever its size; a real submission is far smaller, a larger one is graded on its head.
SUBMISSION_MAX_BYTES = 8 << 20
# One line of a benchmark's JSON-lines data or of an evaluator's log.
JSON_LINE_MAX_BYTES = 16 << 20


def workspace_text(path: Path | None, *, max_bytes: int = SUBMISSION_MAX_BYTES) -> str:
    """The first `max_bytes` bytes of a file the agent left in its workspace, as text (bad UTF-8 replaced); "" when
    it is absent or not a regular file. Only that much is read, whatever the file's size."""
    read = read_capped(path, head=max_bytes) if path is not None else None
    return read.head.decode("utf-8", errors="replace") if read is not None else ""


def load_json(text: str | bytes, where: str, *, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """One JSON document of benchmark data, a grader's output or a verifier's file (`store.untrusted` rules: size,
    depth, encoding); BenchmarkError naming `where` when it breaks them."""
    try:
        return loads_untrusted(text, what=where, max_bytes=max_bytes)
    except UntrustedInputError as exc:
        raise BenchmarkError(str(exc)) from None


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON-lines file; BenchmarkError ``<path>:<line>: …`` for
    the first line that is not JSON within the rules (a deeply nested line included)."""
    with path.open("rb") as lines:
        number = 0
        while line := lines.readline(JSON_LINE_MAX_BYTES + 1):  # a line is never read past its cap
            number += 1
            if len(line) > JSON_LINE_MAX_BYTES:
                raise BenchmarkError(f"{path}:{number}: a line over the {JSON_LINE_MAX_BYTES:,}-byte limit")
            if line.strip():
                yield number, load_json(line, f"{path}:{number}", max_bytes=JSON_LINE_MAX_BYTES)


@dataclass(frozen=True)
class BenchmarkTask:
    """One task of a benchmark: its episode task id (`name`), its index in the seed formula and the prompt."""

    benchmark: str
    name: str
    index: int
    instruction: str
    # The benchmark's official agent time limit for this task, when it sets one (Terminal-Bench's task.toml).
    time_limit_s: float | None = None
    # What the benchmark puts in the agent's workspace before it starts (None: nothing); see `benchmarks.seeds`.
    seed: SeedSource | None = None


def task_seed(benchmark: str, trial: int, task_index: int) -> int:
    """The episode seed of a benchmark task (`seeds.benchmark_seed`); BenchmarkError for a benchmark without a seed
    index."""
    if benchmark not in BENCHMARK_INDEX:
        raise BenchmarkError(f"benchmark {benchmark!r} has no seed index (known: {sorted(BENCHMARK_INDEX)})")
    return benchmark_seed(benchmark, trial, task_index)


def benchmark_condition(benchmark: str, generation: str, trial: int) -> str:
    return f"{benchmark}_{generation}_t{trial}"


def benchmark_requests(
    ctx: CycleContext, tasks: Sequence[BenchmarkTask], generation: str, trial: int, *, seeded: bool = True
) -> list[EpisodeRequest]:
    """One request per task for trial `trial` of `generation`, each with its task's workspace seed stored
    (`seeds.store_seed`; `seeded=False` leaves it out, for callers that only look a unit up)."""
    if trial < 0:
        raise BenchmarkError(f"benchmark trial must be ≥ 0, got {trial}")
    requests = []
    for task in tasks:
        seed = task_seed(task.benchmark, trial, task.index)
        unit = EpisodeUnit(
            cycle=ctx.cycle_name,
            task_id=task.name,  # type: ignore[arg-type]  # benchmark tasks are named; the store keeps ids as text
            kind="benchmark",
            seed=seed,
            candidate=trial,
            generation=generation,
        )
        condition = benchmark_condition(task.benchmark, generation, trial)
        workspace_seed = store_seed(ctx, task.seed) if seeded else None
        requests.append(
            EpisodeRequest(unit, condition, task.instruction, generation=generation, workspace_seed=workspace_seed)
        )
    return requests


def run_trial(
    ctx: CycleContext,
    executor: EpisodeExecutor,
    tasks: Sequence[BenchmarkTask],
    generation: str,
    trial: int,
    *,
    seeded: bool = True,
) -> list[EpisodeOutcome]:
    """Run (or reuse) one trial; infrastructure failures raise (rerun once the endpoint is healthy). Every task's
    inputs are checked first (one line for a missing one, before any agent time); `seeded=False` (an executor that
    only reads recorded episodes) stores no seed."""
    if seeded:
        check_seeds([task.seed for task in tasks])
    outcomes = executor.run(benchmark_requests(ctx, tasks, generation, trial, seeded=seeded))
    failed = [o.request.unit.slug for o in outcomes if o.status == "infra_failure"]
    if failed:
        raise BenchmarkError(
            f"benchmark trial {trial} of {generation}: {len(failed)} episode(s) ended in infrastructure failures "
            f"({', '.join(failed[:5])}); rerun the trial — finished episodes are reused"
        )
    return outcomes


@contextlib.contextmanager
def materialized_workspaces(ctx: CycleContext, outcomes: Sequence[EpisodeOutcome]) -> Iterator[dict[str, Path | None]]:
    """Each outcome's workspace extracted into a scratch folder, by task name (None when it has no workspace)."""
    with tempfile.TemporaryDirectory(prefix="mass-bench-") as scratch:
        roots: dict[str, Path | None] = {}
        for number, outcome in enumerate(outcomes):
            name = str(outcome.request.unit.task_id)
            uri = outcome.artifacts.get("workspace")
            if not uri:
                roots[name] = None
                continue
            folder = Path(scratch) / f"{number:04d}"
            folder.mkdir()
            try:
                roots[name] = StoredWorkspace(ctx.artifacts, uri, "workspace").materialize(folder)
            except UnsafeArchiveError as exc:  # over the archive limits or unsafe: graded as no submission
                logger.warning("benchmark task %s graded without its workspace: %s", name, " ".join(str(exc).split()))
                roots[name] = None
        yield roots


@dataclass(frozen=True)
class TaskScore:
    """The score of one task in one trial; None when it could not be scored (e.g. a judge's review is missing)."""

    task: str
    score: float | None
    episode_id: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "score": self.score, "episode_id": self.episode_id, "details": self.details}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> TaskScore:
        return cls(str(row["task"]), row.get("score"), row.get("episode_id"), dict(row.get("details") or {}))


@dataclass(frozen=True)
class TrialResult:
    """Scores of one trial of one generation on one benchmark, plus benchmark-specific aggregate metrics."""

    benchmark: str
    generation: str
    trial: int
    scores: tuple[TaskScore, ...]
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def unscored(self) -> list[str]:
        return [s.task for s in self.scores if s.score is None]

    @property
    def mean(self) -> float:
        """Mean task score over every task of the trial; BenchmarkError if any task is unscored."""
        if not self.scores:
            raise BenchmarkError(f"{self.benchmark} trial {self.trial} of {self.generation} has no task scores")
        if self.unscored:
            raise BenchmarkError(
                f"{self.benchmark} trial {self.trial} of {self.generation}: tasks {self.unscored} have no score "
                "(a missing judge or evaluation)"
            )
        return sum(float(s.score) for s in self.scores if s.score is not None) / len(self.scores)

    def as_results(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "generation": self.generation,
            "trial": self.trial,
            "scores": [s.as_dict() for s in self.scores],
            "metrics": self.metrics,
        }

    @classmethod
    def from_results(cls, row: Mapping[str, Any]) -> TrialResult:
        return cls(
            benchmark=str(row["benchmark"]),
            generation=str(row["generation"]),
            trial=int(row["trial"]),
            scores=tuple(TaskScore.from_dict(s) for s in row["scores"]),
            metrics=dict(row.get("metrics") or {}),
        )

    def scored_episodes(self) -> list[ScoredEpisode]:
        """Per-episode scores for the score-per-output-token table."""
        return [
            ScoredEpisode(self.benchmark, self.generation, s.task, self.trial, float(s.score), s.episode_id)
            for s in self.scores
            if s.score is not None and s.episode_id is not None
        ]


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n − 1); the deviation is None for a single value."""
    if not values:
        raise BenchmarkError("mean_sd: no values")
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


@dataclass(frozen=True)
class TrialSummary:
    """A benchmark's figure for one generation: mean ± sample SD of the per-trial means."""

    benchmark: str
    generation: str
    trials: int
    mean: float
    sd: float | None
    per_trial: dict[int, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "generation": self.generation,
            "trials": self.trials,
            "mean": self.mean,
            "sd": self.sd,
            "per_trial": {str(k): v for k, v in self.per_trial.items()},
        }

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        sd = "n/a" if self.sd is None else f"{self.sd * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} ± {sd}"


def summarize_trials(results: Sequence[TrialResult]) -> TrialSummary:
    """Mean and sample SD over trials of one benchmark and generation; every task of every trial must be scored."""
    if not results:
        raise BenchmarkError("summarize_trials: no trial results")
    identities = {(r.benchmark, r.generation) for r in results}
    if len(identities) != 1:
        raise BenchmarkError(f"summarize_trials: results mix benchmarks/generations {sorted(identities)}")
    trials = [r.trial for r in results]
    if len(set(trials)) != len(trials):
        raise BenchmarkError(f"summarize_trials: trials {sorted(trials)} repeat")
    per_trial = {r.trial: r.mean for r in sorted(results, key=lambda r: r.trial)}
    mean, sd = mean_sd(list(per_trial.values()))
    benchmark, generation = next(iter(identities))
    return TrialSummary(benchmark, generation, len(results), mean, sd, per_trial)


def trial_key(cycle: str, benchmark: str, generation: str, trial: int) -> str:
    return f"{cycle}/{BENCHMARK_KIND}/{benchmark}/{generation}/t{trial}"


def record_trial(ctx: CycleContext, result: TrialResult) -> TrialResult:
    """Record a scored trial once (artifact first, then the evaluation row); other results under the same trial are
    refused."""
    model = ctx.repo.get_generation(result.generation)
    if model is None:
        raise BenchmarkError(f"benchmark trial: generation {result.generation!r} is not a registered model")
    if any(isinstance(s.score, float) and not math.isfinite(s.score) for s in result.scores):
        raise BenchmarkError(f"benchmark trial {result.trial}: scores must be finite numbers")
    key = trial_key(ctx.cycle_name, result.benchmark, result.generation, result.trial)
    document = result.as_results()
    existing = [row for row in ctx.repo.evaluations(kind=BENCHMARK_KIND) if row.key == key]
    if existing:
        if TrialResult.from_results(existing[0].results) != TrialResult.from_results(document):
            raise BenchmarkError(f"benchmark trial {key} is already recorded with other scores")
        return TrialResult.from_results(existing[0].results)
    info = ctx.artifacts.put_json(
        f"{report_prefix(ctx.cycle_name)}/benchmarks/{result.benchmark}/{result.generation}/t{result.trial}.json",
        document,
    )
    row = ctx.repo.record_evaluation(
        key,
        BENCHMARK_KIND,
        generation_id=model.id,
        results=document,
        cycle_id=ctx.cycle_id,
        results_uri=info.uri,
        results_sha256=info.sha256,
    )
    return TrialResult.from_results(row.results)


def recorded_trials(ctx: CycleContext, benchmark: str | None = None) -> list[TrialResult]:
    """Every benchmark trial recorded for this cycle (optionally of one benchmark), in recording order."""
    prefix = f"{ctx.cycle_name}/{BENCHMARK_KIND}/"
    rows = [row for row in ctx.repo.evaluations(kind=BENCHMARK_KIND) if row.key.startswith(prefix)]
    results = [TrialResult.from_results(row.results) for row in rows]
    return [r for r in results if benchmark is None or r.benchmark == benchmark]
