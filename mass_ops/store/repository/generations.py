"""Registered model generations with their lineage, and the evaluations that compare them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import aliased

from mass_ops.store.repository.base import (
    RepositoryBase,
    _document,
    _sha256,
)
from mass_ops.store.schema import (
    Evaluation,
    ModelGeneration,
    utcnow,
)


class GenerationRecords(RepositoryBase):
    """Rows of `model_generations` and `evaluations`."""

    def register_generation(
        self,
        name: str,
        generation: int,
        *,
        bf16_uri: str,
        fp8_uri: str | None = None,
        parent_id: int | None = None,
        cycle_id: int | None = None,
        checkpoint_id: int | None = None,
        served_name: str | None = None,
        lineage: Mapping[str, Any] | None = None,
        bf16_sha256: str | None = None,
        fp8_sha256: str | None = None,
    ) -> ModelGeneration:
        """Register model `name` (L0 base: no parent/cycle). Re-registering with other weights or parent conflicts.

        `bf16_sha256` / `fp8_sha256`: SHA-256 of each model's ``manifest.json`` (`ModelManifest.digest`'s bytes as
        stored), which pins every file of the model.
        """
        values = {
            "generation": generation,
            "bf16_uri": bf16_uri,
            "fp8_uri": fp8_uri,
            "parent_id": parent_id,
            "cycle_id": cycle_id,
            "checkpoint_id": checkpoint_id,
            "served_name": served_name,
            "lineage": _document(lineage, "lineage"),
            "registered_at": utcnow(),
            "bf16_sha256": _sha256(bf16_sha256, "model bf16_sha256"),
            "fp8_sha256": _sha256(fp8_sha256, "model fp8_sha256"),
        }
        return self._record(
            ModelGeneration,
            {"name": name},
            values,
            must_match=("generation", "bf16_uri", "fp8_uri", "parent_id", "bf16_sha256", "fp8_sha256"),
        )

    def get_generation(self, name: str) -> ModelGeneration | None:
        return self._one(sa.select(ModelGeneration).where(ModelGeneration.name == name))

    def latest_generation(self) -> ModelGeneration | None:
        """The highest generation registered (the latest registration among equals)."""
        return self._one(
            sa.select(ModelGeneration)
            .order_by(
                ModelGeneration.generation.desc(), ModelGeneration.registered_at.desc(), ModelGeneration.id.desc()
            )
            .limit(1)
        )

    def cycle_generations(self, cycle_id: int) -> list[ModelGeneration]:
        """The generations a cycle registered, in the order they were registered."""
        return self._all(
            sa.select(ModelGeneration).where(ModelGeneration.cycle_id == cycle_id).order_by(ModelGeneration.id)
        )

    def lineage(self, generation_id: int) -> list[ModelGeneration]:
        """The generation and its ancestors, newest first, down to the base model (one recursive query)."""
        chain = (
            sa.select(ModelGeneration.id, ModelGeneration.parent_id, sa.literal(0).label("depth"))
            .where(ModelGeneration.id == generation_id)
            .cte("chain", recursive=True)
        )
        parent = aliased(ModelGeneration)
        chain = chain.union_all(
            sa.select(parent.id, parent.parent_id, (chain.c.depth + 1).label("depth")).join(
                chain, parent.id == chain.c.parent_id
            )
        )
        statement = sa.select(ModelGeneration).join(chain, ModelGeneration.id == chain.c.id).order_by(chain.c.depth)
        return self._all(statement)

    def record_evaluation(
        self,
        key: str,
        kind: str,
        *,
        generation_id: int,
        results: Mapping[str, Any],
        baseline_generation_id: int | None = None,
        cycle_id: int | None = None,
        results_uri: str | None = None,
        results_sha256: str | None = None,
    ) -> Evaluation:
        """A finished evaluation; `results_sha256` is the hash the document at `results_uri` was published with."""
        values = {
            "kind": kind,
            "generation_id": generation_id,
            "baseline_generation_id": baseline_generation_id,
            "cycle_id": cycle_id,
            "results": _document(results, "evaluation results"),
            "results_uri": results_uri,
            "results_sha256": _sha256(results_sha256, "evaluation results_sha256"),
        }
        return self._record(
            Evaluation, {"key": key}, values, must_match=("kind", "generation_id", "baseline_generation_id")
        )

    def evaluations(
        self, *, generation_id: int | None = None, kind: str | None = None, cycle_id: int | None = None
    ) -> list[Evaluation]:
        """Evaluations in the order they were recorded: those of (or against) `generation_id`, of `kind`, written
        by `cycle_id`; each filter left None matches all."""
        statement = sa.select(Evaluation).order_by(Evaluation.id)
        if cycle_id is not None:
            statement = statement.where(Evaluation.cycle_id == cycle_id)
        if generation_id is not None:
            statement = statement.where(
                sa.or_(Evaluation.generation_id == generation_id, Evaluation.baseline_generation_id == generation_id)
            )
        if kind is not None:
            statement = statement.where(Evaluation.kind == kind)
        return self._all(statement)
