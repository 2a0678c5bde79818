"""What a benchmark task's agent finds in its workspace when it starts (ISSUE #18): the inputs the benchmark gives.

An adapter describes each task's inputs as a `SeedSource` on its `BenchmarkTask` (`seed`): SWE-bench Verified the
instance's repository checked out at its ``base_commit`` (`GitCheckoutSeed`, from the user's folder of clones or
bare mirrors), Terminal-Bench 2.0 the environment files its task image puts in the agent's working directory,
DSBench a question's data files, ScienceAgentBench an instance's dataset folder (`FileSeed`). Nothing is downloaded.

`store_seed` writes a source into a scratch folder, archives it as the store's deterministic tar.gz
(`store.artifacts.write_tarball`: sorted entries, no times or owners), and stores it once under its SHA-256
(`runtime.episode.workspace_seed_key`); the episode request carries its URI and SHA-256
(`EpisodeRequest.workspace_seed`) and the runner extracts it, checked, into the fresh workspace before the agent
starts. A task without inputs has no seed (its agent starts in an empty workspace, as before). `check_seeds` runs
every task's `check` — a missing repository or commit, a missing dataset folder: one line — before any agent time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks.errors import BenchmarkError
from mass_ops.runtime.episode import SEED_MAX_BYTES, SEED_MAX_ENTRIES, WorkspaceSeed, workspace_seed_key
from mass_ops.store.artifacts import file_sha256, write_tarball
from mass_ops.store.untrusted import ARCHIVE_LIMITS

GIT_TIMEOUT_S = 600  # packing a large repository's base commit once, single-threaded
# git with no user or system configuration (hooks, templates, filters): the seed depends on the commit alone.
_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}


class SeedSource(Protocol):
    """A task's starting files, as its benchmark gives them."""

    def check(self) -> None:
        """Raise `BenchmarkError` (one line) when the inputs are not there; cheap, runs before any agent time."""
        ...

    def write(self, dest: Path) -> None:
        """Write the files into the empty folder `dest` (the workspace's root)."""
        ...


# --- files ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileSeed:
    """Files copied into the workspace: (workspace-relative POSIX path, source file) pairs; `what` names them in
    errors. Executable bits are kept (the tarball keeps 0755/0644)."""

    files: tuple[tuple[str, Path], ...]
    what: str

    def check(self) -> None:
        missing = [str(source) for _, source in self.files if not source.is_file()]
        if missing:
            raise BenchmarkError(
                f"{self.what}: {missing[0]} is missing ({len(missing)} file(s)); nothing is downloaded"
            )

    def write(self, dest: Path) -> None:
        self.check()
        for relative, source in self.files:
            target = dest / relative
            if not _inside(dest, target):
                raise BenchmarkError(f"{self.what}: {relative!r} would lie outside the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            if source.stat().st_mode & 0o111:
                target.chmod(0o755)


@dataclass(frozen=True)
class FolderSeed:
    """A dataset folder copied into the workspace under `prefix` (its regular files; links are not followed)."""

    folder: Path
    prefix: str
    what: str

    def check(self) -> None:
        if not self.folder.is_dir():
            raise BenchmarkError(
                f"{self.what}: {self.folder} is not a folder; put the dataset there (nothing is downloaded)"
            )

    def write(self, dest: Path) -> None:
        self.check()
        FileSeed(folder_files(self.folder, self.prefix), self.what).write(dest)


def folder_files(folder: Path, prefix: str = "") -> tuple[tuple[str, Path], ...]:
    """Every regular file under `folder` (links are not followed), placed under `prefix` in the workspace."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            relative = path.relative_to(folder).as_posix()
            found.append((f"{prefix.rstrip('/')}/{relative}" if prefix else relative, path))
    return tuple(found)


def _inside(root: Path, path: Path) -> bool:
    return os.path.normpath(path).startswith(os.path.normpath(root) + os.sep)


# --- a git checkout at a commit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GitCheckoutSeed:
    """The repository `repo` (``owner/name``) checked out at `commit` in the workspace folder `folder`, from the
    first of `candidates` that is a clone or bare mirror (`repos_dir` names where they were looked for).

    What the agent gets is what ``git clone`` + ``git checkout <commit>`` would show it — the files, a ``.git`` whose
    HEAD is `commit` (``git diff <commit>``, ``git status`` and ``git log -1`` work) — but shallow: only the commit's
    own objects, in one pack built single-threaded and without reusing the mirror's deltas, and an index without
    stat data, so the same commit gives the same bytes whatever the mirror's packing (and no later commit, such as
    the fix, is in the agent's history)."""

    repo: str
    commit: str
    candidates: tuple[Path, ...]
    repos_dir: Path
    folder: str = "repo"
    where: str = field(default="", compare=False)

    def git_dir(self) -> Path:
        """The git directory holding `commit`; BenchmarkError (one line) when no candidate has it."""
        for candidate in self.candidates:
            if not candidate.exists():
                continue
            found = _git(["-C", str(candidate), "rev-parse", "--absolute-git-dir"], check=False)
            if found.returncode != 0:
                continue
            git_dir = Path(found.stdout.decode().strip())
            has = _git(["--git-dir", str(git_dir), "cat-file", "-e", f"{self.commit}^{{commit}}"], check=False)
            if has.returncode != 0:
                raise BenchmarkError(
                    f"{self.where or self.repo}: repository {candidate} has no commit {self.commit}; update that "
                    "clone or mirror (nothing is downloaded)"
                )
            return git_dir
        names = ", ".join(c.relative_to(self.repos_dir).as_posix() for c in self.candidates)
        raise BenchmarkError(
            f"{self.where or self.repo}: no clone or bare mirror of {self.repo} under {self.repos_dir} (looked for "
            f"{names}); put one there (nothing is downloaded)"
        )

    def check(self) -> None:
        self.git_dir()

    def write(self, dest: Path) -> None:
        source = self.git_dir()
        work = dest / self.folder
        git_dir = work / ".git"
        pack_dir = git_dir / "objects" / "pack"
        pack_dir.mkdir(parents=True)
        (git_dir / "refs" / "heads").mkdir(parents=True)
        (git_dir / "refs" / "tags").mkdir()
        (git_dir / "HEAD").write_text(f"{self.commit}\n")
        (git_dir / "config").write_text(
            "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = false\n"
        )
        commit = _git(["--git-dir", str(source), "rev-parse", f"{self.commit}^{{commit}}"]).stdout.decode().strip()
        parents = _git(["--git-dir", str(source), "rev-list", "--parents", "-n", "1", commit]).stdout.split()
        if len(parents) > 1:
            (git_dir / "shallow").write_text(f"{commit}\n")  # its parents are not in the seed
        if commit != self.commit:
            (git_dir / "HEAD").write_text(f"{commit}\n")
        objects = _git(["--git-dir", str(source), "rev-list", "--objects", "--no-walk", commit]).stdout
        staged = pack_dir / "seed.pack"
        with staged.open("wb") as out:
            subprocess.run(
                [
                    *("git", "--git-dir", str(source), "pack-objects", "--threads=1", "--no-reuse-delta"),
                    *("--no-reuse-object", "-q", "--stdout"),
                ],
                input=objects,
                stdout=out,
                stderr=subprocess.PIPE,
                env={**os.environ, **_GIT_ENV},
                timeout=GIT_TIMEOUT_S,
                check=True,
            )
        name = _git(["--git-dir", str(git_dir), "index-pack", str(staged)]).stdout.decode().split()[-1]
        for suffix in (".pack", ".idx", ".rev"):
            made = staged.with_suffix(suffix)
            if made.exists():
                made.rename(pack_dir / f"pack-{name}{suffix}")
        # The index from the tree alone (no stat data: the same bytes every time), then the files from it.
        inside = {"GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(work)}
        _git(["read-tree", commit], env=inside)
        _git(["checkout-index", "--all", "--force"], env=inside, cwd=work)


def _git(
    args: Sequence[str], *, check: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    try:
        result = subprocess.run(
            ["git", *args],
            capture_output=True,
            env={**os.environ, **_GIT_ENV, **(env or {})},
            cwd=cwd,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise BenchmarkError("benchmark workspace seed: git is not installed here") from None
    if check and result.returncode != 0:
        problem = result.stderr.decode(errors="replace").strip().splitlines() or ["no output"]
        raise BenchmarkError(f"benchmark workspace seed: `git {' '.join(args)}` failed: {problem[-1]}")
    return result


# --- storing ----------------------------------------------------------------------------------------------------


def check_seeds(sources: Sequence[SeedSource | None]) -> None:
    """Every task's inputs are there (BenchmarkError, one line, for the first missing one)."""
    for source in sources:
        if source is not None:
            source.check()


def store_seed(ctx: CycleContext, source: SeedSource | None) -> WorkspaceSeed | None:
    """The source archived and stored once under its SHA-256 (None: no source, or no files — an empty workspace).
    BenchmarkError (one line) when its inputs are missing or it exceeds what the runner would extract."""
    if source is None:
        return None
    with tempfile.TemporaryDirectory(prefix="mass-seed-") as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        source.write(tree)
        if not any(tree.iterdir()):
            return None
        entries = sum(1 for _ in tree.rglob("*"))
        size = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
        if entries > SEED_MAX_ENTRIES or size > SEED_MAX_BYTES:
            raise BenchmarkError(
                f"benchmark workspace seed: {entries} entries, {size} bytes is more than the runner extracts "
                f"({SEED_MAX_ENTRIES} entries, {SEED_MAX_BYTES} bytes)"
            )
        archive = Path(scratch) / "seed.tar.gz"
        with archive.open("wb") as out:
            write_tarball(tree, out)
        if size > ARCHIVE_LIMITS.budget(archive.stat().st_size):
            raise BenchmarkError(
                f"benchmark workspace seed: {size} bytes from a {archive.stat().st_size}-byte archive is more per "
                f"archive byte than the runner extracts ({ARCHIVE_LIMITS.max_ratio:g})"
            )
        sha256, _ = file_sha256(archive)
        key = workspace_seed_key(ctx.cycle_name, sha256)
        if not ctx.artifacts.exists(key):
            ctx.artifacts.put_file(key, archive)
        return WorkspaceSeed(ctx.artifacts.uri(key), sha256)
