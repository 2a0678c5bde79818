"""The register stage: model generation L(k+1) with its parent L(k) and its lineage (config, trajectories,
comparisons, checkpoint).
"""

from __future__ import annotations

from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import attach_cycle
from mass_ops.stages.common import SPLITS, PostTrainingError
from mass_ops.stages.export import export_targets
from mass_ops.stages.train import finished_run, log_key, rendered_datasets
from mass_ops.store.model_folders import (
    MANIFEST_NAME,
    ModelLocation,
    read_manifest,
    resolve_model_location,
)
from mass_ops.store.schema import Ledger
from mass_ops.train.checkpoints import (
    SELECTION_FILE,
)


def _manifest_sha256(where: ModelLocation) -> str | None:
    """The hash of a model's manifest.json in the store (None for a local folder, which the store does not hold)."""
    if where.store is None or where.is_local_folder:
        return None
    info = where.store.info(where.key(MANIFEST_NAME))
    return info.sha256


def register(config: CycleConfig) -> dict[str, Any]:
    """Register L(generation+1) with its parent L(generation) (registered first as a base model when absent), its
    weights, checkpoint and lineage: config hash, datasets, selected episodes, comparison counts, checkpoint."""
    ctx = attach_cycle(config)
    g = config.generation
    parent_name, child_name = f"L{g}", f"L{g + 1}"
    selection_key = log_key(ctx.cycle_name, SELECTION_FILE)
    if not ctx.artifacts.exists(selection_key):
        raise PostTrainingError(f"register: cycle {ctx.cycle_name} has no selected checkpoint; run export first")
    selected = ctx.artifacts.get_json(selection_key)
    targets = export_targets(config)
    uris: dict[str, str] = {}
    hashes: dict[str, str | None] = {}  # SHA-256 of each model's manifest.json, which hashes every file
    export_record: dict[str, Any] | None = None
    for fmt, location in targets.items():
        manifest = read_manifest(ctx.artifacts, location)
        where = resolve_model_location(ctx.artifacts, location)
        uri = where.uri
        hashes[fmt] = _manifest_sha256(where)
        if manifest is None:
            raise PostTrainingError(f"register: no {fmt} model is published at {uri}; run export first")
        provenance = manifest.metadata.get("provenance") or {}
        if (
            provenance.get("cycle") != ctx.cycle_name
            or provenance.get("checkpoint", {}).get("uri") != selected["checkpoint"]
        ):
            raise PostTrainingError(
                f"register: the {fmt} model at {uri} was not exported by cycle {ctx.cycle_name} from its selected "
                f"checkpoint (step {selected['step']})"
            )
        uris[fmt] = uri
        export_record = provenance

    parent_uri = resolve_model_location(ctx.artifacts, config.models.parent_bf16).uri
    parent = ctx.repo.get_generation(parent_name)
    if parent is None:
        parent = ctx.repo.register_generation(
            parent_name,
            g,
            bf16_uri=parent_uri,
            served_name=config.models.served_name,
            lineage={"registered_as_base": True, "by_cycle": ctx.cycle_name, "location": config.models.parent_bf16},
        )
    elif parent.bf16_uri != parent_uri:
        raise PostTrainingError(
            f"register: {parent_name} is registered with weights {parent.bf16_uri}, but this cycle trained on "
            f"{parent_uri} (models.parent_bf16)"
        )

    datasets = rendered_datasets(ctx, "register")
    run = finished_run(ctx, "register")
    lineage = {
        "cycle": ctx.cycle_name,
        "config_hash": config.config_hash(),
        "preset": config.preset,
        "parent": {"name": parent_name, "bf16_uri": parent.bf16_uri},
        "datasets": {
            split: {"id": d.id, "uri": d.uri, "windows": d.windows, "loss_tokens": d.loss_tokens}
            for split, d in datasets.items()
        },
        "selected_episodes": {
            split: sorted(s.episode_id for s in ctx.repo.selections(ctx.cycle_id, split)) for split in SPLITS
        },
        "comparisons": {ledger.value: len(ctx.repo.comparisons(ctx.cycle_id, ledger.value)) for ledger in Ledger},
        "training_run": {"id": run.id, "key": run.key},
        "checkpoint": {
            "id": selected["checkpoint_id"],
            "step": selected["step"],
            "val_loss": selected["val_loss"],
            "uri": selected["checkpoint"],
            "criterion": selected["criterion"],
        },
        "export": export_record,
    }
    child = ctx.repo.register_generation(
        child_name,
        g + 1,
        bf16_uri=uris["bf16"],
        fp8_uri=uris.get("fp8"),
        bf16_sha256=hashes.get("bf16"),
        fp8_sha256=hashes.get("fp8"),
        parent_id=parent.id,
        cycle_id=ctx.cycle_id,
        checkpoint_id=selected["checkpoint_id"],
        served_name=child_name,
        lineage=lineage,
    )
    return {
        "generation": child.name,
        "generation_id": child.id,
        "parent": parent.name,
        "parent_id": parent.id,
        "bf16_uri": child.bf16_uri,
        "fp8_uri": child.fp8_uri,
        "checkpoint_id": child.checkpoint_id,
    }


def run_export(config: CycleConfig) -> list[dict[str, Any]]:
    """The `export` command: select the checkpoint, export BF16 and FP8, register the next generation."""
    from mass_ops.stages.export import export

    exported = export(config)
    registered = register(config)
    return [
        {"item": "checkpoint", "name": f"step {exported['checkpoint_step']}", "uri": exported["checkpoint_uri"]},
        {"item": "bf16", "name": registered["generation"], "uri": exported["bf16_uri"]},
        {"item": "fp8", "name": registered["generation"], "uri": exported["fp8_uri"]},
        {"item": "generation", "name": registered["generation"], "uri": f"parent {registered['parent']}"},
    ]
