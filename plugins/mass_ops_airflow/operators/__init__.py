"""Operators of mass-ops cycles: model servers, episode sandboxes, a task's teacher collection, training and export
Jobs, the report.

Each decides at run time, from the run's config (`compute.backend`), whether to launch Kubernetes workloads or to
call the stage function in-process (the report is always written in-process); the same DAG serves the laptop and the
cluster.
"""

from mass_ops_airflow.operators.collection import TaskCollectionOperator
from mass_ops_airflow.operators.episode import EpisodePodOperator, EpisodeStageOperator
from mass_ops_airflow.operators.inference import InferenceServerOperator, InferenceServerTeardownOperator
from mass_ops_airflow.operators.jobs import ExportJobOperator, GpuJobOperator, TrainingJobOperator
from mass_ops_airflow.operators.report import ReportOperator

__all__ = [
    "EpisodePodOperator",
    "EpisodeStageOperator",
    "ExportJobOperator",
    "GpuJobOperator",
    "InferenceServerOperator",
    "InferenceServerTeardownOperator",
    "ReportOperator",
    "TaskCollectionOperator",
    "TrainingJobOperator",
]
