"""What a person watching `mass-ops demo` sees: a live table of the DAG run instead of Airflow's task-runner logs.

One line per stage (a top-level task or task group of `mass_cycle`; the per-task `inner_loop` group shows its three
phases — search, collection, ranking — as three lines) with its task instances counted by state, the
unit running now with its running time, the stage's elapsed time and an ETA; Airflow's own records go to a log file
(`redirected_output`). On a terminal that is not a TTY (CI, a pipe) the table would be noise: one plain line per
finished task instance is printed instead. The model (`DemoProgress`) takes snapshots of the run's task instances
from any source, so it renders from a scripted sequence in tests; `airflow_snapshots` reads them from Airflow's
database (another thread polls it while `dag.test()` runs in this one).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table

# The view's state columns; Airflow's states fold into them (`COLUMN_OF`).
COLUMNS = ("queued", "running", "success", "failed", "skipped")
COLUMN_OF = {
    None: "queued",
    "none": "queued",
    "scheduled": "queued",
    "queued": "queued",
    "up_for_retry": "queued",
    "up_for_reschedule": "queued",
    "restarting": "queued",
    "running": "running",
    "deferred": "running",  # waiting on a trigger (a server's readiness): still this unit's time
    "success": "success",
    "failed": "failed",
    "upstream_failed": "failed",
    "skipped": "skipped",
    "removed": "skipped",
}
FINISHED = frozenset({"success", "failed", "skipped"})
DEMO_LOG_DIR = Path("runs/demo/logs")


def clock(seconds: float | None) -> str:
    """`mm:ss`, or `h:mm:ss` from an hour on; `—` for None."""
    if seconds is None:
        return "—"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


INNER_LOOP = "inner_loop"  # mass_cycle's group mapped per task: search steps, then collect_task, then rank_task
INNER_LOOP_PHASES = ("collect_task", "rank_task")
# The task number in a rendered label of the inner loop ("search-t51-v2", "collection-t51 (3 candidates)").
TASK_IN_LABEL = re.compile(r"(?:^|[-\s])t(\d+)\b")


def stage_of(task_id: str) -> str:
    """The line a task instance counts in: its top-level task or group; the inner loop's search steps as one line
    (`inner_loop.search`) and its collection and ranking as one line each."""
    group, _, member = task_id.partition(".")
    if group != INNER_LOOP or not member:
        return group
    return f"{group}.{member if member in INNER_LOOP_PHASES else 'search'}"


@dataclass(frozen=True)
class TaskSnapshot:
    """One task instance of the run as the database holds it at one moment."""

    task_id: str
    map_index: int = -1
    state: str | None = None
    started: datetime | None = None
    ended: datetime | None = None
    label: str | None = None  # the rendered map index (`map_index_template`), e.g. "t51 c2"

    @property
    def stage(self) -> str:
        return stage_of(self.task_id)

    @property
    def column(self) -> str:
        return COLUMN_OF.get(self.state, "queued")

    @property
    def finished(self) -> bool:
        return self.column in FINISHED

    @property
    def name(self) -> str:
        if self.map_index < 0:
            return self.task_id
        return f"{self.task_id}[{self.label or f'#{self.map_index}'}]"

    @property
    def key(self) -> tuple[str, int]:
        return self.task_id, self.map_index

    def seconds(self, now: datetime) -> float | None:
        if self.started is None:
            return None
        return ((self.ended or now) - self.started).total_seconds()


@dataclass(frozen=True)
class StageLine:
    """One stage's counts and times at one moment."""

    stage: str
    counts: Mapping[str, int]
    current: str
    elapsed_s: float | None
    eta_s: float | None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> bool:
        return self.total > 0 and sum(self.counts[c] for c in FINISHED) == self.total


def task_labels(snapshots: Iterable[TaskSnapshot]) -> list[TaskSnapshot]:
    """The inner loop's instances named by their task alone (``inner_loop.step_v3[t51]``), the same for every member
    of the group: Airflow renders a label only for an instance that ran, so a skipped step would otherwise show its
    bare map index beside its siblings' rendered labels. The task of a map index is read from any sibling's label."""
    snapshots = list(snapshots)
    tasks: dict[int, str] = {}
    for ti in snapshots:
        found = TASK_IN_LABEL.search(ti.label or "") if ti.task_id.startswith(f"{INNER_LOOP}.") else None
        if found and ti.map_index >= 0:
            tasks[ti.map_index] = found.group(1)
    return [
        replace(ti, label=f"t{tasks[ti.map_index]}")
        if ti.task_id.startswith(f"{INNER_LOOP}.") and ti.map_index in tasks
        else ti
        for ti in snapshots
    ]


def stage_line(stage: str, instances: Sequence[TaskSnapshot], now: datetime) -> StageLine:
    """Counts by column, the running unit(s), elapsed since the stage's first start and an ETA.

    ETA: the mean duration of the stage's finished instances × its unfinished ones ÷ the instances running at once
    (at least 1); None until one instance has finished.
    """
    counts = {c: 0 for c in COLUMNS}
    for ti in instances:
        counts[ti.column] += 1
    running = [ti for ti in instances if ti.column == "running"]
    current = ", ".join(f"{ti.name} {clock(ti.seconds(now))}" for ti in running[:2])
    if len(running) > 2:
        current += f" +{len(running) - 2}"
    starts = [ti.started for ti in instances if ti.started is not None]
    elapsed = None
    if starts:
        unfinished = any(not ti.finished for ti in instances)
        ends = [ti.ended for ti in instances if ti.ended is not None]
        end = now if unfinished or not ends else max(ends)
        elapsed = (end - min(starts)).total_seconds()
    durations = [s for ti in instances if ti.finished and (s := ti.seconds(now)) is not None]
    left = sum(1 for ti in instances if not ti.finished)
    eta = None
    if left and durations:
        eta = sum(durations) / len(durations) * left / max(1, len(running))
    elif instances and not left:
        eta = 0.0
    return StageLine(stage, counts, current, elapsed, eta)


class DemoProgress:
    """The live state of one DAG run, fed snapshots by `update` (any thread) and rendered by Rich (`__rich__`)."""

    def __init__(
        self,
        *,
        order: Iterable[str] = (),
        started: datetime | None = None,
        log_path: Path | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._order: dict[str, int] = {}
        for task_id in order:
            self._order.setdefault(stage_of(task_id), len(self._order))
        self._now = now
        self.started = started or now()
        self.log_path = log_path
        self._lock = threading.Lock()
        self._instances: dict[tuple[str, int], TaskSnapshot] = {}
        self._reported: set[tuple[str, int]] = set()

    def update(self, snapshots: Iterable[TaskSnapshot]) -> list[TaskSnapshot]:
        """Take the newest snapshot of the run; returns the instances that finished since the last call."""
        fresh = {ti.key: ti for ti in task_labels(snapshots)}
        with self._lock:
            self._instances = fresh
            newly = [ti for key, ti in fresh.items() if ti.finished and key not in self._reported]
            self._reported.update(ti.key for ti in newly)
        return sorted(newly, key=lambda ti: (ti.ended or self.started, ti.name))

    def instances(self) -> list[TaskSnapshot]:
        with self._lock:
            return list(self._instances.values())

    def lines(self, now: datetime | None = None) -> list[StageLine]:
        now = now or self._now()
        by_stage: dict[str, list[TaskSnapshot]] = {}
        for ti in self.instances():
            by_stage.setdefault(ti.stage, []).append(ti)
        stages = sorted(by_stage, key=lambda s: (self._order.get(s, len(self._order)), s))
        return [stage_line(stage, by_stage[stage], now) for stage in stages]

    def table(self, now: datetime | None = None) -> Table:
        now = now or self._now()
        lines = self.lines(now)
        instances = self.instances()
        finished = sum(ti.finished for ti in instances)
        elapsed = (now - self.started).total_seconds()
        eta = elapsed * (len(instances) - finished) / finished if finished else None
        caption = f"elapsed {clock(elapsed)} · {finished}/{len(instances)} task instances finished"
        if eta:
            caption += f" · ETA ~{clock(eta)}"
        if self.log_path is not None:
            caption += f" · Airflow logs: {self.log_path}"
        table = Table(title="mass_cycle DAG run", caption=caption, caption_justify="left", expand=False)
        table.add_column("stage", no_wrap=True)
        for column in COLUMNS:
            table.add_column(column, justify="right")
        table.add_column("now running", overflow="ellipsis", no_wrap=True, max_width=48)
        table.add_column("elapsed", justify="right")
        table.add_column("ETA", justify="right")
        styles = {"running": "bold yellow", "success": "green", "failed": "bold red", "skipped": "dim"}
        for line in lines:
            cells = [
                f"[{styles[c]}]{line.counts[c]}[/]" if line.counts[c] and c in styles else str(line.counts[c] or "")
                for c in COLUMNS
            ]
            eta_cell = "done" if line.done else clock(line.eta_s)
            # Labels such as "[t51 c2]" would read as Rich markup: escape the names.
            table.add_row(escape(line.stage), *cells, escape(line.current), clock(line.elapsed_s), eta_cell)
        return table

    def __rich__(self) -> RenderableType:
        return self.table()


def finished_line(ti: TaskSnapshot, now: datetime | None = None) -> str:
    """The plain line of one finished task instance (non-TTY mode): time, state, name, duration."""
    when = (ti.ended or now or datetime.now(UTC)).astimezone().strftime("%H:%M:%S")
    seconds = ti.seconds(now or datetime.now(UTC))
    duration = f"{seconds:.1f} s" if seconds is not None else "not run"
    return f"{when} {ti.state or 'none':<15} {ti.name} ({duration})"


# ---------------------------------------------------------------------------------------------------------------------
# Watching a run: polling Airflow's database from a second thread


class RunWatcher(threading.Thread):
    """Polls `fetch` every `interval_s` and feeds `progress`; `on_finished` gets each newly finished instance.

    A failed poll (SQLite busy while the run commits) is skipped: the next one sees the same rows.
    """

    def __init__(
        self,
        fetch: Callable[[], list[TaskSnapshot] | None],
        progress: DemoProgress,
        *,
        on_finished: Callable[[TaskSnapshot], None] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        super().__init__(name="demo-run-watcher", daemon=True)
        self._fetch, self._progress, self._on_finished = fetch, progress, on_finished
        self._interval_s = interval_s
        self._halt = threading.Event()

    def poll(self) -> None:
        try:
            snapshots = self._fetch()
        except Exception:  # a busy database must not end the demo; the next poll retries
            return
        if snapshots is None:
            return
        for ti in self._progress.update(snapshots):
            if self._on_finished is not None:
                self._on_finished(ti)

    def run(self) -> None:
        while not self._halt.wait(self._interval_s):
            self.poll()

    def stop(self) -> None:
        """Stop polling and take one last snapshot (so the last finished instances are reported)."""
        self._halt.set()
        self.join(timeout=10)
        self.poll()


def newest_run_id(dag_id: str) -> int:
    """The database id of the newest run of `dag_id` (0 when none): runs after it are the demo's."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == dag_id)) or 0


def airflow_snapshots(dag_id: str, after_run_id: int) -> list[TaskSnapshot] | None:
    """The task instances of the first run of `dag_id` newer than `after_run_id`; None before it exists."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.id > after_run_id).order_by(DagRun.id).limit(1)
        ).first()
        if run is None:
            return None
        rows = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)
        ).all()
        return [
            TaskSnapshot(
                task_id=ti.task_id,
                map_index=ti.map_index,
                state=str(ti.state) if ti.state else None,
                started=ti.start_date,
                ended=ti.end_date,
                label=ti.rendered_map_index if ti.map_index >= 0 else None,
            )
            for ti in rows
        ]


# ---------------------------------------------------------------------------------------------------------------------
# Where Airflow's records go


def new_log_path(log_dir: Path = DEMO_LOG_DIR, now: datetime | None = None) -> Path:
    """`runs/demo/logs/demo-YYYYmmdd-HHMMSS.log` (one file per demo run)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return log_dir / f"demo-{stamp}.log"


@contextlib.contextmanager
def redirected_output(log_path: Path) -> Iterator[TextIO]:
    """Send this process's stdout and stderr — file descriptors 1 and 2, so Python logging, Airflow's structured
    records, warnings and the output of child processes alike — to `log_path`; yields a stream on the original
    stdout for the live view. Both are restored on exit, also when the body raises."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield terminal
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        terminal.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        terminal.close()


# ---------------------------------------------------------------------------------------------------------------------
# The closing lines

# What the register and evaluate results hold that a person does not need at the end of the demo (database ids).
_HIDDEN = frozenset({"generation_id", "parent_id", "checkpoint_id"})
_LOCATIONS = frozenset({"bf16_uri", "fp8_uri", "results_uri", "uri"})


def _section(console: Console, title: str, data: Mapping[str, Any]) -> None:
    """A titled block of ``label: value`` lines; locations whole on their own line when they do not fit."""
    from mass_ops.console import human, label, print_path, print_prose

    print_prose(console, f"{title}:")
    for key, value in data.items():
        if key in _HIDDEN:
            continue
        if key == "win_rate" and value is None:
            print_prose(console, "  win rate: n/a (no decisive verdicts)")
        elif key in _LOCATIONS and value:
            print_path(console, f"  {label(key)}", str(value))
        else:
            print_prose(console, f"  {label(key)}: {human(value)}", hanging="      ")


def print_summary(console: Console, result: Mapping[str, Any]) -> None:
    """What `mass-ops demo` closes with, readable through a pipe at 80 columns: where the report and the logs are,
    the new model, the evaluation, the task instances by state, the wall-clock per stage, and the commands that
    inspect the cycle (each whole, folded only between its arguments)."""
    from mass_ops.console import Column, print_command, print_path, print_prose, print_table

    print_prose(console, "Report:")
    for what, key in (("HTML", "report"), ("Markdown", "report_markdown"), ("Airflow logs", "log")):
        if result.get(key):
            print_path(console, f"  {what}", str(result[key]))
    _section(console, "New model", result.get("generation") or {})
    _section(console, "Evaluation", result.get("evaluation") or {})
    states = ", ".join(f"{count} {state}" for state, count in (result.get("task_states") or {}).items())
    print_prose(console, f"Task instances of DAG run {result.get('run_id')}: {states or 'none'}")
    rows = [[stage, f"{seconds:,.1f}"] for stage, seconds in (result.get("timings_s") or {}).items()]
    rows.append(["total (the whole demo)", f"{result.get('total_s', 0):,.1f}"])
    print_table(console, "Wall-clock per stage", [Column("stage"), Column("seconds", numeric=True)], rows)
    commands = result.get("inspect") or []
    if commands:
        print_prose(console, "Inspect this cycle (from this folder):")
        for argv in commands:
            print_command(console, argv)
