"""`mass-ops demo`: one MASS cycle on the embedded default, on a laptop CPU.

It builds a tiny Qwen3-architecture model with random weights and the real Qwen3 tokenizer, publishes it as L0 in a
local artifact folder, serves it with `transformers serve`, and runs the cycle's stages in order with the `demo`
preset: RHI search, teacher collection, ranking, selection, render, ZeRO-3 LoRA training on CPU, checkpoint
selection, BF16 merge + FP8 export, registration of L1, and the report. A random model's outputs are noise: the
demo shows that every part is real and connected, not that the model improves.

The stages run in-process here; the same stage functions are what the Airflow DAG's tasks call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from mass_ops import stages
from mass_ops.config import CycleConfig, load_config

# transformers serve lists a model under the path it was given, so the demo serves it from a path relative to the
# working directory and uses that path as the served name.
DEMO_MODEL_DIR = "runs/demo/models/L0-bf16"
DEMO_STORAGE = ["storage.metadata_url=sqlite:///runs/demo/mass-ops.db", "storage.artifact_url=runs/demo/artifacts"]


def demo_config(overrides: list[str] | None = None) -> CycleConfig:
    """The demo preset pointed at `runs/demo/` and at the locally served tiny model."""
    return load_config("demo", [*DEMO_STORAGE, f"models.served_name={DEMO_MODEL_DIR}", *(overrides or [])])


def prepare_parent(config: CycleConfig) -> Path:
    """Build the tiny L0 (idempotent) and publish it to the artifact store under `models.parent_bf16`."""
    from mass_ops.model_store import publish_model
    from mass_ops.models.tiny import build_tiny_qwen3
    from mass_ops.store.artifacts import open_artifact_store

    model_dir = build_tiny_qwen3(Path(DEMO_MODEL_DIR), max_position_embeddings=config.inference.context_window_tokens)
    publish_model(open_artifact_store(config.storage.artifact_url), config.models.parent_bf16, model_dir)
    return model_dir


def run_demo(config: CycleConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the whole demo cycle; returns where the report and the new model are, and the wall-clock per stage."""
    console = console or Console()
    timings: dict[str, float] = {}
    started = time.monotonic()

    def step(name: str, call: Callable[[], Any]) -> Any:
        console.rule(f"[bold]{name}")
        t0 = time.monotonic()
        result = call()
        timings[name] = round(time.monotonic() - t0, 1)
        console.print(f"{name}: done in {timings[name]} s", markup=False)
        return result

    step("build and publish the tiny L0 model", lambda: prepare_parent(config))
    step("validate_config", lambda: stages.validate_config(config))
    step("inference_up (transformers serve)", lambda: stages.inference_up(config))
    try:
        step("RHI search", lambda: stages.search(config))
        step("teacher collection", lambda: stages.collect(config))
        step("ranking", lambda: stages.rank(config))
        step("selection", lambda: stages.select(config))
    finally:
        step("inference_down", lambda: stages.inference_down(config))
    step("render", lambda: stages.render(config))
    step("train (DeepSpeed ZeRO-3 on CPU)", lambda: stages.train(config))
    step("select_checkpoint", lambda: stages.select_checkpoint(config))
    exported = step("export (BF16 merge + FP8)", lambda: stages.export(config))
    registered = step("register", lambda: stages.register(config))
    report = step("report", lambda: stages.report(config))
    total = round(time.monotonic() - started, 1)
    return {
        "report": report["html"],
        "report_markdown": report["markdown"],
        "generation": registered,
        "export": exported,
        "timings_s": timings,
        "total_s": total,
    }
