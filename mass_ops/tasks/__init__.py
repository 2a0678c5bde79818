"""Task catalogue (our 12 synthetic research tasks) and the MASS-format task-directory importer."""

from mass_ops.tasks.catalogue import (
    Task,
    TaskCatalogue,
    TaskSplits,
    UnknownTaskError,
    builtin_catalogue_dir,
    load_catalogue,
)
from mass_ops.tasks.importer import TaskFormatError, TaskImportError, import_task_dir, validate_task_dir

__all__ = [
    "Task",
    "TaskCatalogue",
    "TaskFormatError",
    "TaskImportError",
    "TaskSplits",
    "UnknownTaskError",
    "builtin_catalogue_dir",
    "import_task_dir",
    "load_catalogue",
    "validate_task_dir",
]
