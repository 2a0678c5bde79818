"""The demo's task logs in the Airflow UI's Logs tab.

`mass-ops demo` runs its tasks in its own process (`dag.test()`), whose output goes to one file,
`runs/demo/logs/demo-*.log`; Airflow's log reader (the API server's Logs tab) looks for one file per task try under
`[logging] base_log_folder`, by the log filename template of the run. `TaskLogFiles` is an Airflow listener that
notes where in the demo's log each task try starts and ends and writes that slice to the file the reader looks for,
as soon as the try ends (success, failure or skip; a deferred try continues where it left off when it resumes).

Only the slice is copied, never the whole log: the demo's log stays the complete record.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow.sdk._shared.listeners import hookimpl

log = logging.getLogger(__name__)

# Colour codes a console renderer may have written: the Logs tab shows text.
_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")

# (dag_id, run_id, task_id, map_index, try_number): one log file of Airflow's reader.
TryKey = tuple[str, str, str, int, int]


def _key(task_instance: Any) -> TryKey:
    return (
        str(task_instance.dag_id),
        str(task_instance.run_id),
        str(task_instance.task_id),
        int(task_instance.map_index if task_instance.map_index is not None else -1),
        int(task_instance.try_number),
    )


def reader_log_file(key: TryKey) -> Path:
    """Where Airflow's log reader looks for this try's log: `base_log_folder` / the run's filename template, rendered
    by the reader's own handler (so a changed template or folder is followed)."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.log.log_reader import TaskLogReader
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_id, run_id, task_id, map_index, try_number = key
    handler = TaskLogReader().log_handler
    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
            )
        ).one()
        relative = handler._render_filename(ti, try_number, session=session)
    return Path(handler.local_base) / relative


@dataclass(eq=False)  # pluggy tells listeners apart by identity
class TaskLogFiles:
    """Listener: copies each task try's slice of `source` (the file this process's output goes to) to the file
    Airflow's log reader reads. Register with `install`, end with `finish` (writes what is still open)."""

    source: Path
    open_tries: dict[TryKey, int] = field(default_factory=dict)
    written: list[Path] = field(default_factory=list)

    def _offset(self) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            return self.source.stat().st_size
        except FileNotFoundError:
            return 0

    @hookimpl
    def on_task_instance_running(self, previous_state: Any, task_instance: Any) -> None:
        # A try resumed after deferral keeps its first offset: one file holds the whole try.
        self.open_tries.setdefault(_key(task_instance), self._offset())

    @hookimpl
    def on_task_instance_success(self, previous_state: Any, task_instance: Any) -> None:
        self._close(_key(task_instance))

    @hookimpl
    def on_task_instance_failed(self, previous_state: Any, task_instance: Any, error: Any) -> None:
        self._close(_key(task_instance))

    @hookimpl
    def on_task_instance_skipped(self, previous_state: Any, task_instance: Any) -> None:
        self._close(_key(task_instance))

    def _close(self, key: TryKey) -> None:
        start = self.open_tries.pop(key, None)
        if start is None:
            return
        end = self._offset()
        try:
            target = reader_log_file(key)
            with open(self.source, "rb") as handle:
                handle.seek(start)
                text = _ANSI.sub(b"", handle.read(max(0, end - start)))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text)
        except Exception as exc:  # a log copy must never fail the task it describes
            log.warning("could not copy the log of %s to Airflow's log folder: %s", key, exc)
            return
        self.written.append(target)

    def install(self) -> TaskLogFiles:
        """Register with the task SDK's listener manager (what `dag.test()`'s in-process task runner calls)."""
        from airflow.sdk.listener import get_listener_manager

        get_listener_manager().add_listener(self)
        return self

    def finish(self) -> list[Path]:
        """Write the tries still open (a deferred try never resumed, a run stopped midway), unregister; returns
        every file written."""
        from airflow.sdk.listener import get_listener_manager

        for key in list(self.open_tries):
            self._close(key)
        manager = get_listener_manager()
        if manager.pm.is_registered(self):
            manager.pm.unregister(self)
        return self.written
