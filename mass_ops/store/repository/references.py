"""Every artifact URI the metadata rows point to, for `mass_ops.store.gc`."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    RepositoryBase,
)
from mass_ops.store.schema import (
    Checkpoint,
    Comparison,
    Dataset,
    Episode,
    Evaluation,
    LLMCall,
    ModelGeneration,
    TrainingRun,
    WorkflowVersion,
)


class ArtifactReferences(RepositoryBase):
    """Reads the URI columns of every table."""

    def artifact_uris(self) -> dict[str, str | None]:
        """Every artifact URI a row points to, with the SHA-256 recorded for it (None where none was).

        Covers the URI columns of every table and the values of `Episode.artifacts`. A URI may name a prefix (a
        dataset's shards, a training run's output folder, a model folder): `mass_ops.store.gc` treats everything
        under it as referenced.
        """
        columns: list[tuple[Any, Any]] = [
            (LLMCall.prompt_uri, LLMCall.prompt_sha256),
            (LLMCall.result_uri, LLMCall.result_sha256),
            (WorkflowVersion.prompt_uri, WorkflowVersion.prompt_sha256),
            (Comparison.rationale_uri, Comparison.rationale_sha256),
            (Dataset.uri, sa.null()),
            (TrainingRun.log_uri, TrainingRun.log_sha256),
            (TrainingRun.output_uri, sa.null()),
            (Checkpoint.uri, Checkpoint.sha256),
            (ModelGeneration.bf16_uri, ModelGeneration.bf16_sha256),
            (ModelGeneration.fp8_uri, ModelGeneration.fp8_sha256),
            (Evaluation.results_uri, Evaluation.results_sha256),
        ]
        found: dict[str, str | None] = {}
        with self.store.read() as session:
            for uri_column, sha_column in columns:
                for uri, sha256 in session.execute(sa.select(uri_column, sha_column).where(uri_column.is_not(None))):
                    found[uri] = found.get(uri) or sha256
            rows = session.execute(
                sa.select(Episode.artifacts, Episode.artifact_sha256).where(Episode.artifacts.is_not(None))
            )
            for artifacts, hashes in rows:
                for name, uri in (artifacts or {}).items():
                    if isinstance(uri, str):
                        found[uri] = found.get(uri) or (hashes or {}).get(name)
        return found
