"""Where a benchmark's grader runs: in this process, or in a container per instance (MASS_SPEC §10).

SWE-bench and Terminal-Bench grade each instance by running its tests inside the benchmark's own image. A
`GraderJob` says what such a run needs — the image, a bash script, the files to place before it starts, the time
limit — and a `ContainerRunner` runs it: `DockerRunner` on a machine with a container engine, a Kubernetes Job
(`mass_ops.compute.kubernetes.benchmark_grader_job`) on a cluster. `require_grader_host` is called before any agent
time is spent, so a local run on a machine without an engine stops at once with one line instead of after hours
of episodes.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mass_ops.evaluation.benchmarks.scoring import BenchmarkError

# The grader script prints the instance's result between these lines, so it can be read back from a pod's log too.
RESULT_BEGIN = ">>>>> mass-ops grader result begin"
RESULT_END = ">>>>> mass-ops grader result end"
ENGINE_ENV = "MASS_CONTAINER_ENGINE"
ENGINES = ("docker", "podman")


class ContainerEngineMissingError(BenchmarkError):
    """The benchmark grades in a container per instance and no container engine is available here."""


@dataclass(frozen=True)
class GraderJob:
    """One instance's grading run: `script` runs under bash in `image` after `files` (absolute path → content) are
    in place; its stdout is the log; `timeout_s` bounds it."""

    benchmark: str
    instance: str
    image: str
    script: str
    files: Mapping[str, bytes] = field(default_factory=dict)
    timeout_s: float = 1800.0
    cpus: float | None = None
    memory: str | None = None

    def __post_init__(self) -> None:
        if not self.image.strip():
            raise BenchmarkError(f"{self.benchmark} instance {self.instance}: the grader image is empty")
        bad = [p for p in self.files if not p.startswith("/") or ".." in Path(p).parts]
        if bad:
            raise BenchmarkError(f"{self.benchmark} instance {self.instance}: grader file paths {bad} are not absolute")


class ContainerRunner(Protocol):
    """Runs one `GraderJob` and returns its log (stdout and stderr together)."""

    def run(self, job: GraderJob) -> str: ...


def result_section(log: str, where: str) -> str:
    """The text the grader script printed between `RESULT_BEGIN` and `RESULT_END`."""
    if RESULT_BEGIN not in log or RESULT_END not in log.split(RESULT_BEGIN, 1)[1]:
        raise BenchmarkError(f"{where}: the grader log has no result section (the grader did not finish)")
    return log.split(RESULT_BEGIN, 1)[1].split(RESULT_END, 1)[0].strip()


def container_engine() -> str | None:
    """The container engine CLI to use: ``$MASS_CONTAINER_ENGINE`` or the first of docker/podman on PATH."""
    chosen = os.environ.get(ENGINE_ENV)
    if chosen:
        return shutil.which(chosen)
    return next((path for path in map(shutil.which, ENGINES) if path), None)


def require_grader_host(benchmark: str, *, needs_container: bool, runner: ContainerRunner | None) -> None:
    """Refuse, before any episode runs, a benchmark whose grader needs a container when none can be run."""
    if needs_container and runner is None:
        raise ContainerEngineMissingError(
            f"{benchmark}: its grader runs each instance in the benchmark's container image and no container engine "
            "(docker/podman) or Kubernetes cluster is available here; no episode was started"
        )


def local_runner() -> ContainerRunner | None:
    """A `DockerRunner` on this machine's engine, or None when it has none."""
    engine = container_engine()
    return DockerRunner(engine) if engine else None


@dataclass(frozen=True)
class DockerRunner:
    """Runs a grader job with ``<engine> run`` from an already present image (``--pull never``: nothing is
    downloaded at run time); the files go in through a read-only bind mount copied into place by the script."""

    engine: str
    network: str = "none"

    def run(self, job: GraderJob) -> str:
        with tempfile.TemporaryDirectory(prefix="mass-grader-") as scratch:
            staged = Path(scratch)
            copies = []
            for number, (target, content) in enumerate(sorted(job.files.items())):
                (staged / f"{number:04d}").write_bytes(content)
                copies.append(f"mkdir -p \"$(dirname '{target}')\" && cp /mass-grader/{number:04d} '{target}'")
            script = "\n".join([*copies, job.script])
            command = [
                self.engine,
                "run",
                "--rm",
                "--pull",
                "never",
                "--network",
                self.network,
                "-v",
                f"{staged}:/mass-grader:ro",
                "--entrypoint",
                "bash",
            ]
            if job.cpus:
                command += ["--cpus", str(job.cpus)]
            if job.memory:
                command += ["--memory", job.memory]
            try:
                result = subprocess.run(
                    [*command, job.image, "-c", script],
                    capture_output=True,
                    text=True,
                    timeout=job.timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise BenchmarkError(
                    f"{job.benchmark} instance {job.instance}: the grader ran past {job.timeout_s:.0f} s"
                ) from None
        return result.stdout + result.stderr


def grader_bundle(job: GraderJob) -> bytes:
    """The job's files as one tar whose members are their target paths relative to ``/`` (what a Kubernetes grader
    Job unpacks over its root: `mass_ops.compute.kubernetes.benchmark_grader_job`); deterministic for equal jobs."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for target, content in sorted(job.files.items()):
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode, info.mtime = len(content), 0o644, 0
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def write_grader_bundle(data: bytes, sha256: str, out: Path) -> None:
    """Write a fetched bundle to `out` when its SHA-256 is `sha256` (the one the operator stored); BenchmarkError
    and nothing written otherwise."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise BenchmarkError(f"grader bundle: SHA-256 {actual} is not the expected {sha256}; nothing written to {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.with_name(f".{out.name}.partial")
    staged.write_bytes(data)
    staged.replace(out)
