"""Operators of mass-ops cycles: model servers, episode sandboxes, a task's teacher collection, training and export
Jobs, the report.

Each asks the run's compute backend (`mass_ops.compute.backend.backend_for(config)`) at run time: a backend that runs
work in process (local) has the stage function called here; otherwise the operator launches the workloads the
backend's specs describe (Kubernetes). The report is always written in-process; the same DAG serves the laptop and
the cluster.
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
