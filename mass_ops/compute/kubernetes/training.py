"""Training and export Jobs: per stage an indexed Job (one pod per node) and its headless rendezvous Service, or,
for training with `compute.kubernetes.training_launcher: trainjob`, a Kubeflow Trainer v2 TrainJob.

Pods run `mass-ops stage train|export --config CONFIG_FILE` with the launch topology in the environment (`NNODES`,
`NPROC_PER_NODE`, `NODE_RANK` = the Job's completion index, `MASTER_ADDR`, `MASTER_PORT`); rendezvous goes through
a headless Service named like the Job, whose node-0 name the Job sets as `MASTER_ADDR`. A TrainJob's torch runtime
sets the `PET_*` topology itself. Export mounts the model cache writable: it writes the next generation there.
"""

from __future__ import annotations

from typing import Any, Literal

from mass_ops.compute.kubernetes.common import (
    CONFIG_ANNOTATION,
    CONFIG_FILE,
    JOB_NAME_LABEL,
    MODEL_MOUNT,
    WorkloadSettings,
    _config_mount,
    _config_volume,
    _container_security,
    _gpu_resources,
    _gpu_scheduling,
    _model_cache_volume,
    _pod_base,
    _pod_security,
    _shm_volume,
    config_document,
    resource_name,
    workload_labels,
)
from mass_ops.config import CycleConfig

MASTER_PORT = 29500
TRAINING_GRACE_S = 120
# Kubeflow Trainer v2 (facts from its v2.2/v2.3 API): TrainJobs live in trainer.kubeflow.org/v1alpha1; the torch
# runtimes name their trainer job and container `node`; JobSet labels every pod with the TrainJob's name; a runtime
# patch names its manager as a domain-prefixed path.
TRAINJOB_GROUP = "trainer.kubeflow.org"
TRAINJOB_VERSION = "v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
TRAINJOB_NODE = "node"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
TRAINJOB_PATCH_MANAGER = "mass-ops.io/launcher"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


JobRole = Literal["train", "export"]


def job_name(config: CycleConfig, role: JobRole) -> str:
    """Name of the cycle's training/export Job or TrainJob (short enough for `<job>-<index>` pod hostnames, and for
    a TrainJob's `<job>-node-0-<index>`)."""
    return resource_name("mass", config.cycle_name, role, max_length=50)


def _training_labels(config: CycleConfig, settings: WorkloadSettings, role: JobRole) -> dict[str, str]:
    return {**workload_labels(config, config.cycle_name), **settings.labels_for("training"), "mass-ops/job": role}


def _training_topology(config: CycleConfig, role: JobRole) -> tuple[int, int]:
    """(nodes, GPUs per node): one data-parallel rank per GPU (ZeRO-3), `replicas / nnodes` ranks per node."""
    if role == "train":
        return config.training.nnodes, config.training.ranks_per_node
    return 1, 1


def _training_env(config: CycleConfig, settings: WorkloadSettings, role: JobRole) -> list[dict[str, Any]]:
    """The launch topology and paths every node of the stage reads (`mass_ops.train.plan`); node rank = the
    Job completion index, which both an indexed Job and a TrainJob's JobSet give each node's pod."""
    nnodes, gpus = _training_topology(config, role)
    return [
        {"name": "NNODES", "value": str(nnodes)},
        {"name": "NPROC_PER_NODE", "value": str(gpus)},
        {
            "name": "NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
        },
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "MASS_MODEL_DIR", "value": MODEL_MOUNT},
        {"name": "HOME", "value": "/scratch"},
        *settings.secret_env("training"),
    ]


def _training_mounts(role: JobRole) -> list[dict[str, Any]]:
    return [
        _config_mount(),
        # Export writes the next generation's weights into the cache, where the inference server loads them.
        {"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": role == "train"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def _training_volumes(config: CycleConfig, role: JobRole) -> list[dict[str, Any]]:
    return [
        _config_volume(),
        _model_cache_volume(config, read_only=role == "train"),
        _shm_volume(),
        {"name": "scratch", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]


def _training_command(role: JobRole) -> list[str]:
    return ["mass-ops", "stage", role, "--config", CONFIG_FILE]


def training_job(config: CycleConfig, settings: WorkloadSettings, *, role: JobRole = "train") -> dict[str, Any]:
    """An indexed Job: one pod per node, each with one GPU per data-parallel rank, running the stage's launch.

    `training.nnodes` pods start together (`training.replicas / nnodes` GPUs each); node rank = completion index
    (Kubernetes also sets JOB_COMPLETION_INDEX); node 0 is reachable for rendezvous as `<job>-0.<job>` through the
    headless Service of `rendezvous_service`, and the pods get that name as `MASTER_ADDR`. A failed pod fails the
    Job at once (backoffLimit 0): Airflow owns retries, and the stage resumes from its last checkpoint.
    """
    k8s = config.compute.kubernetes
    name = job_name(config, role)
    nnodes, gpus = _training_topology(config, role)
    labels = _training_labels(config, settings, role)
    container = {
        "name": "base",
        "image": k8s.image_trainer,
        "imagePullPolicy": "IfNotPresent",
        "command": _training_command(role),
        "env": [{"name": "MASTER_ADDR", "value": f"{name}-0.{name}"}, *_training_env(config, settings, role)],
        "envFrom": settings.env_from(),
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": _gpu_resources(config, gpus),
        "volumeMounts": _training_mounts(role),
        "securityContext": _container_security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = {
        **_pod_base(config, settings),
        **_gpu_scheduling(config),
        "restartPolicy": "Never",
        "subdomain": name,
        "priorityClassName": k8s.training_priority_class,
        "containers": [container],
        "volumes": _training_volumes(config, role),
        "terminationGracePeriodSeconds": TRAINING_GRACE_S,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nnodes,
            "parallelism": nnodes,
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                "spec": pod_spec,
            },
        },
    }


def training_trainjob(config: CycleConfig, settings: WorkloadSettings) -> dict[str, Any]:
    """The cycle's training as a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`, Trainer ≥ 2.2).

    The TrainJob names the ClusterTrainingRuntime `compute.kubernetes.trainjob_runtime` (Trainer's
    `torch-distributed` by default) and sets, through its `trainer` field, what the indexed Job sets: `numNodes`
    nodes with `resourcesPerNode` GPUs and `numProcPerNode` ranks each, the trainer image, command and environment.
    The runtime's torch plugin adds the `PET_*` topology (its `PET_MASTER_ADDR` names node 0 of the JobSet it
    creates, which also brings the headless Service), so no `MASTER_ADDR` and no Service of our own.

    Pod fields the `trainer` field cannot carry go in one `runtimePatches` entry for the runtime's `node` job:
    labels (the NetworkPolicy's, the scope's), the config annotation, service account, security context, GPU
    scheduling, volumes, and the `node` container's mounts and security context (its env may only come through
    `trainer.env`, which must not hold the runtime's reserved `PET_*` names). A TrainJob cannot set the priority
    class, `enableServiceLinks` or `automountServiceAccountToken`: the runtime decides the first two, and the chart's
    workload service account already mounts no token.
    """
    k8s = config.compute.kubernetes
    name = job_name(config, "train")
    nnodes, gpus = _training_topology(config, "train")
    labels = _training_labels(config, settings, "train")
    pod_patch: dict[str, Any] = {
        "serviceAccountName": settings.service_account,
        "securityContext": _pod_security(config),
        "volumes": _training_volumes(config, "train"),
        "containers": [
            {
                "name": TRAINJOB_NODE,
                "volumeMounts": _training_mounts("train"),
                "securityContext": _container_security(read_only_root=True),
            }
        ],
        "terminationGracePeriodSeconds": TRAINING_GRACE_S,
        **_gpu_scheduling(config),
    }
    node_patch = {
        "name": TRAINJOB_NODE,
        "template": {
            "spec": {
                "template": {
                    "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                    "spec": pod_patch,
                }
            }
        },
    }
    return {
        "apiVersion": f"{TRAINJOB_GROUP}/{TRAINJOB_VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"name": k8s.trainjob_runtime, "apiGroup": TRAINJOB_GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": k8s.image_trainer,
                "command": _training_command("train"),
                "env": _training_env(config, settings, "train"),
                "numNodes": nnodes,
                "numProcPerNode": gpus,
                "resourcesPerNode": _gpu_resources(config, gpus),
            },
            "runtimePatches": [
                {
                    "manager": TRAINJOB_PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_patch]}}},
                }
            ],
        },
    }


def rendezvous_service(config: CycleConfig, settings: WorkloadSettings, *, role: JobRole = "train") -> dict[str, Any]:
    """Headless Service giving the Job's pods stable DNS names (`<job>-<index>.<job>`) before they are ready."""
    name = job_name(config, role)
    labels = _training_labels(config, settings, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": config.compute.kubernetes.namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_NAME_LABEL: name},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}],
        },
    }
