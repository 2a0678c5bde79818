"""Benchmark agents start from what the benchmark gives them (#18): SWE-bench Verified the instance's repository at
its base commit (from the user's clones or bare mirrors), Terminal-Bench 2.0 the files its task image puts in the
working directory, DSBench the data files. Fixtures in each benchmark's own format are made here (a tiny git
repository with a base commit and a later fix; a Harbor task folder). The executor stands in for the agent only: it
extracts each request's seed with the runner's own functions, records what the agent saw, then applies the agent's
scripted change."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mass_ops.evaluation.benchmarks.dsbench import DSBench
from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError
from mass_ops.evaluation.benchmarks.seeds import store_seed
from mass_ops.evaluation.benchmarks.suite import run_benchmark_trial
from mass_ops.evaluation.benchmarks.swe import SWEBench
from mass_ops.evaluation.benchmarks.tb2 import TerminalBench2
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, WorkspaceSeed, workspace_seed_key
from mass_ops.runtime.runner import WorkspaceSeedError, extract_workspace_seed, fetch_workspace_seed
from tests.evaluation.benchmarks.test_adapters import (
    EVAL_SCRIPT,
    SWE_INSTANCE,
    ScriptedRunner,
    make_tb2_task,
    swe_log,
    write_dsbench,
)

BASE_CALC = "def add(a, b): return abs(a) + b\n"
FIXED_CALC = "def add(a, b): return a + b\n"
TEST_CALC = "from calc import add\n\ndef test_negative():\n    assert add(-1, 1) == 0\n"


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    done = subprocess.run(["git", *identity, *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def make_repo(repos: Path) -> tuple[Path, str]:
    """``calc__calc``: the base commit (the bug, its test, a .gitignore, an executable script), then the fix."""
    repo = repos / "calc__calc"
    (repo / "tests").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "calc.py").write_text(BASE_CALC)
    (repo / "tests" / "test_calc.py").write_text(TEST_CALC)
    (repo / ".gitignore").write_text("__pycache__/\n")
    (repo / "run.sh").write_text("#!/bin/sh\npytest\n")
    (repo / "run.sh").chmod(0o755)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the bug")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text(FIXED_CALC)
    git(repo, "commit", "-q", "-am", "the fix (later than the base commit)")
    return repo, base


def write_swe(root: Path, base: str) -> dict:
    instance = {**SWE_INSTANCE, "base_commit": base, "eval_script": EVAL_SCRIPT}
    (root / "SWE-bench_Verified.jsonl").write_text(json.dumps(instance) + "\n")
    return instance


class SeedingExecutor:
    """An `EpisodeExecutor` standing in for the agent only: each workspace starts from the request's seed, extracted
    with the runner's own `fetch_workspace_seed`/`extract_workspace_seed`; `agent(request, workspace)` then changes it
    (and may assert what it sees). Rows are real; finished units are reused."""

    def __init__(self, ctx, agent: Callable[[EpisodeRequest, Path], None]) -> None:
        self.ctx = ctx
        self.agent = agent
        self.seen: dict[str, list[str]] = {}
        self.executed: list[str] = []

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        return [self._one(request) for request in requests]

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        self.ctx.artifacts.get_dir(self.ctx.artifacts.key_of(outcome.artifacts["workspace"]), dest)
        return dest

    def _one(self, request: EpisodeRequest) -> EpisodeOutcome:
        unit, repo = request.unit, self.ctx.repo
        attempts = repo.episode_attempts(self.ctx.cycle_id, **unit.identity())
        if attempts:
            row = attempts[-1]
            return EpisodeOutcome(request, row.id, row.attempt, row.status, {}, dict(row.artifacts), reused=True)
        attempt = dataclasses.replace(unit, attempt=1)
        with tempfile.TemporaryDirectory(prefix="seeded-ws-") as scratch:
            root = Path(scratch) / "workspace"
            root.mkdir()
            if request.workspace_seed is not None:
                archive = Path(scratch) / "seed.tar.gz"
                fetch_workspace_seed(self.ctx.artifacts, request.workspace_seed, archive)
                extract_workspace_seed(archive, root, request.workspace_seed)
            self.seen[str(unit.task_id)] = sorted(
                p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git/" not in str(p)
            )
            self.agent(request, root)
            workspace = self.ctx.artifacts.put_dir(attempt.artifact_key("workspace"), root).uri
        status = {"condition": request.condition}
        if request.workspace_seed is not None:
            status["workspace_seed"] = request.workspace_seed.as_dict()
        status_uri = self.ctx.artifacts.put_json(attempt.artifact_key("status"), status).uri
        started = datetime(2026, 10, 1, 12, 0, tzinfo=UTC)
        row = repo.record_episode(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            status="succeeded",
            candidate=unit.candidate,
            generation=request.generation,
            condition=request.condition,
            prompt_sha256=request.prompt_sha256,
            prompt_tokens=100,
            completion_tokens=10,
            started_at=started,
            finished_at=started + timedelta(seconds=5),
            artifacts={"workspace": workspace, "status": status_uri},
        )
        self.executed.append(row.unit_key)
        return EpisodeOutcome(request, row.id, row.attempt, "succeeded", status, dict(row.artifacts))


# --- SWE-bench Verified ---------------------------------------------------------------------------------------------


def test_swe_agent_starts_in_the_repo_at_its_base_commit_and_its_patch_is_only_its_change(tmp_path, eval_env):
    root = tmp_path / "swe"
    root.mkdir()
    _repo, base = make_repo(root / "repos")
    write_swe(root, base)

    def agent(request: EpisodeRequest, workspace: Path) -> None:
        checkout = workspace / "repo"
        # The agent sees the repository as of the base commit, with git working on it, and not the later fix.
        assert (checkout / "calc.py").read_text() == BASE_CALC
        assert git(checkout, "rev-parse", "HEAD") == base and git(checkout, "status", "--porcelain") == ""
        assert git(checkout, "log", "--format=%s") == "the bug"
        (checkout / "calc.py").write_text(FIXED_CALC)
        (checkout / "helpers.py").write_text("ZERO = 0\n")  # a new file counts
        (checkout / "__pycache__").mkdir()
        (checkout / "__pycache__" / "calc.cpython-311.pyc").write_bytes(b"\0")  # .gitignore'd: not a change

    executor = SeedingExecutor(eval_env.ctx, agent)
    runner = ScriptedRunner(lambda job: swe_log("PASSED", 0))
    result = run_benchmark_trial(eval_env.ctx, SWEBench(root), executor, "L1", 0, runner=runner)

    assert executor.seen["swe_calc__calc-1"] == [
        "repo/.gitignore",
        "repo/calc.py",
        "repo/run.sh",
        "repo/tests/test_calc.py",
    ]
    [job] = runner.jobs
    patch = job.files["/tmp/mass_model.patch"].decode()
    assert "-def add(a, b): return abs(a) + b\n+def add(a, b): return a + b" in patch
    assert "+++ b/helpers.py" in patch
    # Nothing of the seed itself: no unchanged file, no .git, no ignored build output.
    for seeded in ("tests/test_calc.py", "run.sh", ".gitignore", ".git/", "__pycache__"):
        assert seeded not in patch
    assert patch.count("diff --git") == 2
    [score] = result.scores
    assert score.score == 1.0
    # The recorded episode names the seed it started from.
    [row] = eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id, kind="benchmark")
    status = eval_env.ctx.artifacts.get_json(eval_env.ctx.artifacts.key_of(row.artifacts["status"]))
    assert status["workspace_seed"]["uri"].endswith(f"{status['workspace_seed']['sha256']}.tar.gz")


def test_swe_agent_that_changes_nothing_has_an_empty_patch(tmp_path, eval_env):
    root = tmp_path / "swe"
    root.mkdir()
    _repo, base = make_repo(root / "repos")
    write_swe(root, base)
    runner = ScriptedRunner(lambda job: pytest.fail("an empty patch needs no container"))
    executor = SeedingExecutor(eval_env.ctx, lambda request, workspace: None)
    result = run_benchmark_trial(eval_env.ctx, SWEBench(root), executor, "L1", 0, runner=runner)
    [score] = result.scores
    assert score.score == 0.0 and score.details["report"]["patch_is_None"] is True


def test_the_seed_is_the_same_bytes_from_a_clone_or_a_bare_mirror(tmp_path, eval_env):
    root = tmp_path / "swe"
    root.mkdir()
    repo, base = make_repo(root / "repos")
    write_swe(root, base)
    mirrors = tmp_path / "mirrors"
    mirrors.mkdir()
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(mirrors / "calc__calc.git"))
    git(mirrors / "calc__calc.git", "gc", "-q", "--aggressive")  # packed differently from the clone
    [from_clone] = SWEBench(root).tasks()
    [from_mirror] = SWEBench(root, repos=mirrors).tasks()
    first, again, mirrored = (store_seed(eval_env.ctx, t.seed) for t in (from_clone, from_clone, from_mirror))
    assert first is not None and first == again == mirrored


def test_a_missing_repository_or_commit_is_one_line_before_any_episode(tmp_path, eval_env):
    root = tmp_path / "swe"
    root.mkdir()
    (root / "repos").mkdir()
    write_swe(root, "0" * 40)
    executor = SeedingExecutor(eval_env.ctx, lambda request, workspace: pytest.fail("no agent may start"))
    runner = ScriptedRunner(lambda job: "")
    with pytest.raises(BenchmarkError, match="no clone or bare mirror of calc/calc") as caught:
        run_benchmark_trial(eval_env.ctx, SWEBench(root), executor, "L1", 0, runner=runner)
    assert "\n" not in str(caught.value) and "calc__calc" in str(caught.value)
    make_repo(root / "repos")  # the repository, but without that commit
    with pytest.raises(BenchmarkError, match=f"has no commit {'0' * 40}") as caught:
        run_benchmark_trial(eval_env.ctx, SWEBench(root), executor, "L1", 0, runner=runner)
    assert "\n" not in str(caught.value)
    assert executor.executed == [] and eval_env.ctx.repo.episodes(eval_env.ctx.cycle_id) == []


def test_the_kubernetes_trial_checks_every_instance_s_inputs_before_its_first_episode(tmp_path, eval_env):
    """`benchmark_trial_tasks` is the operator's first call on Kubernetes: a missing repository is refused there, not
    when its instance is reached after earlier instances spent agent time."""
    from mass_ops.evaluation.benchmarks.sources import SWE
    from mass_ops.stages.benchmarks import benchmark_trial_tasks

    root = tmp_path / SWE
    (root / "repos").mkdir(parents=True)
    write_swe(root, "0" * 40)
    with pytest.raises(BenchmarkError, match="no clone or bare mirror of calc/calc") as caught:
        benchmark_trial_tasks(eval_env.ctx.config, SWE, None, str(tmp_path))
    assert "\n" not in str(caught.value)
    _repo, base = make_repo(root / "repos")
    write_swe(root, base)
    assert benchmark_trial_tasks(eval_env.ctx.config, SWE, None, str(tmp_path))["tasks"]


# --- Terminal-Bench 2.0 (Harbor task format) --------------------------------------------------------------------------


def make_harbor_task(root: Path) -> Path:
    """A Harbor task whose image copies files into its WORKDIR (and one elsewhere); tests/ and solution/ beside."""
    task = make_tb2_task(root, "csv-report")
    env = task / "environment"
    (env / "Dockerfile").write_text(
        "FROM python:3.12-slim AS build\nCOPY build-only.txt /app/\n"
        "FROM debian:bookworm-slim\n"
        "WORKDIR /app\n"
        "RUN apt-get update && \\\n    apt-get install -y python3\n"
        "COPY data.csv ./\n"
        'COPY ["src", "./src"]\n'
        "COPY fixtures /opt/fixtures\n"
        "COPY --from=build /app/build-only.txt /app/\n"
        "COPY *.key ./\n"
    )
    (env / "data.csv").write_text("a,b\n1,2\n")
    (env / "src").mkdir()
    (env / "src" / "report.py").write_text("print('report')\n")
    (env / "fixtures").mkdir()
    (env / "fixtures" / "expected.csv").write_text("hidden\n")
    (env / "build-only.txt").write_text("x\n")
    (env / "secret.key").write_text("k\n")
    (env / ".dockerignore").write_text("*.key\n")
    (task / "solution").mkdir()
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho answer > /app/report.txt\n")
    return task


def test_tb2_agent_starts_with_the_files_its_task_image_puts_in_the_working_directory(tmp_path, eval_env):
    make_harbor_task(tmp_path)
    make_tb2_task(tmp_path, "hello-world")  # its image copies nothing: an empty workspace, no seed

    def agent(request: EpisodeRequest, workspace: Path) -> None:
        (workspace / "report.txt").write_text("done\n")

    executor = SeedingExecutor(eval_env.ctx, agent)
    runner = ScriptedRunner(lambda job: f"{RESULT_BEGIN}\n1\n{RESULT_END}\n")
    run_benchmark_trial(eval_env.ctx, TerminalBench2(tmp_path), executor, "L1", 0, runner=runner)
    # What COPY put under WORKDIR — not tests/, not solution/, not what went elsewhere, not an ignored file.
    assert executor.seen["tb2_csv-report"] == ["data.csv", "src/report.py"]
    assert executor.seen["tb2_hello-world"] == []
    # The verifier gets the whole final /app: the task's files with the agent's work.
    job = next(j for j in runner.jobs if j.instance == "csv-report")
    with tarfile.open(fileobj=io.BytesIO(job.files["/tmp/mass_workspace.tar"])) as tar:
        assert sorted(tar.getnames()) == ["./data.csv", "./report.txt", "./src/report.py"]


# --- DSBench ----------------------------------------------------------------------------------------------------------


def test_dsbench_agent_starts_with_the_data_files_its_prompt_names(tmp_path, eval_env):
    write_dsbench(tmp_path)
    executor = SeedingExecutor(eval_env.ctx, lambda r, ws: (ws / "answer.txt").write_text("42"))
    run_benchmark_trial(eval_env.ctx, DSBench(tmp_path), executor, "L1", 0, runner=None)
    assert executor.seen == {"ds_00000001_question1": ["sales.xlsx"], "ds_00000001_question2": ["sales.xlsx"]}


# --- a hostile seed ---------------------------------------------------------------------------------------------------


def _hostile(kind: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        good = tarfile.TarInfo("ok.txt")
        good.size = 2
        tar.addfile(good, io.BytesIO(b"ok"))
        if kind == "symlink":
            bad = tarfile.TarInfo("etc")
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc"
            tar.addfile(bad)
        else:
            bad = tarfile.TarInfo({"parent": "../x", "absolute": "/tmp/mass-seed-absolute-x"}[kind])
            bad.size = 4
            tar.addfile(bad, io.BytesIO(b"evil"))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("parent", "member '../x' has a '..' path segment"),
        ("absolute", "has an absolute path"),
        ("symlink", "is a link to an absolute path '/etc'"),
    ],
)
def test_a_hostile_seed_is_refused_in_one_line_and_nothing_is_extracted(tmp_path, eval_env, kind, reason):
    import hashlib

    ctx = eval_env.ctx
    data = _hostile(kind)
    sha256 = hashlib.sha256(data).hexdigest()
    seed = WorkspaceSeed(ctx.artifacts.put_bytes(workspace_seed_key(ctx.cycle_name, sha256), data).uri, sha256)
    archive = tmp_path / "fetched.tar.gz"
    fetch_workspace_seed(ctx.artifacts, seed, archive)
    workspace = tmp_path / "attempt" / "workspace"
    workspace.mkdir(parents=True)
    with pytest.raises(WorkspaceSeedError, match=reason) as caught:
        extract_workspace_seed(archive, workspace, seed)
    assert "\n" not in str(caught.value)
    assert list((tmp_path / "attempt").iterdir()) == [workspace] and list(workspace.iterdir()) == []
    assert not (tmp_path / "attempt" / "x").exists() and not Path("/tmp/mass-seed-absolute-x").exists()


def test_a_seed_with_other_bytes_or_over_the_limits_is_refused(tmp_path, eval_env):
    import hashlib

    ctx = eval_env.ctx
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in ("a.txt", "b.txt", "c.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    data = buffer.getvalue()
    sha256 = hashlib.sha256(data).hexdigest()
    seed = WorkspaceSeed(ctx.artifacts.put_bytes(workspace_seed_key(ctx.cycle_name, sha256), data).uri, sha256)
    archive = tmp_path / "seed.tar.gz"
    archive.write_bytes(data)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(WorkspaceSeedError, match="more than 2 members"):
        extract_workspace_seed(archive, workspace, seed, max_entries=2)
    with pytest.raises(WorkspaceSeedError, match="more than 8 bytes"):
        extract_workspace_seed(archive, workspace, seed, max_bytes=8)
    assert list(workspace.iterdir()) == []
    wrong = WorkspaceSeed(seed.uri, "f" * 64)
    with pytest.raises(WorkspaceSeedError, match=r"does not hold|SHA-256"):
        fetch_workspace_seed(ctx.artifacts, wrong, tmp_path / "other.tar.gz")
    with pytest.raises(WorkspaceSeedError, match="SHA-256"):
        extract_workspace_seed(archive, workspace, wrong)
    assert extract_workspace_seed(archive, workspace, seed) == 3
    assert sorted(p.name for p in workspace.iterdir()) == ["a.txt", "b.txt", "c.txt"]
