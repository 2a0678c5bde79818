"""Public-benchmark adapters (MASS_SPEC §10): ScienceAgentBench and the 12-task MLR-Bench subset.

Datasets come from folders the user provides; nothing is downloaded. `scoring` holds what both share: benchmark
tasks, episode requests with the shared benchmark seeds, trial results, mean ± sample SD over trials, and recording.
"""

from mass_ops.evaluation.benchmarks.mlr import (
    MLR,
    MLR_SUBSET,
    MLRTask,
    load_mlr_tasks,
    load_overall_rubric,
    mlr_tasks,
    score_mlr_trial,
    summarize_mlr,
)
from mass_ops.evaluation.benchmarks.sab import (
    SAB,
    SABEvaluator,
    SABInstance,
    load_sab_instances,
    sab_tasks,
    score_sab_trial,
)
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkError,
    BenchmarkTask,
    EvaluatorNotInstalledError,
    TaskScore,
    TrialResult,
    TrialSummary,
    benchmark_requests,
    mean_sd,
    record_trial,
    recorded_trials,
    run_trial,
    summarize_trials,
)

__all__ = [
    "MLR",
    "MLR_SUBSET",
    "SAB",
    "BenchmarkError",
    "BenchmarkTask",
    "EvaluatorNotInstalledError",
    "MLRTask",
    "SABEvaluator",
    "SABInstance",
    "TaskScore",
    "TrialResult",
    "TrialSummary",
    "benchmark_requests",
    "load_mlr_tasks",
    "load_overall_rubric",
    "load_sab_instances",
    "mean_sd",
    "mlr_tasks",
    "record_trial",
    "recorded_trials",
    "run_trial",
    "sab_tasks",
    "score_mlr_trial",
    "score_sab_trial",
    "summarize_mlr",
    "summarize_trials",
]
