"""Repository layer: idempotent recording of units of work and the queries the stages need (docs/repository.md).

Every ``record_*`` / ``ensure_*`` / ``register_*`` method is one transaction that yields exactly one row per unit
key, however often or concurrently it is called; a differing defining field raises `UnitConflictError`. Methods
return detached rows: callers never hold a session. `MetadataRepository` is the one class callers use.

Modules: `base` (errors, value checks, session handling, the insert-once helper; imports no sibling), one module of
record methods per aggregate — `cycles`, `workflows` (RHI search), `episodes` (+ leases), `calls` (LLM calls +
comparisons), `selection` (rankings + selections), `datasets` (+ windows), `training` (runs + checkpoints),
`generations` (+ evaluations), `budget_spend`, `references` (artifact URIs for gc) — and `metadata_repository`,
which composes them.
"""

from mass_ops.store.repository.base import (
    ConfigChangedError,
    InvalidRecordError,
    TaskId,
    UnitConflictError,
    UsageTotal,
)
from mass_ops.store.repository.datasets import WINDOW_FIELDS, WindowGroup
from mass_ops.store.repository.metadata_repository import MetadataRepository

__all__ = [
    "WINDOW_FIELDS",
    "ConfigChangedError",
    "InvalidRecordError",
    "MetadataRepository",
    "TaskId",
    "UnitConflictError",
    "UsageTotal",
    "WindowGroup",
]
