"""The export stage: merge the selected adapter into the parent (BF16) and quantise it block-wise (FP8) (MASS_SPEC §9),
published at `models.next_bf16` / `models.next_fp8` with the inputs they came from in their manifests.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.stages.common import PostTrainingError, refuse_remote
from mass_ops.stages.train import select_checkpoint
from mass_ops.store.model_folders import (
    ModelManifest,
    fetch_model,
    publish_model,
    read_manifest,
    resolve_model_location,
)
from mass_ops.train.checkpoints import (
    LORA_STATE_FILE,
)


def _provenance(ctx: CycleContext, selected: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs an exported model is a function of; a target published from other inputs is refused."""
    config = ctx.config
    parent = resolve_model_location(ctx.artifacts, config.models.parent_bf16)
    parent_manifest = read_manifest(ctx.artifacts, config.models.parent_bf16)
    checkpoint_manifest = read_manifest(ctx.artifacts, selected["checkpoint"])
    adapter = checkpoint_manifest.file(LORA_STATE_FILE) if checkpoint_manifest else None
    if adapter is None:
        raise PostTrainingError(f"export: checkpoint {selected['checkpoint']} has no published {LORA_STATE_FILE}")
    reference: dict[str, Any] | None = None
    if config.models.fp8_reference:
        ref_manifest = read_manifest(ctx.artifacts, config.models.fp8_reference)
        reference = {
            "uri": resolve_model_location(ctx.artifacts, config.models.fp8_reference).uri,
            "manifest_sha256": ref_manifest.digest() if ref_manifest else None,
        }
    return {
        "cycle": ctx.cycle_name,
        "parent": {"uri": parent.uri, "manifest_sha256": parent_manifest.digest() if parent_manifest else None},
        "checkpoint": {"uri": selected["checkpoint"], "step": selected["step"], "adapter_sha256": adapter.sha256},
        "lora_r": config.training.lora_r,
        "lora_alpha": config.training.lora_alpha,
        "fp8_reference": reference,
    }


def export_targets(config: CycleConfig) -> dict[str, str]:
    # BF16 is always published: it is the next cycle's training parent and what the registry records.
    targets = {"bf16": config.models.next_bf16}
    if "fp8" in config.export.formats:
        targets["fp8"] = config.models.next_fp8
    return targets


def _restate(record: Path, **fields: Any) -> None:
    """Replace local paths in a merge/quantisation record by the URIs they stand for (the scratch folder is gone)."""
    data = json.loads(record.read_text())
    data.update(fields)
    record.write_text(json.dumps(data, indent=2) + "\n")


def export(config: CycleConfig) -> dict[str, Any]:
    """Merge the selected adapter into the parent (→ models.next_bf16) and quantise it to block FP8 (→ next_fp8).

    A target already published from the same inputs is kept (rerun = no-op); a target holding any other model is
    refused before anything is written. Returns {bf16_uri, fp8_uri, checkpoint_step, checkpoint_uri, reused}.
    """
    refuse_remote(config, "export")
    selected = select_checkpoint(config)
    ctx = attach_cycle(config)
    provenance = _provenance(ctx, selected)
    targets = export_targets(config)
    locations = {fmt: resolve_model_location(ctx.artifacts, location) for fmt, location in targets.items()}
    done: dict[str, ModelManifest] = {}
    for fmt, location in targets.items():
        manifest = read_manifest(ctx.artifacts, location)
        if manifest is None:
            continue
        if manifest.metadata.get("provenance") != provenance:
            raise PostTrainingError(
                f"export: {locations[fmt].uri} already holds a model that was not exported from checkpoint step "
                f"{selected['step']} of cycle {ctx.cycle_name} and parent {provenance['parent']['uri']}; refusing to "
                f"overwrite it (set models.next_{fmt} to a new location)"
            )
        done[fmt] = manifest
    result = {
        "bf16_uri": locations["bf16"].uri,
        "fp8_uri": locations["fp8"].uri if "fp8" in locations else None,
        "checkpoint_step": selected["step"],
        "checkpoint_uri": selected["checkpoint"],
        "reused": len(done) == len(targets),
    }
    if result["reused"]:
        return result

    from mass_ops.export import export_fp8, merge_and_export_fp8, merge_lora
    from mass_ops.export.fp8 import QUANT_INFO_NAME
    from mass_ops.export.merge import MERGE_INFO_NAME
    from mass_ops.export.tensor_parallel import check_fp8_tensor_parallel

    tp = config.inference.effective_tensor_parallel_size

    with tempfile.TemporaryDirectory(prefix="mass-export-") as scratch_name:
        scratch = Path(scratch_name)
        bf16_dir = scratch / "bf16"
        fp8_due = "fp8" in targets and "fp8" not in done
        reference_dir = None
        if fp8_due and config.models.fp8_reference:
            reference_dir = fetch_model(ctx.artifacts, config.models.fp8_reference, scratch / "fp8_reference")
        merge_record = {"base": provenance["parent"]["uri"], "lora": f"{selected['checkpoint']}/{LORA_STATE_FILE}"}
        if "bf16" in done:
            if "fp8" in targets:
                bf16_dir = fetch_model(ctx.artifacts, targets["bf16"], bf16_dir)
            if fp8_due:
                check_fp8_tensor_parallel(bf16_dir, tp, reference_dir=reference_dir)
                export_fp8(bf16_dir, scratch / "fp8", reference_dir=reference_dir)
        else:
            parent_dir = fetch_model(ctx.artifacts, config.models.parent_bf16, scratch / "parent")
            adapter_dir = fetch_model(
                ctx.artifacts, selected["checkpoint"], scratch / "adapter", include=lambda n: n == LORA_STATE_FILE
            )
            adapter = adapter_dir / LORA_STATE_FILE
            r, alpha = config.training.lora_r, config.training.lora_alpha
            if fp8_due:
                # Merging keeps every shape: the parent tells whether the FP8 model loads, before anything is written.
                check_fp8_tensor_parallel(parent_dir, tp, reference_dir=reference_dir)
                # One pass reads the parent once and writes both models (the same bytes as merging, then quantising).
                merge_and_export_fp8(
                    parent_dir, adapter, bf16_dir, scratch / "fp8", r=r, alpha=alpha, reference_dir=reference_dir
                )
                _restate(scratch / "fp8" / MERGE_INFO_NAME, **merge_record)
            else:
                merge_lora(parent_dir, adapter, bf16_dir, r=r, alpha=alpha)
            _restate(bf16_dir / MERGE_INFO_NAME, **merge_record)
            publish_model(
                ctx.artifacts, targets["bf16"], bf16_dir, metadata={"format": "bf16", "provenance": provenance}
            )
        if fp8_due:
            reference = provenance["fp8_reference"]
            _restate(
                scratch / "fp8" / QUANT_INFO_NAME, src=result["bf16_uri"], ref=reference["uri"] if reference else None
            )
            publish_model(
                ctx.artifacts, targets["fp8"], scratch / "fp8", metadata={"format": "fp8", "provenance": provenance}
            )
    return result
