"""`MetadataRepository`: the one class callers use, composed from the per-aggregate record classes."""

from __future__ import annotations

from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository.budget_spend import BudgetRecords
from mass_ops.store.repository.calls import CallRecords
from mass_ops.store.repository.cycles import CycleRecords
from mass_ops.store.repository.datasets import DatasetRecords
from mass_ops.store.repository.episodes import EpisodeRecords
from mass_ops.store.repository.generations import GenerationRecords
from mass_ops.store.repository.references import ArtifactReferences
from mass_ops.store.repository.selection import SelectionRecords
from mass_ops.store.repository.training import TrainingRecords
from mass_ops.store.repository.workflows import WorkflowRecords


class MetadataRepository(
    CycleRecords,
    WorkflowRecords,
    EpisodeRecords,
    CallRecords,
    SelectionRecords,
    DatasetRecords,
    TrainingRecords,
    GenerationRecords,
    BudgetRecords,
    ArtifactReferences,
):
    """Typed, idempotent access to the metadata tables of one `MetadataStore`."""

    @classmethod
    def from_url(cls, url: str) -> MetadataRepository:
        return cls(MetadataStore(url))

    def __repr__(self) -> str:
        return f"MetadataRepository({self.store!r})"
