"""Terminal-Bench 2.0 adapter: tasks in Harbor's task format from a user-provided folder, graded by each task's
own verifier in the task's image.

Nothing is downloaded: one directory per task (``instruction.md``, ``task.toml``, ``environment/``, ``tests/``).
The agent starts with the files the task image's final stage copies into its working directory (`environment_seed`),
never ``tests/`` or ``solution/``. Grading follows Harbor's verifier contract: ``bash /tests/test.sh`` in a container
from the task's image writes the reward. Format, seed limits and grading: docs/public-benchmarks.md
(`mass_ops.evaluation.benchmarks.tb2`).
"""

from __future__ import annotations

import fnmatch
import io
import math
import posixpath
import shlex
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.evaluation.benchmarks.errors import BenchmarkError
from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END, GraderJob, result_section
from mass_ops.evaluation.benchmarks.scoring import BenchmarkTask, load_json
from mass_ops.evaluation.benchmarks.seeds import FileSeed

TB2 = "tb2"
EVALUATOR = "terminal-bench 2.0 task verifier (Harbor task format, tests/test.sh)"
WORKDIR = "/app"
WORKSPACE_TAR = "/tmp/mass_workspace.tar"
DEFAULT_AGENT_TIMEOUT_S = 900.0
DEFAULT_VERIFIER_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class TB2Task:
    """One task directory, read."""

    name: str
    path: Path
    instruction: str
    image: str
    agent_timeout_s: float
    verifier_timeout_s: float
    cpus: float | None
    memory: str | None


def _number(table: dict[str, Any], key: str, default: float | None, where: str) -> float | None:
    value = table.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise BenchmarkError(f"{where}: {key} = {value!r} is not a positive number")
    return float(value)


def _seconds(table: dict[str, Any], key: str, default: float, where: str) -> float:
    seconds = _number(table, key, default, where)
    return default if seconds is None else seconds


def load_tb2_task(path: Path, image_prefix: str = "") -> TB2Task:
    """Read one Harbor task directory; `image_prefix` names the registry holding prebuilt task images when the
    task.toml names none (image ``<prefix><task name>``)."""
    where = f"Terminal-Bench task {path.name}"
    instruction = path / "instruction.md"
    toml_path = path / "task.toml"
    if not instruction.is_file() or not toml_path.is_file() or not (path / "tests" / "test.sh").is_file():
        raise BenchmarkError(f"{where}: needs instruction.md, task.toml and tests/test.sh in {path}")
    try:
        config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise BenchmarkError(f"{toml_path}: not valid TOML ({exc})") from None
    environment = config.get("environment") or {}
    image = str(environment.get("docker_image") or (f"{image_prefix}{path.name}" if image_prefix else ""))
    if not image:
        raise BenchmarkError(f"{toml_path}: [environment] docker_image is missing and no image prefix was given")
    memory_mb = _number(environment, "memory_mb", None, str(toml_path))
    return TB2Task(
        name=path.name,
        path=path,
        instruction=instruction.read_text(encoding="utf-8"),
        image=image,
        agent_timeout_s=_seconds(config.get("agent") or {}, "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, str(toml_path)),
        verifier_timeout_s=_seconds(
            config.get("verifier") or {}, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, str(toml_path)
        ),
        cpus=_number(environment, "cpus", None, str(toml_path)),
        memory=f"{int(memory_mb)}m" if memory_mb else None,
    )


def load_tb2_tasks(root: str | Path, image_prefix: str = "") -> list[TB2Task]:
    folder = Path(root)
    dirs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "task.toml").exists()) if folder.is_dir() else []
    if not dirs:
        raise BenchmarkError(f"Terminal-Bench 2.0: {folder} holds no task directories (each with a task.toml)")
    return [load_tb2_task(p, image_prefix) for p in dirs]


# --- the agent's starting files: what the task image's Dockerfile copies into its working directory --------------


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuation lines joined."""
    joined: list[str] = []
    pending = ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending.strip():
        joined.append(pending)
    result = []
    for line in joined:
        keyword, _, rest = line.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def _copy_arguments(rest: str) -> tuple[list[str], list[str]] | None:
    """(flags, paths) of a COPY/ADD instruction (shell or JSON form); None when it cannot be read."""
    try:
        words = load_json(rest, "a COPY instruction") if rest.startswith("[") else shlex.split(rest)
    except ValueError:  # BenchmarkError too: an InputError is a ValueError
        return None
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        return None
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    return (flags, paths) if len(paths) >= 2 else None


def _dockerignore(context: Path) -> list[tuple[bool, str]]:
    """The context's .dockerignore as (exclude?, pattern) in order (a later match wins, as in Docker)."""
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    rules = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip().lstrip("/"))
        rules.append((not negate, pattern))
    return rules


def _ignored(relative: str, rules: list[tuple[bool, str]]) -> bool:
    """Whether the context path `relative` is left out of the build context (a pattern matches it or a parent)."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for exclude, pattern in rules:
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            ignored = exclude
    return ignored


def _sources(context: Path, pattern: str) -> list[Path]:
    """The context paths a COPY source names (wildcards expanded), never outside the context."""
    relative = posixpath.normpath(pattern.lstrip("/"))
    if relative == ".":
        return [context]
    if relative.startswith("..") or any(c in pattern for c in "$"):
        return []
    matches = sorted(context.glob(relative)) if any(c in relative for c in "*?[") else [context / relative]
    root = context.resolve()
    return [m for m in matches if m.exists() and m.resolve().is_relative_to(root)]


def environment_files(task_dir: Path) -> dict[str, Path]:
    """What the final stage of ``environment/Dockerfile`` copies into the image's working directory, as
    workspace-relative path → context file (later copies win, as later layers do); empty without a Dockerfile."""
    context = task_dir / "environment"
    dockerfile = context / "Dockerfile"
    if not dockerfile.is_file():
        return {}
    rules = _dockerignore(context)
    workdir = "/"
    copies: list[tuple[list[Path], str, bool]] = []  # (sources, absolute destination, destination is a folder)
    for keyword, rest in _instructions(dockerfile.read_text(encoding="utf-8", errors="replace")):
        if keyword == "FROM":
            workdir, copies = "/", []  # only the final stage is the image
        elif keyword == "WORKDIR" and rest:
            workdir = posixpath.normpath(posixpath.join(workdir, rest.strip().strip('"')))
        elif keyword in ("COPY", "ADD"):
            parsed = _copy_arguments(rest)
            if parsed is None or any(flag.startswith("--from") for flag in parsed[0]):
                continue
            *sources, dest = parsed[1]
            if any("://" in source or source.startswith("git@") for source in sources):
                continue
            as_folder = dest.endswith("/") or len(sources) > 1
            target = posixpath.normpath(posixpath.join(workdir, dest))
            copies.append(([p for source in sources for p in _sources(context, source)], target, as_folder))
    root = workdir  # the final WORKDIR: where the agent works, and the verifier unpacks its workspace
    files: dict[str, Path] = {}
    for found, target, as_folder in copies:
        for origin in found:
            if origin.is_dir():
                entries = [(p, p.relative_to(origin).as_posix()) for p in sorted(origin.rglob("*"))]
                placed = [(p, posixpath.join(target, rel)) for p, rel in entries]
            else:
                into = target if not (as_folder or origin == context) else posixpath.join(target, origin.name)
                placed = [(origin, into)]
            for path, destination in placed:
                if not path.is_file() or path.is_symlink():
                    continue
                if _ignored(path.relative_to(context).as_posix(), rules):
                    continue
                inside = posixpath.relpath(destination, root)
                if inside.startswith("..") or inside == ".":
                    continue  # copied elsewhere in the image: not the agent's working directory
                files[inside] = path
    return files


def environment_seed(task: TB2Task) -> FileSeed | None:
    """The task's starting files (`environment_files`) as a workspace seed; None when its image copies none."""
    files = environment_files(task.path)
    if not files:
        return None
    return FileSeed(tuple(sorted(files.items())), f"Terminal-Bench task {task.name} environment")


def parse_reward(text: str, where: str) -> float:
    """The verifier's reward: a bare number (reward.txt) or ``{"reward": x}`` (reward.json)."""
    text = text.strip()
    try:
        value = load_json(text, where)
    except BenchmarkError:
        raise BenchmarkError(f"{where}: reward {text[:80]!r} is neither a number nor JSON") from None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BenchmarkError(f"{where}: reward {value!r} is not a finite number")
    return float(value)


def _tar(folder: Path | None, arcroot: str = ".") -> bytes:
    """The folder's regular files as a tar that depends on their paths, contents and executable bits only (no
    times or owners): the same workspace materialized twice gives the same bytes, so a grader job keeps its
    identity between the process that prepares it and the one that reads its result (`suite.job_sha256`)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        if folder is not None:
            for path in sorted(folder.rglob("*")):
                if path.is_file() and not path.is_symlink():
                    info = tarfile.TarInfo(f"{arcroot}/{path.relative_to(folder).as_posix()}")
                    info.size, info.mtime = path.stat().st_size, 0
                    info.mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
                    with path.open("rb") as handle:
                        archive.addfile(info, handle)
    return buffer.getvalue()


def grader_job(task: TB2Task, workspace: Path | None) -> GraderJob:
    """The verifier run: workspace into /app, tests into /tests, test.sh, then the reward between the markers."""
    files = {WORKSPACE_TAR: _tar(workspace)}
    for path in sorted((task.path / "tests").rglob("*")):
        if path.is_file():
            files[f"/tests/{path.relative_to(task.path / 'tests')}"] = path.read_bytes()
    script = "\n".join(
        [
            f"mkdir -p {WORKDIR} /logs/verifier && tar -xf {WORKSPACE_TAR} -C {WORKDIR}",
            f"cd {WORKDIR} && bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
            "tail -c 20000 /logs/verifier/test-stdout.txt",
            f"echo '{RESULT_BEGIN}'",
            "if [ -s /logs/verifier/reward.txt ]; then cat /logs/verifier/reward.txt; "
            "elif [ -s /logs/verifier/reward.json ]; then cat /logs/verifier/reward.json; else echo 0; fi",
            f"echo '{RESULT_END}'",
        ]
    )
    return GraderJob(TB2, task.name, task.image, script, files, task.verifier_timeout_s, task.cpus, task.memory)


@dataclass(frozen=True)
class TerminalBench2:
    """The Terminal-Bench 2.0 adapter over a folder of Harbor task directories."""

    root: Path
    image_prefix: str = ""
    name: str = TB2
    needs_container: bool = True

    def load(self) -> list[TB2Task]:
        return load_tb2_tasks(self.root, self.image_prefix)

    def tasks(self) -> list[BenchmarkTask]:
        return [
            BenchmarkTask(
                TB2, f"tb2_{t.name}", index, t.instruction, time_limit_s=t.agent_timeout_s, seed=environment_seed(t)
            )
            for index, t in enumerate(self.load())
        ]

    def evaluator(self) -> str:
        return EVALUATOR

    def grade(self, task: BenchmarkTask, workspace: Path | None, runner: Any) -> tuple[float, dict[str, Any]]:
        item = next(t for t in self.load() if f"tb2_{t.name}" == task.name)
        log = runner.run(grader_job(item, workspace))
        reward = parse_reward(result_section(log, f"Terminal-Bench task {item.name}"), f"task {item.name}")
        return reward, {"reward": reward, "evaluator": EVALUATOR}
