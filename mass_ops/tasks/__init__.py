"""Task catalogue (our 12 synthetic research tasks) and the MASS-format task-directory importer."""

from mass_ops.tasks.catalogue import (
    CatalogueProvenance,
    Task,
    TaskCatalogue,
    TaskSplits,
    UnknownTaskError,
    builtin_catalogue_dir,
)
from mass_ops.tasks.importer import (
    MAX_TASK_FILE_BYTES,
    TaskFormatError,
    TaskImportError,
    import_task_dir,
    load_catalogue,
    validate_task_dir,
)

__all__ = [
    "MAX_TASK_FILE_BYTES",
    "CatalogueProvenance",
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
