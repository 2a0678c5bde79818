"""Benchmark grader Jobs: one benchmark instance's grading in the benchmark's own image (SWE-bench, Terminal-Bench
2.0), bounded like an episode pod (its labels, NetworkPolicy, limits, sized emptyDirs, no token, a deadline).

The `fetch` init container, the only one with the store credentials, writes the tar bundle to `GRADER_BUNDLE`
after checking its SHA-256; `grader` (the benchmark image, no Secret, root without capabilities) unpacks it over `/`
and runs the script, whose result the operator reads from the `grader` container's log. Why root, and what bounds
it: docs/kubernetes.md, "Benchmark grader Jobs".
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol

from mass_ops.compute.kubernetes.common import (
    CONFIG_ANNOTATION,
    CONFIG_FILE,
    RUNTIME_UID,
    SpecError,
    WorkloadSettings,
    _config_volume,
    _empty_dir,
    _pod_base,
    _resources,
    _store_client_container,
    config_document,
    label_value,
    resource_name,
    workload_labels,
)
from mass_ops.config import CycleConfig

GRADER_CONTAINER = "grader"
GRADER_FETCH_CONTAINER = "fetch"
GRADER_INPUT_MOUNT = "/grader-in"
GRADER_BUNDLE = f"{GRADER_INPUT_MOUNT}/bundle.tar"
GRADER_DEADLINE_SLACK_S = 300  # image start and the bundle's fetch, on top of the grader's own limit


class GraderRun(Protocol):
    """What a grader Job runs (an evaluation `GraderJob`; compute sits below evaluation, so it names only the fields
    it reads): the benchmark's image and bash script, and the script's time limit."""

    @property
    def benchmark(self) -> str: ...

    @property
    def instance(self) -> str: ...

    @property
    def image(self) -> str: ...

    @property
    def script(self) -> str: ...

    @property
    def timeout_s(self) -> float: ...


def grader_job_name(config: CycleConfig, job: GraderRun, unit: str = "") -> str:
    """The grader Job's name: cycle, benchmark, `unit` (generation and trial: the same instance is graded once per
    trial, and trials run side by side) and instance, hashed when too long."""
    return resource_name("grade", config.cycle_name, job.benchmark, unit, job.instance, max_length=52)


def _fetch_container(
    config: CycleConfig, settings: WorkloadSettings, input_mount: dict[str, Any], bundle_uri: str, bundle_sha256: str
) -> dict[str, Any]:
    """`fetch`: the episode image as the unprivileged runtime user, with the publisher's store credentials, writing
    the bundle to `GRADER_BUNDLE` once its SHA-256 checks."""
    fetch = _store_client_container(
        GRADER_FETCH_CONTAINER,
        [
            *("mass-ops", "benchmark", "grader-files", "--config", CONFIG_FILE),
            *("--uri", bundle_uri, "--sha256", bundle_sha256, "--out", GRADER_BUNDLE),
        ],
        config,
        settings,
        input_mount,
    )
    fetch["securityContext"] = {**fetch["securityContext"], "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID}
    return fetch


def _grader_container(
    config: CycleConfig, settings: WorkloadSettings, job: GraderRun, input_mount: dict[str, Any]
) -> dict[str, Any]:
    """`grader`: the benchmark's image, no Secret at all, as root with every capability dropped (docs/kubernetes.md);
    unpacks the bundle over `/` and runs the script with the episode sandbox's CPU, memory and disk limits."""
    k8s, limits = config.compute.kubernetes, settings.episode_limits
    return {
        "name": GRADER_CONTAINER,
        "image": job.image,
        # Images come from the registry the user provides and are never rebuilt or pulled from elsewhere at run time.
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", f'tar -xf {GRADER_BUNDLE} -C / && exec bash -c "$MASS_GRADER_SCRIPT"'],
        "env": [{"name": "MASS_GRADER_SCRIPT", "value": job.script}],
        "resources": _resources(k8s.episode_cpu, k8s.episode_memory, limits.sandbox_storage),
        "volumeMounts": [{**input_mount, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": False,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def benchmark_grader_job(
    config: CycleConfig,
    settings: WorkloadSettings,
    job: GraderRun,
    *,
    bundle_uri: str,
    bundle_sha256: str,
    scope: str | None = None,
    unit: str = "",
) -> dict[str, Any]:
    """One benchmark instance's grading as a Job from the benchmark's own image (SWE-bench, Terminal-Bench 2.0).

    Bounded like an episode pod (the episode labels, so the chart's sandbox NetworkPolicy applies; the episode CPU,
    memory and ephemeral-storage limits; sized emptyDirs; no token, no service links; a deadline). `fetch` writes
    the bundle stored at `bundle_uri` (checked against `bundle_sha256`) for `grader`, which unpacks and runs it; the
    result is read from `grader`'s log by `BenchmarkTrialOperator`: the grader holds no credential to publish.
    `unit` (e.g. ``l1-t0``) keeps the Jobs of one instance in different trials apart. The Job never retries
    (backoffLimit 0): a failed grading is reported, and the trial's rerun grades the instance again.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", bundle_sha256):
        raise SpecError(f"grader {job.benchmark}/{job.instance}: bundle_sha256 {bundle_sha256!r} is not a hex SHA-256")
    if not job.image.strip():
        raise SpecError(f"grader {job.benchmark}/{job.instance}: the benchmark image is empty")
    if not math.isfinite(job.timeout_s) or job.timeout_s <= 0:
        raise SpecError(f"grader {job.benchmark}/{job.instance}: timeout_s {job.timeout_s!r} is not positive")
    k8s = config.compute.kubernetes
    scope = scope or config.cycle_name
    limits = settings.episode_limits
    name = grader_job_name(config, job, unit)
    labels = {
        **workload_labels(config, scope),
        **settings.labels_for("episode"),
        "mass-ops/benchmark": label_value(job.benchmark),
        "mass-ops/instance": label_value(job.instance) or "instance",
        **({"mass-ops/unit": label_value(unit)} if unit else {}),
    }
    input_mount = {"name": "grader-in", "mountPath": GRADER_INPUT_MOUNT}
    fetch = _fetch_container(config, settings, input_mount, bundle_uri, bundle_sha256)
    grader = _grader_container(config, settings, job, input_mount)
    pod_spec: dict[str, Any] = {
        **_pod_base(config, settings),
        # Pod-level: only what holds for both containers; who runs as whom is set per container.
        "securityContext": {"fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "restartPolicy": "Never",
        "initContainers": [fetch],
        "containers": [grader],
        "volumes": [
            _config_volume(),
            {"name": "grader-in", "emptyDir": {"sizeLimit": limits.size_limit("workspace")}},
            _empty_dir("tmp", limits),
            _empty_dir("publisher-tmp", limits),
        ],
        "terminationGracePeriodSeconds": 30,
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": math.ceil(job.timeout_s) + GRADER_DEADLINE_SLACK_S,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_ANNOTATION: config_document(config)}},
                "spec": pod_spec,
            },
        },
    }
