"""The fault matrix: SIGKILL every writing stage at seeded random points, rerun it, and count the damage.

For each stage a clean reference run starts from a saved state (SQLite file + local artifact folder + server state
files) and runs `tests.hardening.stage_child` to its end; its duration sets the range of kill times. Each trial
restores the same state, starts the stage, kills its whole process group (a pod or machine dying takes the trainer's
ranks with it) at ``ready + U(0, duration)`` from a seeded RNG, reruns it to completion and compares the store with
the reference run's:

* lost: unit keys (a row's natural key per table, an artifact key) the reference has and the trial lacks, counted
  with multiplicity;
* duplicated: keys the trial holds more often than the reference (a unit recorded twice, a second attempt of a unit
  that had finished, an artifact no reference run wrote = orphaned);
* paid calls repeated: requests the scripted policy server (the parent's) answered more often in the trial than in
  the reference, counted by (model, messages, seed). A repeat whose first answer left the server before the kill was
  answered but not recorded in time (the ledger's window); the others were still in flight at the kill (a provider
  bills those too; nothing on the client side can save them).

Staging leftovers (``.partial/``, swept by `mass-ops store gc`) are counted apart: they are not units. The ledger's
window itself is measured on the reference runs: the time from the server's answer to the committed `llm_calls` row.

Chains share saved states: inner loop (search → collect → rank+select), post-training (render → train; export from
the render state plus a hand-made training run, so it does not need the slow trainer), evaluation (rollout →
evaluate, on generations L0 → L1 served by the same stand-in server).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.inner_loop_fakes import ScriptedPolicy, serve_policy
from tests.policy_server import ChatRequest, PolicyReply, PolicyServer

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_STAGES = ("search", "collect", "rank", "render", "train", "export", "rollout", "evaluate")
CHEAP_STAGES = ("search", "collect", "rank", "rollout", "evaluate")
JUDGE_MODEL = "gpt-judge"
JUDGE_KEY_ENV = "MASS_FAULT_MATRIX_JUDGE_KEY"
SERVED = ("policy-stand-in", JUDGE_MODEL, "served-L1", "served-L0")
# A child that neither finishes nor dies within this long fails the run (train is the slowest: a few minutes).
CHILD_TIMEOUT_S = 900.0

# The natural key of a row in each table: what makes it the same unit across runs (ids and times differ).
ROW_KEYS: dict[str, str] = {
    "cycles": "SELECT name FROM cycles",
    "cycle_tasks": "SELECT c.name || '/' || t.task_id FROM cycle_tasks t JOIN cycles c ON c.id = t.cycle_id",
    "llm_calls": "SELECT unit_key FROM llm_calls",
    "workflow_versions": "SELECT task_id || '/v' || version FROM workflow_versions",
    "episodes": "SELECT unit_key FROM episodes",
    "comparisons": "SELECT task_id || '/' || ledger || '/' || key FROM comparisons",
    "retained_workflows": "SELECT task_id FROM retained_workflows",
    "rankings": "SELECT e.unit_key FROM rankings r JOIN episodes e ON e.id = r.episode_id",
    "selections": "SELECT e.unit_key || '/' || s.split FROM selections s JOIN episodes e ON e.id = s.episode_id",
    "datasets": "SELECT split FROM datasets",
    "training_windows": (
        "SELECT d.split || '/' || w.position FROM training_windows w JOIN datasets d ON d.id = w.dataset_id"
    ),
    "training_runs": "SELECT key FROM training_runs",
    "checkpoints": "SELECT r.key || '/' || c.step FROM checkpoints c JOIN training_runs r ON r.id = c.run_id",
    "model_generations": "SELECT name FROM model_generations",
    "evaluations": "SELECT key FROM evaluations",
}
# Artifacts a resumed run writes by design (the record of the resume itself), never orphans.
RESUME_ARTIFACTS = ("/training/resume_log.jsonl",)
_HIDDEN = (".partial", ".meta", ".probe")


# -- what the store holds ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inventory:
    """Unit keys of the metadata store (``table:key``) and of the artifact store (``artifact:key``), with counts."""

    units: Counter[str]
    staging: int  # files in .partial/ and .probe/: puts a kill interrupted


def take_inventory(database: Path, artifacts: Path) -> Inventory:
    """Count every row by its natural key (tables without one: by count) and list every published artifact."""
    units: Counter[str] = Counter()
    with contextlib.closing(sqlite3.connect(database)) as db:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            if table == "alembic_version":
                continue
            query = ROW_KEYS.get(table, f"SELECT '#' FROM {table}")  # table names come from sqlite_master
            units.update(f"{table}:{key}" for (key,) in db.execute(query))
    staging = 0
    if artifacts.exists():
        for path in artifacts.rglob("*"):
            if not path.is_file():
                continue
            relative = path.relative_to(artifacts)
            if relative.parts[0] in _HIDDEN:
                staging += relative.parts[0] != ".meta"
                continue
            units[f"artifact:{relative.as_posix()}"] += 1
    return Inventory(units, staging)


@dataclass(frozen=True)
class Damage:
    """Keys lost and duplicated by a trial, against the reference (each key repeated by its count)."""

    lost: list[str]
    duplicated: list[str]


def compare(reference: Inventory, trial: Inventory, allowed_extra: Sequence[str] = RESUME_ARTIFACTS) -> Damage:
    """Lost: reference keys the trial holds fewer times; duplicated: keys the trial holds more often (keys no
    reference run wrote count in full: orphans), except artifacts ending in `allowed_extra`."""
    lost: list[str] = []
    duplicated: list[str] = []
    for key in sorted(set(reference.units) | set(trial.units)):
        difference = trial.units[key] - reference.units[key]
        if difference < 0:
            lost += [key] * -difference
        elif difference > 0 and not (key.startswith("artifact:") and key.endswith(tuple(allowed_extra))):
            duplicated += [key] * difference
    return Damage(lost, duplicated)


# -- what the provider was paid for ------------------------------------------------------------------------------------


def call_digest(model: str | None, messages: Any, seed: Any) -> str:
    """Identity of one paid call: the same model, messages and seed is the same call asked again."""
    text = json.dumps([model, messages, seed], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Answer:
    """One answer the stand-in server produced: when (wall clock and monotonic) and for which call."""

    wall: float
    monotonic: float
    digest: str


class CountingPolicy:
    """The inner-loop scripted policy, logging every answer it gives (called on the server's event loop)."""

    def __init__(self) -> None:
        self.base = ScriptedPolicy()
        self.answers: list[Answer] = []
        self._lock = threading.Lock()

    def respond(self, request: ChatRequest) -> PolicyReply:
        reply = self.base.respond(request)
        body = request.body
        answer = Answer(
            time.time(), time.monotonic(), call_digest(body.get("model"), body["messages"], body.get("seed"))
        )
        with self._lock:
            self.answers.append(answer)
        return reply

    def mark(self) -> int:
        with self._lock:
            return len(self.answers)

    def since(self, mark: int) -> list[Answer]:
        with self._lock:
            return list(self.answers[mark:])


@dataclass(frozen=True)
class Repeats:
    """Calls answered more often in a trial than in the reference run."""

    total: int
    answered_before_kill: int  # the ledger's window: answered, then killed before the row was committed
    unmatched: int  # trial calls the reference never made (evidence of an episode rerun after the kill differs)


def count_repeats(reference: Sequence[Answer], trial: Sequence[Answer], kill_at: float | None) -> Repeats:
    expected = Counter(answer.digest for answer in reference)
    seen: Counter[str] = Counter()
    total = before = unmatched = 0
    first_answer: dict[str, float] = {}
    for answer in trial:
        seen[answer.digest] += 1
        first_answer.setdefault(answer.digest, answer.monotonic)
        if answer.digest not in expected:
            unmatched += 1
        elif seen[answer.digest] > expected[answer.digest]:
            total += 1
            if kill_at is not None and first_answer[answer.digest] < kill_at:
                before += 1
    return Repeats(total, before, unmatched)


def ledger_windows(database: Path, artifacts: Path, answers: Sequence[Answer]) -> list[float]:
    """Seconds from the server's answer to the committed `llm_calls` row, for every recorded call of a run."""
    answered = {answer.digest: answer.wall for answer in answers}
    windows = []
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute("SELECT prompt_uri, created_at FROM llm_calls WHERE prompt_uri IS NOT NULL").fetchall()
    for prompt_uri, created_at in rows:
        path = Path(prompt_uri.removeprefix("file://"))
        if not path.is_file():
            path = artifacts / prompt_uri.split("/artifacts/", 1)[-1]
        request = json.loads(path.read_text())["request"]
        digest = call_digest(request.get("model"), request.get("messages"), request.get("seed"))
        if digest in answered:
            committed = datetime.fromisoformat(str(created_at)).replace(tzinfo=UTC).timestamp()
            windows.append(max(0.0, committed - answered[digest]))
    return windows


# -- one stage process -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildRun:
    killed: bool
    ready_at: float  # monotonic
    ended_at: float
    kill_at: float | None
    output: str

    @property
    def work_s(self) -> float:
        return self.ended_at - self.ready_at


def run_child(
    stage: str,
    config_file: Path,
    *,
    cwd: Path,
    latency_s: float,
    kill_after_s: float | None = None,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
) -> ChildRun:
    """Run `stage` in its own process group; SIGKILL the group `kill_after_s` after it is ready (None: let it end).
    A stage that fails (or ends when it was to be killed before) raises with its output."""
    command = [
        sys.executable,
        "-m",
        "tests.hardening.stage_child",
        stage,
        str(config_file),
        "--latency",
        str(latency_s),
    ]
    if workdir is not None:
        command += ["--workdir", str(workdir)]
    environment = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **(env or {}))
    log = cwd / f".{stage}-child.log"
    with log.open("w+") as out:
        process = subprocess.Popen(
            command, cwd=cwd, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        ready_at = _wait_ready(process, log, deadline)
        kill_at = None
        if kill_after_s is not None:
            kill_at = ready_at + kill_after_s
            while process.poll() is None and time.monotonic() < kill_at:
                time.sleep(0.002)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        ended_at = time.monotonic()
        _reap_group(process.pid)
        out.seek(0)
        output = out.read()
    killed = process.returncode == -signal.SIGKILL
    if not killed and process.returncode != 0:
        raise RuntimeError(f"stage {stage} exited with {process.returncode}:\n{output[-4000:]}")
    return ChildRun(killed, ready_at, ended_at, kill_at if killed else None, output)


def _wait_ready(process: subprocess.Popen[bytes], log: Path, deadline: float) -> float:
    while time.monotonic() < deadline:
        if "ready\n" in log.read_text(errors="replace"):
            return time.monotonic()
        if process.poll() is not None:
            raise RuntimeError(f"the stage process ended before it was ready:\n{log.read_text()[-4000:]}")
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"the stage process was not ready within {CHILD_TIMEOUT_S:.0f} s")


def _reap_group(pgid: int) -> None:
    """Kill what is left of the group (a trainer rank outliving its launcher) so trials never overlap."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# -- saved states and chains -------------------------------------------------------------------------------------------


@dataclass
class ChainState:
    """A chain's live folder (the stores the config names live here), its config file and saved states."""

    work: Path
    saved: Path
    config_file: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def database(self) -> Path:
        return self.work / "metadata.db"

    @property
    def artifacts(self) -> Path:
        return self.work / "artifacts"

    def save(self, name: str) -> None:
        target = self.saved / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.work, target, symlinks=True)

    def restore(self, name: str) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(self.saved / name, self.work, symlinks=True)


@dataclass(frozen=True)
class StageSpec:
    """A stage of a chain: the saved state it starts from, a setup applied to that state first, episode latency."""

    name: str
    chain: str
    base: str
    latency_s: float = 0.05
    setup: Callable[[ChainState], None] | None = None


def _write_config(state: ChainState, config: Any) -> None:
    state.config_file.write_text(json.dumps(config.model_dump(mode="json")))


def inner_chain(root: Path, endpoint: str) -> ChainState:
    """A cycle opened on the stand-in (2 tasks, 1 iteration, 3 candidates, rank 1 trains, 2 opponents)."""
    from tests.inner_loop_fakes import inner_loop_config, migrated_sqlite, open_test_cycle

    state = ChainState(root / "inner" / "work", root / "inner" / "saved", root / "inner" / "cycle.json")
    state.work.mkdir(parents=True)
    state.saved.mkdir(parents=True)
    config = inner_loop_config(
        endpoint=endpoint,
        metadata_url=migrated_sqlite(state.database),
        artifact_url=str(state.artifacts),
        iterations=1,
        candidates=3,
        train_ranks=1,
        opponents=2,
        require_beats_reference=False,
    )
    open_test_cycle(config)
    _write_config(state, config)
    state.save("opened")
    return state


def post_training_chain(root: Path, endpoint: str) -> ChainState:
    """The seeded post-training cycle of the stage tests (tiny Qwen3 parent, teacher episodes with proxy logs)."""
    from mass_ops.models.tiny import build_tiny_qwen3
    from tests.stages.test_post_training import seed_cycle

    base = root / "post"
    parent = build_tiny_qwen3(base / "parent" / "L0-bf16")
    state = ChainState(base / "work", base / "saved", base / "cycle.json")
    state.saved.mkdir(parents=True)
    seeded = seed_cycle(state.work, parent)
    _write_config(state, seeded.config)
    state.save("seeded")
    return state


def hand_made_training(state: ChainState) -> None:
    """The export stage's input without the slow trainer: LoRA checkpoints as the train stage leaves them."""
    from mass_ops.config import validate_config
    from mass_ops.context import attach_cycle
    from tests.stages.test_post_training import SeededCycle
    from tests.stages.test_post_training import hand_made_training as make

    config = validate_config(json.loads(state.config_file.read_text()))
    scratch = state.work / "scratch"
    make(SeededCycle(config, attach_cycle(config), scratch, {}), {0: 2.0, 2: 1.4, 4: 1.6})
    shutil.rmtree(scratch)


def evaluation_chain(root: Path, endpoint: str) -> ChainState:
    """A cycle evaluating L1 against L0 (both registered, both served by the stand-in), judged by one external
    OpenAI-compatible judge on the stand-in over three seeds and by L1's in-loop judge."""
    from mass_ops.config import validate_config
    from mass_ops.serving import evaluation_scope
    from tests.evaluation.fakes import record_local_server, register_generations
    from tests.inner_loop_fakes import inner_loop_config, migrated_sqlite, open_test_cycle

    state = ChainState(
        root / "eval" / "work",
        root / "eval" / "saved",
        root / "eval" / "cycle.json",
        env={JUDGE_KEY_ENV: "sk-fault-matrix-judge"},
    )
    state.work.mkdir(parents=True)
    state.saved.mkdir(parents=True)
    data = inner_loop_config(
        endpoint=endpoint, metadata_url=migrated_sqlite(state.database), artifact_url=str(state.artifacts)
    ).model_dump(mode="json")
    data["evaluation"].update(
        rollout_count=2,
        judge_seeds=[42, 43, 44],
        judges=[
            {
                "name": JUDGE_MODEL,
                "provider": "openai-compatible",
                "model": JUDGE_MODEL,
                "base_url": endpoint,
                "api_key_env": JUDGE_KEY_ENV,
                "reasoning_effort": "high",
                "max_tokens": 4096,
            }
        ],
    )
    config = validate_config(data)
    ctx = open_test_cycle(config)
    register_generations(ctx.repo)
    with _inside(state.work):  # local server state files live under the working directory
        for name in ("L1", "L0"):
            record_local_server(evaluation_scope(config), name, endpoint=endpoint, served_name=f"served-{name}")
    _write_config(state, config)
    state.save("opened")
    return state


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


CHAINS: dict[str, Callable[[Path, str], ChainState]] = {
    "inner": inner_chain,
    "post": post_training_chain,
    "eval": evaluation_chain,
}
SPECS: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("search", "inner", "opened", latency_s=0.05),
        StageSpec("collect", "inner", "search", latency_s=0.05),
        StageSpec("rank", "inner", "collect"),
        StageSpec("render", "post", "seeded"),
        StageSpec("train", "post", "render"),
        StageSpec("export", "post", "render", setup=hand_made_training),
        StageSpec("rollout", "eval", "opened", latency_s=0.05),
        StageSpec("evaluate", "eval", "rollout"),
        StageSpec("broken", "inner", "opened", latency_s=0.05),  # the matrix's own check: never in ALL_STAGES
    )
}


# -- the matrix --------------------------------------------------------------------------------------------------------


@dataclass
class StageLine:
    """One stage's row of the matrix."""

    stage: str
    kills: int = 0
    reruns: int = 0
    lost: int = 0
    duplicated: int = 0
    repeated: int = 0
    repeated_answered: int = 0
    unmatched: int = 0
    staging: int = 0
    clean_s: float = 0.0
    windows: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def add(self, damage: Damage, repeats: Repeats, staging: int) -> None:
        self.lost += len(damage.lost)
        self.duplicated += len(damage.duplicated)
        self.repeated += repeats.total
        self.repeated_answered += repeats.answered_before_kill
        self.unmatched += repeats.unmatched
        self.staging += staging
        found = [f"lost {key}" for key in damage.lost[:3]] + [f"duplicated {key}" for key in damage.duplicated[:3]]
        self.examples += found[: max(0, 6 - len(self.examples))]


class FaultMatrix:
    """Runs the matrix for the chosen stages against one scripted policy server (started by `open`)."""

    def __init__(self, root: Path, server: PolicyServer, policy: CountingPolicy, *, seed: int = 0) -> None:
        self.root = root
        self.server = server
        self.policy = policy
        self.rng = random.Random(seed)
        self.chains: dict[str, ChainState] = {}
        self.references: dict[str, tuple[Inventory, list[Answer], float]] = {}
        self.windows: dict[str, list[float]] = {}

    @property
    def endpoint(self) -> str:
        return f"{self.server.base_url}/v1"

    def chain(self, name: str) -> ChainState:
        if name not in self.chains:
            self.chains[name] = CHAINS[name](self.root, self.endpoint)
        return self.chains[name]

    def _start(self, spec: StageSpec) -> ChainState:
        """Restore the stage's starting state (running the stages before it once, cleanly, if needed)."""
        state = self.chain(spec.chain)
        if not (state.saved / spec.base).exists():
            self.reference(SPECS[spec.base])
        state.restore(spec.base)
        if spec.setup is not None:
            spec.setup(state)
        return state

    def _run(self, spec: StageSpec, state: ChainState, kill_after_s: float | None) -> ChildRun:
        workdir = state.work / "train-run" if spec.name == "train" else None
        return run_child(
            spec.name,
            state.config_file,
            cwd=state.work,
            latency_s=spec.latency_s,
            kill_after_s=kill_after_s,
            workdir=workdir,
            env=state.env,
        )

    def reference(self, spec: StageSpec) -> tuple[Inventory, list[Answer], float]:
        """The clean run of `spec` (once): its inventory, the answers it was given and its working time."""
        if spec.name not in self.references:
            state = self._start(spec)
            mark = self.policy.mark()
            run = self._run(spec, state, None)
            answers = self.policy.since(mark)
            inventory = take_inventory(state.database, state.artifacts)
            windows = ledger_windows(state.database, state.artifacts, answers)
            self.references[spec.name] = (inventory, answers, run.work_s)
            self.windows[spec.name] = windows
            state.save(spec.name)
        return self.references[spec.name]

    def trial(self, spec: StageSpec, kill_after_s: float) -> tuple[ChildRun, Damage, Repeats, int]:
        """Kill `spec` `kill_after_s` after it is ready, rerun it to the end, compare with the reference."""
        reference, reference_answers, _ = self.reference(spec)
        state = self._start(spec)
        mark = self.policy.mark()
        killed = self._run(spec, state, kill_after_s)
        self._run(spec, state, None)
        trial = take_inventory(state.database, state.artifacts)
        repeats = count_repeats(reference_answers, self.policy.since(mark), killed.kill_at)
        return killed, compare(reference, trial), repeats, trial.staging

    def stage(self, name: str, kills: int) -> StageLine:
        spec = SPECS[name]
        _, _, work_s = self.reference(spec)
        line = StageLine(name, clean_s=work_s, windows=list(self.windows.get(name, [])))
        for _ in range(kills):
            killed, damage, repeats, staging = self.trial(spec, self.rng.uniform(0.0, work_s))
            line.kills += killed.killed
            line.reruns += 1
            line.add(damage, repeats, staging)
        return line


@contextlib.contextmanager
def open_matrix(root: Path, *, seed: int = 0, server_latency_s: float = 0.02) -> Iterator[FaultMatrix]:
    """A fault matrix whose stages talk to one scripted policy server serving the in-loop model, the external
    judge and both evaluated generations (answers after `server_latency_s`, as a provider's take time)."""
    policy = CountingPolicy()
    with serve_policy(policy, models=SERVED, latency_s=server_latency_s) as server:
        yield FaultMatrix(root, server, policy, seed=seed)


# -- the printed table -------------------------------------------------------------------------------------------------


def format_lines(lines: Sequence[StageLine]) -> list[str]:
    """One line per stage and the totals; the ledger window (answer → committed row) over the reference runs."""
    header = (
        f"{'stage':<9} {'kills':>5} {'reruns':>6} {'lost':>5} {'dup':>4} {'paid calls repeated':>20} "
        f"{'(answered, unrecorded)':>22} {'staging left':>12} {'clean run s':>11}"
    )
    out = [header]
    for line in lines:
        out.append(
            f"{line.stage:<9} {line.kills:>5} {line.reruns:>6} {line.lost:>5} {line.duplicated:>4} "
            f"{line.repeated:>20} {line.repeated_answered:>22} {line.staging:>12} {line.clean_s:>11.2f}"
        )
    total = StageLine("total")
    for line in lines:
        for name in ("kills", "reruns", "lost", "duplicated", "repeated", "repeated_answered", "staging"):
            setattr(total, name, getattr(total, name) + getattr(line, name))
        total.clean_s += line.clean_s
        total.windows += line.windows
    out.append(
        f"{'total':<9} {total.kills:>5} {total.reruns:>6} {total.lost:>5} {total.duplicated:>4} "
        f"{total.repeated:>20} {total.repeated_answered:>22} {total.staging:>12} {total.clean_s:>11.2f}"
    )
    if total.windows:
        ordered = sorted(total.windows)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        out.append(
            f"ledger window (answer -> committed row) over {len(ordered)} calls: median "
            f"{statistics.median(ordered) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
        )
    unmatched = sum(line.unmatched for line in lines)
    if unmatched:
        out.append(
            f"note: {unmatched} trial call(s) had a prompt no reference call had (an episode rerun after the kill "
            "gives new evidence): new calls, not counted as repeats"
        )
    for line in lines:
        for example in line.examples:
            out.append(f"  {line.stage}: {example}")
    return out
