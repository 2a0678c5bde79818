"""Post-training stages on the embedded profile: SQLite + a local artifact folder + a tiny Qwen3 parent on CPU.

A cycle is seeded the way collection, ranking and selection leave it: two tasks, three teacher episodes each (ranks 1
and 2 → train, rank 3 → val), each with a realistic proxy log (orchestrator with the frozen teacher prompt, a
general-purpose worker, tool calls and results; short synthetic system prompts keep the windows small). The slow test
then runs render → train (2 ranks, gloo, ZeRO-3) → select_checkpoint → export → register for real, interrupts and
resumes training once, loads the FP8 generation in transformers and reruns every stage. The fast tests cover the
refusals and export/register from a hand-made adapter.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import CycleConfig, load_config
from mass_ops.context import CycleContext
from mass_ops.layout import EpisodeUnit, teacher_condition
from mass_ops.seeds import collection_seed
from mass_ops.stages.collect import freeze_teacher_prompt
from mass_ops.stages.common import PostTrainingError
from mass_ops.stages.export import export
from mass_ops.stages.register import register, run_export
from mass_ops.stages.render import render, run_render
from mass_ops.stages.train import select_checkpoint, train
from mass_ops.store.model_folders import MANIFEST_NAME, fetch_model, publish_model, read_manifest
from tests.inner_loop_fakes import migrated_sqlite, open_test_cycle
from tests.render.proxy_logs import (
    ORCHESTRATOR_SYSTEM,
    ORCHESTRATOR_TOOLS,
    WORKER_SYSTEM,
    WORKER_TOOLS,
    Agent,
    Call,
    ProxyLog,
    Reply,
    tool_output,
)

TASKS = (51, 202)
CANDIDATES = 3  # ranks 1-2 train, rank 3 validation
LORA_R, LORA_ALPHA = 8, 16
TABLES = ("datasets", "training_windows", "training_runs", "checkpoints", "model_generations")


# -- the seeded cycle -------------------------------------------------------------------------------------------------


def teacher_episode_log(teacher_prompt: str, task: int, seed: int) -> bytes:
    """A short teacher episode as the logging proxy records it (gzip JSONL): the orchestrator gets the teacher
    prompt, delegates the loader to a worker that runs a command, then verifies and finishes."""
    log = ProxyLog()
    orchestrator = Agent(log, ORCHESTRATOR_SYSTEM, teacher_prompt, ORCHESTRATOR_TOOLS)
    brief = f"Load the raw data of task {task} into data/raw.parquet and report the row count."
    delegate = Call(f"call_{seed}_o1", "agent", {"subagent_type": "general-purpose", "prompt": brief})
    orchestrator.turn(Reply(reasoning=f"Stage one of task {task}: the loader comes first.", calls=[delegate]))

    worker = Agent(log, WORKER_SYSTEM, brief, WORKER_TOOLS)
    command = Call(f"call_{seed}_w1", "run_shell_command", {"command": "uv run python load.py"})
    worker.turn(Reply(reasoning="Run the loader script.", calls=[command]))
    worker.results((command.id, tool_output(seed, 4)))
    rows = 100 + seed % 97
    worker.turn(Reply(reasoning="The loader finished cleanly.", content=f"Loaded {rows} rows into data/raw.parquet."))

    orchestrator.results((delegate.id, f"Loaded {rows} rows into data/raw.parquet."))
    orchestrator.turn(Reply(reasoning="The report checks out.", content=f"Task {task}: data staged, {rows} rows."))
    return log.gz()


def post_training_config(tmp: Path, *overrides: str, name: str = "post-training-test") -> CycleConfig:
    """The demo preset with short windows and stores under `tmp` (environment variables ignored)."""
    tmp.mkdir(parents=True, exist_ok=True)
    sets = [
        f"name={name}",
        f"tasks.train_candidates={list(TASKS)}",
        f"tasks.train={list(TASKS)}",
        f"evaluation.tasks=[{TASKS[0]}, 60]",
        "training.window=4096",
        "training.context_overlap=1024",
        f"training.lora_r={LORA_R}",
        f"training.lora_alpha={LORA_ALPHA}",
        "training.steps=4",
        "training.save_every=2",
        "training.val_every=2",
        "training.replicas=2",
        "training.ce_chunk=32",
        f"storage.metadata_url={migrated_sqlite(tmp / 'metadata.db')}",
        f"storage.artifact_url={tmp / 'artifacts'}",
        *overrides,
    ]
    return load_config("demo", sets, environ={})


@dataclass
class SeededCycle:
    config: CycleConfig
    ctx: CycleContext
    tmp: Path
    episodes: dict[str, list[int]]  # split → episode ids

    def count(self, table: str) -> int:
        path = self.config.storage.metadata_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    def counts(self) -> dict[str, int]:
        return {table: self.count(table) for table in TABLES}


def seed_cycle(tmp: Path, parent: Path, *overrides: str, failed: set[tuple[int, int]] = frozenset()) -> SeededCycle:
    """Open a cycle, publish the parent, and record teacher episodes with proxy logs, rankings and selections.

    `failed` holds (task, candidate) pairs recorded as model failures (still selected)."""
    config = post_training_config(tmp, *overrides)
    ctx = open_test_cycle(config)
    publish_model(ctx.artifacts, config.models.parent_bf16, parent)
    episodes: dict[str, list[int]] = {"train": [], "val": []}
    for task in TASKS:
        teacher_prompt = freeze_teacher_prompt(ctx, task, 0)
        ids = []
        for candidate in range(CANDIDATES):
            seed = collection_seed(config.collection.seed_base, task, candidate)
            unit = EpisodeUnit(ctx.cycle_name, task, "collection", seed, candidate=candidate)
            log = ctx.artifacts.put_bytes(unit.artifact_key("api_log"), teacher_episode_log(teacher_prompt, task, seed))
            status = "model_failure" if (task, candidate) in failed else "succeeded"
            row = ctx.repo.record_episode(
                ctx.cycle_id,
                task_id=task,
                kind="collection",
                seed=seed,
                candidate=candidate,
                status=status,
                condition=teacher_condition(task, config.generation),
                model=config.models.served_name,
                artifacts={"api_log": log.uri},
            )
            ids.append(row.id)
            ctx.repo.record_ranking(ctx.cycle_id, row.id, score=float(-candidate), rank=candidate + 1)
            split = "train" if candidate < CANDIDATES - 1 else "val"
            ctx.repo.record_selection(ctx.cycle_id, row.id, split, rank=candidate + 1)
            episodes[split].append(row.id)
        ctx.repo.record_comparison(
            ctx.cycle_id,
            task,
            "ranking",
            f"e{ids[0]}_vs_e{ids[1]}",
            side_a=str(ids[0]),
            side_b=str(ids[1]),
            judge_model=config.models.served_name,
            verdict="A",
            episode_a_id=ids[0],
            episode_b_id=ids[1],
        )
    return SeededCycle(config, ctx, tmp, episodes)


@pytest.fixture(scope="module")
def tiny_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Qwen3 (hidden 128, 2 layers, bf16) with the real Qwen3 tokenizer."""
    from mass_ops.models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("parent") / "L0-bf16")


@pytest.fixture
def seeded(tmp_path: Path, tiny_parent: Path) -> SeededCycle:
    return seed_cycle(tmp_path, tiny_parent)


def stored_keys(cycle: SeededCycle, prefix: str = "") -> list[str]:
    return cycle.ctx.artifacts.list(prefix)


def read_shards(cycle: SeededCycle, split: str) -> list[dict[str, Any]]:
    import gzip

    dataset = cycle.ctx.repo.get_dataset(cycle.ctx.cycle_id, split)
    assert dataset is not None
    rows = []
    for shard in dataset.stats["shards"]:
        rows += [json.loads(line) for line in gzip.decompress(cycle.ctx.artifacts.get_bytes(shard["key"])).splitlines()]
    return rows


# -- refusals ---------------------------------------------------------------------------------------------------------


def test_openrouter_configs_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    config = post_training_config(
        tmp_path, "inference.backend=openrouter", "inference.endpoint=https://openrouter.ai/api/v1"
    )
    for stage in (render, train, select_checkpoint, export):
        with pytest.raises(PostTrainingError, match=r"inference\.backend is openrouter"):
            stage(config)
    assert not (tmp_path / "artifacts").exists()
    path = config.storage.metadata_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM cycles").fetchone()[0] == 0


def test_render_fails_naming_a_selected_episode_without_windows_and_writes_nothing(
    tmp_path: Path, tiny_parent: Path
) -> None:
    # A model failure that selection still picked: require_success skips it, so it yields no window.
    cycle = seed_cycle(tmp_path, tiny_parent, failed={(202, 2)})
    seed = collection_seed(cycle.config.collection.seed_base, 202, 2)
    with pytest.raises(
        PostTrainingError,
        match=rf"render \(val split\): 1 selected episode\(s\) produced no training "
        rf"window: t202_L0_s{seed}",
    ):
        render(cycle.config)
    # The train split rendered fine, but nothing of either split was published or recorded.
    assert stored_keys(cycle, f"cycles/{cycle.ctx.cycle_name}/datasets/") == []
    assert cycle.count("datasets") == 0 and cycle.count("training_windows") == 0


def test_render_names_an_episode_without_proxy_log(tmp_path: Path, tiny_parent: Path) -> None:
    cycle = seed_cycle(tmp_path, tiny_parent)
    ctx = cycle.ctx
    row = ctx.repo.record_episode(
        ctx.cycle_id, task_id=51, kind="collection", seed=1, candidate=9, status="succeeded", condition="t51_L0"
    )
    ctx.repo.record_selection(ctx.cycle_id, row.id, "train", rank=9)
    with pytest.raises(PostTrainingError, match=r"\(t51_L0_s1\) has no proxy log"):
        render(cycle.config)
    assert cycle.count("datasets") == 0


def test_train_needs_rendered_datasets_and_the_local_backend(seeded: SeededCycle, tmp_path: Path) -> None:
    with pytest.raises(PostTrainingError, match="has no rendered train dataset; run render first"):
        train(seeded.config, workdir=tmp_path / "work", accelerator="cpu")
    assert seeded.count("training_runs") == 0
    kube = post_training_config(tmp_path / "other", "compute.backend=kubernetes")
    with pytest.raises(PostTrainingError, match=r"compute\.backend is kubernetes"):
        train(kube, accelerator="cpu")


def test_the_trainer_environment_carries_no_api_key(seeded: SeededCycle, monkeypatch: pytest.MonkeyPatch) -> None:
    from mass_ops.stages.train import _training_env

    monkeypatch.setenv(seeded.config.inference.api_key_env, "sk-not-for-training")
    env = _training_env(seeded.config, "cpu")
    assert seeded.config.inference.api_key_env not in env
    assert "sk-not-for-training" not in json.dumps(env)
    assert env["DS_ACCELERATOR"] == "cpu"
    import mass_ops

    assert str(Path(mass_ops.__file__).resolve().parents[1]) in env["PYTHONPATH"].split(":")  # holds the package


def test_the_trainer_finds_the_tools_of_its_own_environment_first(
    seeded: SeededCycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed builds its ops with the first `ninja` on PATH: the environment's own, wherever PATH had it."""
    from mass_ops.stages.train import _training_env

    tools = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", tools, "/bin"]))
    assert _training_env(seeded.config, "cpu")["PATH"].split(os.pathsep) == [tools, "/usr/bin", "/bin"]


# -- render -----------------------------------------------------------------------------------------------------------


def test_render_publishes_windows_per_split_with_the_bare_prompt_in_the_main_thread(seeded: SeededCycle) -> None:
    from transformers import AutoTokenizer

    result = render(seeded.config)
    ctx = seeded.ctx
    tokenizer = AutoTokenizer.from_pretrained(str(fetch_model(ctx.artifacts, "models/L0-bf16", seeded.tmp / "tok")))
    for split, expected_episodes in (("train", 4), ("val", 2)):
        summary = result["datasets"][split]
        dataset = ctx.repo.get_dataset(ctx.cycle_id, split)
        assert dataset is not None and summary["dataset_id"] == dataset.id and not summary["reused"]
        assert summary["uri"] == ctx.artifacts.uri(f"cycles/{ctx.cycle_name}/datasets/{split}")
        assert dataset.episodes == expected_episodes and dataset.tokenizer == ctx.artifacts.uri("models/L0-bf16")
        records = read_shards(seeded, split)
        assert len(records) == dataset.windows
        assert sum(r["n_loss_tokens"] for r in records) == dataset.loss_tokens
        index = ctx.repo.windows(dataset.id)
        assert [w.position for w in index] == list(range(dataset.windows))
        assert {w.episode_id for w in index} == set(seeded.episodes[split])
        # Every selected episode trains its orchestrator and its worker.
        for episode_id in seeded.episodes[split]:
            roles = {w.role for w in index if w.episode_id == episode_id}
            assert roles == {"orchestrator", "worker"}
        for record in records:
            text = tokenizer.decode(record["input_ids"])
            task = ctx.catalogue.task(record["task"])
            if record["role"] == "orchestrator":
                assert record["is_main"] and record["match_mode"] == "exact"
                assert task.bare_prompt.strip() in text  # the student sees only the bare task ...
                assert "Execution requirements for the agent team" not in text  # ... not the teacher's workflow
            trained = [t for t, label in zip(record["input_ids"], record["labels"], strict=True) if label != -100]
            assert trained and tokenizer.decode(trained).rstrip().endswith("<|im_end|>")
        stats = ctx.artifacts.get_json(f"cycles/{ctx.cycle_name}/datasets/{split}/stats.json")
        assert stats["args"]["strict"] and stats["args"]["require_success"] and stats["args"]["window"] == 4096
        assert stats["aggregate"]["windows"] == dataset.windows and len(stats["episodes"]) == expected_episodes


def test_render_rerun_is_a_no_op_and_completes_an_interrupted_window_index(seeded: SeededCycle) -> None:
    first = render(seeded.config)
    counts = seeded.counts()
    shard_hashes = {k: seeded.ctx.artifacts.info(k).sha256 for k in stored_keys(seeded, "cycles/")}
    again = render(seeded.config)
    assert all(again["datasets"][s]["reused"] for s in ("train", "val"))
    assert {s: {**d, "reused": False} for s, d in again["datasets"].items()} == first["datasets"]
    assert seeded.counts() == counts
    assert {k: seeded.ctx.artifacts.info(k).sha256 for k in stored_keys(seeded, "cycles/")} == shard_hashes

    # A crash between the dataset row and its window index: the rerun indexes from the published shards.
    val = first["datasets"]["val"]
    path = seeded.config.storage.metadata_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM training_windows WHERE dataset_id = ? AND position >= 1", (val["dataset_id"],))
    assert seeded.count("training_windows") == counts["training_windows"] - (val["windows"] - 1)
    rows = run_render(seeded.config)
    assert [r["split"] for r in rows] == ["train", "val"]
    assert seeded.counts() == counts
    index = seeded.ctx.repo.windows(val["dataset_id"])
    assert [(w.position, w.n_tokens) for w in index] == [
        (i, r["n_tokens"]) for i, r in enumerate(read_shards(seeded, "val"))
    ]


# -- select, export, register from a hand-made adapter ---------------------------------------------------------------


def hand_made_training(cycle: SeededCycle, val_losses: dict[int, float]) -> int:
    """A finished training run with published LoRA checkpoints (random factors on q_proj and down_proj of both
    layers) and its log, as the train stage leaves them; returns the run id."""
    import torch
    from safetensors.torch import save_file

    ctx = cycle.ctx
    prefix = f"cycles/{ctx.cycle_name}/training"
    run = ctx.repo.ensure_training_run(ctx.cycle_id, "sft", {"hand_made": True})
    log_rows: list[dict[str, Any]] = []
    generator = torch.Generator().manual_seed(7)
    for step, loss in sorted(val_losses.items()):
        log_rows.append({"step": step, "val_loss": loss, "val_tokens": 40})
        if step == 0:
            ctx.repo.record_checkpoint(run.id, 0, val_loss=loss, val_tokens=40)
            continue
        tensors = {}
        for layer in (0, 1):
            for module, (out, inp) in (("self_attn.q_proj", (256, 128)), ("mlp.down_proj", (128, 384))):
                base = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{base}.lora_A.default.weight"] = torch.randn(LORA_R, inp, generator=generator) * 0.1
                tensors[f"{base}.lora_B.default.weight"] = torch.randn(out, LORA_R, generator=generator) * 0.1
        folder = cycle.tmp / "hand-made" / f"step_{step:05d}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "lora_state_dict.safetensors"))
        (folder / "train_state.json").write_text(json.dumps({"step": step}))
        published = publish_model(ctx.artifacts, f"{prefix}/step_{step:05d}", folder)
        ctx.repo.record_checkpoint(run.id, step, uri=published.uri, val_loss=loss, val_tokens=40)
    ctx.artifacts.put_bytes(f"{prefix}/train_log.jsonl", "".join(json.dumps(r) + "\n" for r in log_rows).encode())
    ctx.repo.set_training_run_status(run.id, "succeeded")
    return run.id


def test_select_checkpoint_takes_the_minimum_validation_loss_after_step_zero(seeded: SeededCycle) -> None:
    with pytest.raises(PostTrainingError, match="has no training run; run the train stage first"):
        select_checkpoint(seeded.config)
    run_id = hand_made_training(seeded, {0: 0.5, 2: 1.5, 4: 1.5, 6: 1.7})  # step 0 never counts; ties → earlier
    choice = select_checkpoint(seeded.config)
    checkpoint = next(c for c in seeded.ctx.repo.checkpoints(run_id) if c.step == 2)
    assert (choice["step"], choice["val_loss"], choice["checkpoint_id"]) == (2, 1.5, checkpoint.id)
    assert choice["checkpoint"] == checkpoint.uri and choice["criterion"] == "minimum validation loss"
    stored = seeded.ctx.artifacts.get_json(f"cycles/{seeded.ctx.cycle_name}/training/selected_checkpoint.json")
    assert stored == {k: v for k, v in choice.items() if k != "selection_uri"}
    assert select_checkpoint(seeded.config) == choice


def test_select_checkpoint_refuses_a_non_finite_validation_loss(seeded: SeededCycle) -> None:
    hand_made_training(seeded, {0: 2.0, 2: 1.5})
    key = f"cycles/{seeded.ctx.cycle_name}/training/train_log.jsonl"
    rows = seeded.ctx.artifacts.get_bytes(key).decode() + '{"step": 4, "val_loss": NaN, "val_tokens": 40}\n'
    seeded.ctx.artifacts.put_bytes(key, rows.encode())
    with pytest.raises(PostTrainingError, match="validation loss at step 4 is not finite"):
        select_checkpoint(seeded.config)


def test_export_and_register_a_hand_made_adapter_then_rerun_as_no_ops(tmp_path: Path, tiny_parent: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from mass_ops.export import export_fp8

    cycle = seed_cycle(tmp_path, tiny_parent, "models.fp8_reference=models/L0-fp8")
    ctx = cycle.ctx
    # The reference FP8 checkpoint whose layout the export follows (here: the parent quantised by default rules).
    export_fp8(tiny_parent, tmp_path / "reference-fp8")
    publish_model(ctx.artifacts, "models/L0-fp8", tmp_path / "reference-fp8")
    render(cycle.config)
    hand_made_training(cycle, {0: 2.0, 2: 1.4, 4: 1.6})

    result = export(cycle.config)
    assert result == {
        "bf16_uri": ctx.artifacts.uri("models/L1-bf16"),
        "fp8_uri": ctx.artifacts.uri("models/L1-fp8"),
        "checkpoint_step": 2,
        "checkpoint_uri": ctx.artifacts.uri(f"cycles/{ctx.cycle_name}/training/step_00002"),
        "reused": False,
    }
    bf16 = fetch_model(ctx.artifacts, "models/L1-bf16", tmp_path / "bf16")
    lora = load_file(
        str(fetch_model(ctx.artifacts, result["checkpoint_uri"], tmp_path / "ckpt") / "lora_state_dict.safetensors")
    )
    parent, merged = load_file(str(tiny_parent / "model.safetensors")), load_file(str(bf16 / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        base = "base_model.model." + name.removesuffix(".weight")
        delta = lora[f"{base}.lora_B.default.weight"] @ lora[f"{base}.lora_A.default.weight"]
        expected = (parent[name].float() + (LORA_ALPHA / LORA_R) * delta).to(torch.bfloat16)
        assert torch.allclose(merged[name].float(), expected.float(), atol=1e-2, rtol=1e-2)
        assert not torch.equal(merged[name], parent[name])
    assert torch.equal(
        merged["model.layers.0.self_attn.k_proj.weight"], parent["model.layers.0.self_attn.k_proj.weight"]
    )
    # Records in the exported folders name URIs, not the scratch paths they were built in.
    merge_info = json.loads((bf16 / "merge_info.json").read_text())
    assert merge_info["base"] == ctx.artifacts.uri("models/L0-bf16")
    assert merge_info["lora"] == result["checkpoint_uri"] + "/lora_state_dict.safetensors"
    fp8_manifest = read_manifest(ctx.artifacts, "models/L1-fp8")
    assert fp8_manifest is not None
    provenance = fp8_manifest.metadata["provenance"]
    assert provenance["checkpoint"]["step"] == 2 and provenance["fp8_reference"]["uri"] == ctx.artifacts.uri(
        "models/L0-fp8"
    )
    fp8 = fetch_model(ctx.artifacts, "models/L1-fp8", tmp_path / "fp8")
    quant_info = json.loads((fp8 / "quant_info.json").read_text())
    assert quant_info["src"] == result["bf16_uri"] and quant_info["ref"] == ctx.artifacts.uri("models/L0-fp8")
    assert "mass-export-" not in (fp8 / "quant_info.json").read_text() + (fp8 / "merge_info.json").read_text()

    registered = register(cycle.config)
    l0, l1 = ctx.repo.get_generation("L0"), ctx.repo.get_generation("L1")
    assert l0 is not None and l1 is not None
    assert (l0.parent_id, l0.bf16_uri, l0.served_name) == (None, ctx.artifacts.uri("models/L0-bf16"), "mass-tiny-L0")
    assert (l1.parent_id, l1.cycle_id, l1.generation, l1.served_name) == (l0.id, ctx.cycle_id, 1, "L1")
    assert registered == {
        "generation": "L1",
        "generation_id": l1.id,
        "parent": "L0",
        "parent_id": l0.id,
        "bf16_uri": result["bf16_uri"],
        "fp8_uri": result["fp8_uri"],
        "checkpoint_id": l1.checkpoint_id,
    }
    lineage = l1.lineage
    assert lineage["config_hash"] == cycle.config.config_hash() and lineage["checkpoint"]["step"] == 2
    assert lineage["selected_episodes"] == cycle.episodes
    assert lineage["comparisons"] == {"rhi": 0, "champion": 0, "ranking": 2, "external": 0}
    assert set(lineage["datasets"]) == {"train", "val"} and lineage["export"] == provenance
    assert [g.name for g in ctx.repo.lineage(l1.id)] == ["L1", "L0"]
    assert l1.bf16_sha256 == ctx.artifacts.info(f"models/L1-bf16/{MANIFEST_NAME}").sha256
    assert l1.fp8_sha256 == ctx.artifacts.info(f"models/L1-fp8/{MANIFEST_NAME}").sha256

    counts = cycle.counts()
    manifests = {k: ctx.artifacts.info(k).sha256 for k in stored_keys(cycle, "models/") if k.endswith(MANIFEST_NAME)}
    assert export(cycle.config) == {**result, "reused": True}
    assert register(cycle.config) == registered
    rows = run_export(cycle.config)
    assert [r["item"] for r in rows] == ["checkpoint", "bf16", "fp8", "generation"]
    assert cycle.counts() == counts
    assert {
        k: ctx.artifacts.info(k).sha256 for k in stored_keys(cycle, "models/") if k.endswith(MANIFEST_NAME)
    } == manifests


def test_export_refuses_a_target_holding_another_model(tmp_path: Path, tiny_parent: Path) -> None:
    cycle = seed_cycle(tmp_path, tiny_parent)
    render(cycle.config)
    hand_made_training(cycle, {0: 2.0, 2: 1.4})
    # Someone already put a model where this cycle's BF16 export goes (here: the parent itself).
    occupant = publish_model(cycle.ctx.artifacts, "models/L1-bf16", tiny_parent)
    with pytest.raises(PostTrainingError, match=r"models/L1-bf16 already holds a model that was not exported from"):
        export(cycle.config)
    assert read_manifest(cycle.ctx.artifacts, "models/L1-bf16") == occupant.manifest
    assert read_manifest(cycle.ctx.artifacts, "models/L1-fp8") is None
    with pytest.raises(PostTrainingError, match=r"the bf16 model at .*models/L1-bf16 was not exported by cycle"):
        register(cycle.config)
    assert cycle.count("model_generations") == 0


# -- the whole chain, for real ----------------------------------------------------------------------------------------


class Interrupted(Exception):
    """Stands in for a crash of the stage's process after a checkpoint became durable."""


def trainer_processes(workdir: Path) -> list[Any]:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = " ".join(process.info.get("cmdline") or [])
        if "mass_ops.train.trainer" in cmdline and process.info.get("cwd") == str(workdir):
            found.append(process)
    return found


def log_rows(cycle: SeededCycle, name: str) -> list[dict[str, Any]]:
    data = cycle.ctx.artifacts.get_bytes(f"cycles/{cycle.ctx.cycle_name}/training/{name}").decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


@pytest.mark.slow(seconds=45)
def test_render_train_select_export_register_on_cpu_with_a_resume_and_idempotent_reruns(
    tmp_path: Path, tiny_parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mass_ops.export import dequantize_blockwise
    from mass_ops.stages.train import _TrainingProgress

    cycle = seed_cycle(tmp_path, tiny_parent)
    ctx = cycle.ctx
    prefix = f"cycles/{ctx.cycle_name}/training"
    datasets = render(cycle.config)["datasets"]

    # First attempt: the stage dies right after the step-2 checkpoint was published and recorded.
    original_poll = _TrainingProgress.poll

    def poll_then_crash(self: _TrainingProgress) -> None:
        original_poll(self)
        if 2 in self.published:
            raise Interrupted

    monkeypatch.setattr(_TrainingProgress, "poll", poll_then_crash)
    with pytest.raises(Interrupted):
        train(cycle.config, workdir=tmp_path / "work-1", accelerator="cpu")
    monkeypatch.undo()
    assert trainer_processes(tmp_path / "work-1") == []  # the launcher and both ranks were stopped
    path = cycle.config.storage.metadata_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        ((run_id, status),) = db.execute("SELECT id, status FROM training_runs").fetchall()
    assert status == "failed"
    checkpoints = {c.step: c for c in ctx.repo.checkpoints(run_id)}
    assert sorted(checkpoints) == [0, 2] and checkpoints[2].uri and checkpoints[0].uri is None
    step2_manifest = ctx.artifacts.info(f"{prefix}/step_00002/{MANIFEST_NAME}").sha256

    # Second attempt, in another folder (another machine): resumes from the published step-2 checkpoint.
    summary = train(cycle.config, workdir=tmp_path / "work-2", accelerator="cpu")
    assert summary["status"] == "succeeded" and summary["resumed_from_step"] == 2 and not summary["reused"]
    rows = {row["step"]: row for row in summary["checkpoints"]}
    assert sorted(rows) == [0, 2, 4]
    assert rows[0]["uri"] is None and all(rows[s]["uri"] == ctx.artifacts.uri(f"{prefix}/step_{s:05d}") for s in (2, 4))
    assert all(row["val_tokens"] == datasets["val"]["loss_tokens"] for row in rows.values())
    assert all(0 < rows[s]["train_loss"] < 20 and 0 < rows[s]["val_loss"] < 20 for s in (2, 4))
    assert ctx.artifacts.info(f"{prefix}/step_00002/{MANIFEST_NAME}").sha256 == step2_manifest
    (resume,) = log_rows(cycle, "resume_log.jsonl")
    assert resume["step"] == 2 and resume["world_size"] == 2
    train_log = log_rows(cycle, "train_log.jsonl")
    assert [r["step"] for r in train_log if "loss" in r] == [1, 2, 3, 4]
    assert [(r["step"], r["val_loss"]) for r in train_log if "val_loss" in r] == [
        (s, rows[s]["val_loss"]) for s in (0, 2, 4)
    ]
    assert summary["train_log_uri"] == ctx.artifacts.uri(f"{prefix}/train_log.jsonl")
    assert ctx.artifacts.exists(f"{prefix}/train_stdout.log")

    selected = select_checkpoint(cycle.config)
    best = min((rows[s]["val_loss"], s) for s in (2, 4))
    assert (selected["val_loss"], selected["step"]) == best
    exported = export(cycle.config)
    registered = register(cycle.config)
    l1 = ctx.repo.get_generation("L1")
    assert l1 is not None and l1.checkpoint_id == selected["checkpoint_id"] and l1.fp8_uri == exported["fp8_uri"]
    assert l1.lineage["datasets"]["train"]["id"] == datasets["train"]["dataset_id"]
    assert registered["parent"] == "L0"

    # The FP8 generation loads in transformers (which dequantises block-FP8 weights on CPU) and generates.
    fp8 = fetch_model(ctx.artifacts, exported["fp8_uri"], tmp_path / "unused")
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    stored: dict[str, torch.Tensor] = {}
    for shard in fp8.glob("*.safetensors"):
        stored.update(load_file(str(shard)))
    tokenizer = AutoTokenizer.from_pretrained(str(fp8))
    model = AutoModelForCausalLM.from_pretrained(str(fp8), device_map="cpu")
    params = dict(model.named_parameters())
    name = "model.layers.1.mlp.down_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn
    dequantised = dequantize_blockwise(stored[name], stored[f"{name}_scale_inv"], dtype=params[name].dtype)
    assert torch.equal(params[name].detach(), dequantised)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Plan the loader."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if not isinstance(prompt, torch.Tensor) else prompt
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4) and torch.equal(generated[:, : ids.shape[1]], ids)

    # Every stage again: nothing new, same URIs.
    counts = cycle.counts()
    keys = {k: ctx.artifacts.info(k).sha256 for k in stored_keys(cycle) if not k.endswith("train_stdout.log")}
    assert all(d["reused"] for d in render(cycle.config)["datasets"].values())
    again = train(cycle.config, workdir=tmp_path / "work-3", accelerator="cpu")
    assert again["reused"] and again["checkpoints"] == summary["checkpoints"]
    assert not (tmp_path / "work-3").exists() or not any((tmp_path / "work-3").iterdir())
    assert select_checkpoint(cycle.config) == selected
    assert export(cycle.config) == {**exported, "reused": True}
    assert register(cycle.config) == registered
    assert cycle.counts() == counts
    assert {k: ctx.artifacts.info(k).sha256 for k in stored_keys(cycle) if not k.endswith("train_stdout.log")} == keys
