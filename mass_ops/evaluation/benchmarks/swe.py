"""SWE-bench Verified adapter: instances from a user-provided dataset file, grading by the official `swebench`
package (its test specs, log parsers and resolution rules) on a log from the instance's own image.

Nothing is downloaded: the folder holds ``SWE-bench_Verified.jsonl`` and ``repos/`` with each instance's repository.
The agent starts with the repository at ``base_commit`` in ``repo/``; its patch is the change of ``repo/`` against
that commit (``model.patch`` as fallback). A task scores 1 when the instance is resolved, else 0; an empty patch
scores 0 without a container. Dataset layout and grading: docs/public-benchmarks.md (`...benchmarks.swe`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END, GraderJob, result_section
from mass_ops.evaluation.benchmarks.scoring import (
    BenchmarkError,
    BenchmarkTask,
    EvaluatorNotInstalledError,
    json_lines,
    workspace_text,
)
from mass_ops.evaluation.benchmarks.seeds import GitCheckoutSeed

SWE = "swe"
DATASET_FILE = "SWE-bench_Verified.jsonl"
REQUIRED_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "image",
    "log_parser",
    "eval_type",
    "eval_script",
)
PATCH_FILE = "model.patch"
REPO_DIR = "repo"
REPOS_DIR = "repos"
GRADER_PATCH = "/tmp/mass_model.patch"
GRADER_EVAL = "/tmp/mass_eval.sh"
GRADER_TIMEOUT_S = 1800  # the official harness's default per-instance timeout
MODEL_NAME = "mass-ops"


def evaluator_version() -> str:
    """``swebench <version>``; EvaluatorNotInstalledError when the package is absent."""
    try:
        return f"swebench {metadata.version('swebench')}"
    except metadata.PackageNotFoundError:
        raise EvaluatorNotInstalledError(
            "SWE-bench evaluator not installed: install the `benchmarks` extra (package swebench); no score computed"
        ) from None


def load_swe_instances(root: str | Path) -> list[dict[str, Any]]:
    """The dataset's instances sorted by instance id (the task index of the seed formula is the position)."""
    path = Path(root) / DATASET_FILE
    if not path.is_file():
        raise BenchmarkError(
            f"SWE-bench Verified: {path} is missing; put the dataset file there (nothing is downloaded)"
        )
    rows = []
    for number, row in json_lines(path):
        missing = [name for name in REQUIRED_FIELDS if not isinstance(row, dict) or row.get(name) in (None, "")]
        if missing:
            raise BenchmarkError(f"{path}:{number}: instance lacks {missing}")
        rows.append(row)
    ids = [r["instance_id"] for r in rows]
    if not rows or len(set(ids)) != len(ids):
        raise BenchmarkError(f"{path}: no instances, or instance ids repeat")
    return sorted(rows, key=lambda r: r["instance_id"])


def swe_instruction(instance: dict[str, Any]) -> str:
    """The agent's prompt: the issue, where the repository is, and where its change must end up."""
    hints = f"\n\nHints from the issue thread:\n{instance['hints_text']}" if instance.get("hints_text") else ""
    return (
        f"Resolve this issue in the repository {instance['repo']} (commit {instance['base_commit']}), which is "
        f"checked out at that commit in `{REPO_DIR}/` in your working directory.\n\n"
        f"{instance['problem_statement']}{hints}\n\n"
        f"Change only non-test source files, in `{REPO_DIR}/`. Your change is graded as its diff against that commit."
    )


def repo_candidates(repos_dir: Path, repo: str) -> tuple[Path, ...]:
    """Where a clone or bare mirror of ``owner/name`` may lie under `repos_dir`, in the order looked at."""
    owner, _, name = repo.partition("/")
    names = [f"{owner}__{name}", f"{owner}/{name}"] if name else [owner]
    return tuple(repos_dir / f"{base}{suffix}" for base in names for suffix in ("", ".git"))


def swe_seed(instance: dict[str, Any], repos_dir: Path) -> GitCheckoutSeed:
    """The instance's repository at its base commit, as the agent's `repo/`."""
    repo = str(instance["repo"])
    if repo.startswith("/") or ".." in repo.split("/"):
        raise BenchmarkError(f"SWE-bench instance {instance['instance_id']}: repo {repo!r} is not owner/name")
    return GitCheckoutSeed(
        repo,
        str(instance["base_commit"]),
        repo_candidates(repos_dir, repo),
        repos_dir,
        REPO_DIR,
        where=f"SWE-bench instance {instance['instance_id']}",
    )


def swe_tasks(instances: Sequence[dict[str, Any]], repos_dir: Path | None = None) -> list[BenchmarkTask]:
    """The instances as tasks; with `repos_dir`, each starts from its repository at its base commit."""
    return [
        BenchmarkTask(
            SWE,
            f"swe_{row['instance_id']}",
            index,
            swe_instruction(row),
            seed=None if repos_dir is None else swe_seed(row, repos_dir),
        )
        for index, row in enumerate(instances)
    ]


def read_patch(workspace: Path | None, base_commit: str | None = None) -> str:
    """The agent's patch: the change of ``repo/`` against `base_commit` (see the module docstring), else
    ``model.patch``; empty when there is neither."""
    if workspace is None:
        return ""
    repo = workspace / REPO_DIR
    if base_commit and (repo / ".git").is_dir():
        diff = _diff_against(repo, base_commit)
        if diff.strip():
            return diff
    return workspace_text(workspace / PATCH_FILE)


def _diff_against(repo: Path, base_commit: str) -> str:
    """``git add -A; git diff --cached <base>`` on a scratch copy of the index (the workspace stays as it is);
    empty when git cannot say (the agent removed the commit, or ``.git``)."""
    environ = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}
    with tempfile.TemporaryDirectory(prefix="mass-swe-index-") as scratch:
        index = Path(scratch) / "index"
        if (repo / ".git" / "index").is_file():
            shutil.copyfile(repo / ".git" / "index", index)
        env = {**environ, "GIT_INDEX_FILE": str(index)}
        # The workspace came out of an archive: whoever owns it, it is this grading's own copy.
        base = ["git", "-c", f"safe.directory={repo}", "-c", "core.hooksPath=/dev/null", "-C", str(repo)]
        for command in (["add", "-A"], ["diff", "--cached", "--no-color", "--no-ext-diff", base_commit, "--"]):
            result = subprocess.run(
                [*base, *command], capture_output=True, text=True, env=env, timeout=300, check=False
            )
            if result.returncode != 0:
                return ""
        return result.stdout


def grader_job(instance: dict[str, Any], patch: str) -> GraderJob:
    """The instance's grading run: apply the patch as the harness does (git apply, then patch), run its eval script."""
    from swebench.harness.constants import APPLY_PATCH_FAIL, APPLY_PATCH_PASS
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(instance)
    script = "\n".join(
        [
            f"echo '{RESULT_BEGIN}'",
            "cd /testbed",
            f"if git apply --verbose {GRADER_PATCH} || git apply --verbose --reject {GRADER_PATCH} "
            f"|| patch --batch --fuzz=5 -p1 -i {GRADER_PATCH}; then echo '{APPLY_PATCH_PASS}'; "
            f"else echo '{APPLY_PATCH_FAIL}'; echo '{RESULT_END}'; exit 0; fi",
            f"bash {GRADER_EVAL} 2>&1",
            f"echo '{RESULT_END}'",
        ]
    )
    return GraderJob(
        SWE,
        instance["instance_id"],
        spec.image,
        script,
        {GRADER_PATCH: patch.encode(), GRADER_EVAL: spec.eval_script.encode()},
        timeout_s=GRADER_TIMEOUT_S,
    )


def grade_log(instance: dict[str, Any], patch: str, log: str) -> tuple[float, dict[str, Any]]:
    """Score and details of one instance from its grader log, by `swebench`'s own grading."""
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(instance)
    prediction = {
        "instance_id": instance["instance_id"],
        "model_name_or_path": MODEL_NAME,
        "model_patch": patch or None,
    }
    with tempfile.TemporaryDirectory(prefix="mass-swe-") as scratch:
        path = Path(scratch) / "test_output.txt"
        path.write_text(result_section(log, f"SWE-bench {instance['instance_id']}") if patch else "", "utf-8")
        report = get_eval_report(spec, prediction, str(path), include_tests_status=True)[instance["instance_id"]]
    return (1.0 if report["resolved"] else 0.0), {"report": report, "evaluator": evaluator_version()}


@dataclass(frozen=True)
class SWEBench:
    """The SWE-bench Verified adapter over a dataset folder (see the module docstring); `repos`: the folder of
    clones or bare mirrors, ``<root>/repos`` when not given."""

    root: Path
    name: str = SWE
    needs_container: bool = True
    repos: Path | None = None

    @property
    def repos_dir(self) -> Path:
        return self.repos if self.repos is not None else self.root / REPOS_DIR

    def instances(self) -> list[dict[str, Any]]:
        return load_swe_instances(self.root)

    def tasks(self) -> list[BenchmarkTask]:
        return swe_tasks(self.instances(), self.repos_dir)

    def evaluator(self) -> str:
        return evaluator_version()

    def grade(self, task: BenchmarkTask, workspace: Path | None, runner: Any) -> tuple[float, dict[str, Any]]:
        instance = next(row for row in self.instances() if f"swe_{row['instance_id']}" == task.name)
        patch = read_patch(workspace, str(instance["base_commit"]))
        if not patch.strip():
            return grade_log(instance, "", "")
        return grade_log(instance, patch, runner.run(grader_job(instance, patch)))
