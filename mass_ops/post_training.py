"""Post-training stages of a cycle: render → train → select checkpoint → export → register (ARCHITECTURE data flow 7–9).

Each stage takes the cycle config, reads its inputs from the metadata store and the artifact store, publishes its
outputs (artifacts first, rows last) and returns a small dict of ids and URIs. Every stage is idempotent: a rerun
skips what is done, so an Airflow retry or a cleared task redoes only what is missing.

- `render`: selected train/val episodes → their proxy logs, the frozen teacher prompt and the bare prompt → windows
  tokenised with the parent's tokenizer (strict, successful episodes only, MASS_SPEC §1/§7) → gzip JSONL shards and
  stats.json under `cycles/<cycle>/datasets/<split>/`, a `datasets` row and the window index per split.
- `train`: LoRA SFT of the parent on the rendered windows (local backend: torchrun of `mass_ops.train.trainer`);
  every checkpoint is published under `cycles/<cycle>/training/step_NNNNN/` as soon as it appears and recorded with
  its losses; a rerun after a crash resumes from the newest published checkpoint.
- `select_checkpoint`: minimum validation loss over saved steps > 0 (MASS_SPEC §1 export), frozen in
  `selected_checkpoint.json`.
- `export`: merge the selected adapter into the parent (BF16) and quantise it block-wise (FP8), published at
  `models.next_bf16` / `models.next_fp8` with the inputs they came from in their manifests.
- `register`: model generation L(k+1) with its parent L(k) and its lineage.

OpenRouter configs are refused by render/train/export before anything is written (MASS_SPEC §1).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.judge.evidence import EvidenceError
from mass_ops.judge.workspaces import key_for_uri
from mass_ops.layout import (
    dataset_key,
    dataset_stats_key,
    episode_name,
    teacher_condition,
    teacher_prompt_key,
    training_prefix,
)
from mass_ops.store.model_folders import (
    MANIFEST_NAME,
    ModelManifest,
    fetch_model,
    is_side_file,
    publish_model,
    read_manifest,
    resolve_model_location,
)
from mass_ops.render import (
    EpisodeSource,
    RenderError,
    RenderOptions,
    dataset_stats,
    ensure_every_episode_has_windows,
    iter_episode_renders,
)
from mass_ops.store.artifacts import ArtifactStore
from mass_ops.store.schema import Dataset, Ledger, RunStatus, TrainingRun
from mass_ops.train.checkpoints import (
    CRITERION,
    LORA_STATE_FILE,
    SELECTION_FILE,
    TRAIN_LOG_FILE,
    CheckpointSelectionError,
    is_complete,
    read_train_log,
)
from mass_ops.training_plan import train_args_for, training_command_for

logger = logging.getLogger(__name__)

SPLITS = ("train", "val")
TRAINING_RUN_KEY = "sft"
# Windows per dataset shard: a paper-sized window is ~49 K tokens, so a shard stays in the tens of MB compressed.
WINDOWS_PER_SHARD = 256
# Layout of the local training folder. Paths in the trainer's args are relative to it, so the args (and the
# trajectory check a resume makes against them) are the same whichever machine or folder runs the job.
PARENT_DIR = "parent"
DATA_FILES = {"train": "data/train.jsonl", "val": "data/val.jsonl"}
OUT_DIR = "training"
ARGS_FILE = "train_args.json"
STDOUT_LOG = "train_stdout.log"
# Trainer outputs copied to the store next to the checkpoints (the trainer's own file names).
LOG_FILES = (TRAIN_LOG_FILE, "exposure_log.jsonl", "resume_log.jsonl", "args.json")
POLL_S = 1.0
STOP_GRACE_S = 30.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_GZIP_MAGIC = b"\x1f\x8b"
_PUBLISHED_CHECKPOINT = re.compile(r"step_(\d{5})/" + re.escape(MANIFEST_NAME))


class PostTrainingError(ValueError):
    """A post-training stage cannot run or continue; the message names the stage, the record and why."""


def _refuse_remote(config: CycleConfig, stage: str) -> None:
    if config.is_remote_backend:
        raise PostTrainingError(
            f"{stage}: inference.backend is {config.inference.backend}: a remotely served model cannot be rendered, "
            "trained or exported (MASS_SPEC §1); run this stage with a local-backend config"
        )


# =====================================================================================================================
# render


@dataclass(frozen=True)
class _StoredProxyLog:
    """An episode's proxy log in the artifact store, read line by line on iteration (never held whole in memory)."""

    artifacts: ArtifactStore
    key: str

    def __iter__(self) -> Iterator[bytes]:
        uri = self.artifacts.uri(self.key)
        try:
            with self.artifacts.open_read(self.key) as raw:
                compressed = raw.peek(2)[:2] == _GZIP_MAGIC  # proxies gzip their logs after the episode; tests may not
                yield from gzip.GzipFile(fileobj=raw) if compressed else raw
        except (OSError, EOFError, zlib.error) as exc:
            raise RenderError(f"proxy log {uri}: unreadable ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class _SelectedEpisode:
    source: EpisodeSource
    episode_id: int


def _store_key(artifacts: ArtifactStore, uri: str, what: str) -> str:
    try:
        return key_for_uri(artifacts, uri)
    except EvidenceError:
        raise PostTrainingError(f"{what} {uri} is not an artifact of the configured store {artifacts.url}") from None


def _selected_episodes(ctx: CycleContext, split: str) -> list[_SelectedEpisode]:
    """The split's selected episodes as render sources; every missing input is an error before anything renders."""
    selections = ctx.repo.selections(ctx.cycle_id, split)
    if not selections:
        raise PostTrainingError(
            f"render: cycle {ctx.cycle_name} has no {split} trajectories selected; run the select stage first"
        )
    teacher_prompts: dict[int, str] = {}
    selected = []
    for selection in selections:
        episode = ctx.repo.get_episode(selection.episode_id)
        if episode is None:  # unreachable: selections reference episodes by foreign key
            raise PostTrainingError(f"render: selected episode {selection.episode_id} does not exist")
        task = int(episode.task_id)
        condition = episode.condition or teacher_condition(task, ctx.config.generation)
        name = episode_name(condition, episode.seed)
        log_uri = (episode.artifacts or {}).get("api_log")
        if not log_uri:
            raise PostTrainingError(
                f"render: selected episode {episode.unit_key} ({name}) has no proxy log (artifacts['api_log'])"
            )
        if task not in teacher_prompts:
            key = teacher_prompt_key(ctx.cycle_name, task)
            if not ctx.artifacts.exists(key):
                raise PostTrainingError(
                    f"render: task {task} has no frozen teacher prompt at {ctx.artifacts.uri(key)}; run collect first"
                )
            teacher_prompts[task] = ctx.artifacts.get_bytes(key).decode("utf-8")
        source = EpisodeSource(
            episode=name,
            task=task,
            condition=condition,
            seed=episode.seed,
            success=episode.status == "succeeded",
            log_records=_StoredProxyLog(ctx.artifacts, _store_key(ctx.artifacts, log_uri, f"proxy log of {name}")),
            teacher_prompt=teacher_prompts[task],
            bare_prompt=ctx.catalogue.task(task).bare_prompt,
            weight=selection.weight,
        )
        selected.append(_SelectedEpisode(source, episode.id))
    return selected


class _ShardWriter:
    """Windows as gzip JSONL shards of at most `per_shard` lines; byte-identical for identical windows."""

    def __init__(self, folder: Path, per_shard: int) -> None:
        self.folder = folder
        self.per_shard = per_shard
        self.paths: list[Path] = []
        self.counts: list[int] = []
        self._handle: gzip.GzipFile | None = None

    def add(self, record: Mapping[str, Any]) -> None:
        if self._handle is None or self.counts[-1] >= self.per_shard:
            self._close_current()
            path = self.folder / f"shard-{len(self.paths):05d}.jsonl.gz"
            self.paths.append(path)
            self.counts.append(0)
            # No name and mtime 0 in the gzip header: a re-render of the same windows gives the same bytes.
            self._handle = gzip.GzipFile(filename="", mode="wb", fileobj=path.open("wb"), mtime=0)
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        self._handle.write(line.encode("utf-8"))
        self.counts[-1] += 1

    def _close_current(self) -> None:
        if self._handle is not None:
            inner = self._handle.fileobj
            self._handle.close()
            if inner is not None:
                inner.close()
            self._handle = None

    def close(self) -> None:
        self._close_current()


def _index_row(record: Mapping[str, Any], position: int, episode_id: int | None) -> dict[str, Any]:
    """The `training_windows` index entry of one window record."""
    return {
        "position": position,
        "episode_id": episode_id,
        "task_id": record["task"],
        "role": record["role"],
        "is_main": record["is_main"],
        "thread": record["thread"],
        "segment": record["segment"],
        "window_index": record["window"],
        "n_windows": record["n_windows"],
        "n_tokens": record["n_tokens"],
        "n_loss_tokens": record["n_loss_tokens"],
        "weight": record["weight"],
    }


def _dataset_prefix(cycle: str, split: str) -> str:
    return dataset_stats_key(cycle, split).rpartition("/")[0]


@dataclass
class _RenderedSplit:
    """A split rendered into local shard files, checked, not yet published."""

    split: str
    options: RenderOptions
    shard_paths: list[Path]
    shard_counts: list[int]
    index: list[dict[str, Any]]
    episode_stats: list[dict[str, Any]]
    episode_ids: dict[str, int]


def _render_split(
    ctx: CycleContext, split: str, selected: Sequence[_SelectedEpisode], tokenizer: Any, scratch: Path
) -> _RenderedSplit:
    """Render one split into local shards (MASS_SPEC §1 render: strict, successful episodes only) and check that
    every selected episode produced a window."""
    t = ctx.config.training
    options = RenderOptions(
        window=t.window,
        overlap=t.context_overlap,
        strict=True,
        require_success=True,
        max_header_frac=t.max_header_frac,
    )
    folder = scratch / split
    folder.mkdir(parents=True)
    writer = _ShardWriter(folder, WINDOWS_PER_SHARD)
    ids = {item.source.episode: item.episode_id for item in selected}
    index: list[dict[str, Any]] = []
    episode_stats: list[dict[str, Any]] = []
    produced: set[str] = set()
    try:
        for result in iter_episode_renders([item.source for item in selected], tokenizer, options):
            episode_stats.append(result.stats)
            for window in result.windows:
                record = window.as_record()
                index.append(_index_row(record, len(index), ids[window.episode]))
                produced.add(window.episode)
                writer.add(record)
        ensure_every_episode_has_windows(list(ids), produced)
    except RenderError as exc:
        raise PostTrainingError(f"render ({split} split): {exc}") from None
    finally:
        writer.close()
    return _RenderedSplit(split, options, writer.paths, writer.counts, index, episode_stats, ids)


def _publish_split(ctx: CycleContext, rendered: _RenderedSplit) -> Dataset:
    """Shards, then stats.json, then the dataset row, then the window index."""
    split = rendered.split
    shards = []
    for number, (path, count) in enumerate(zip(rendered.shard_paths, rendered.shard_counts, strict=True)):
        info = ctx.artifacts.put_file(dataset_key(ctx.cycle_name, split, number), path)
        shards.append({"key": info.key, "uri": info.uri, "sha256": info.sha256, "size": info.size, "windows": count})
    stats = dataset_stats(rendered.episode_stats, rendered.options)
    stats_key = dataset_stats_key(ctx.cycle_name, split)
    tokenizer_uri = resolve_model_location(ctx.artifacts, ctx.config.models.parent_bf16).uri
    document = {**stats, "split": split, "tokenizer": tokenizer_uri, "shards": shards}
    ctx.artifacts.put_json(stats_key, {**document, "episode_ids": rendered.episode_ids})
    aggregate = stats["aggregate"]
    dataset = ctx.repo.record_dataset(
        ctx.cycle_id,
        split,
        ctx.artifacts.uri(_dataset_prefix(ctx.cycle_name, split)),
        episodes=aggregate["episodes"],
        windows=aggregate["windows"],
        loss_tokens=aggregate["loss_tokens"],
        total_tokens=aggregate["total_tokens"],
        stats={"args": stats["args"], "aggregate": aggregate, "shards": shards, "stats_key": stats_key},
        tokenizer=tokenizer_uri,
    )
    indexed = ctx.repo.record_windows(dataset.id, rendered.index)
    if indexed != dataset.windows:
        raise PostTrainingError(f"render ({split} split): indexed {indexed} windows, the dataset has {dataset.windows}")
    logger.info("rendered %s: %d episodes → %d windows", split, aggregate["episodes"], aggregate["windows"])
    return dataset


@contextlib.contextmanager
def _local_shard(ctx: CycleContext, shard: Mapping[str, Any]) -> Iterator[Path]:
    """A dataset shard downloaded to a temporary file and checked against the hash its dataset row records."""
    with tempfile.TemporaryDirectory(prefix="mass-shard-") as scratch:
        path = Path(scratch) / "shard.jsonl.gz"
        info = ctx.artifacts.get_file(shard["key"], path)
        if info.sha256 != shard["sha256"]:
            raise PostTrainingError(f"dataset shard {info.uri} does not match the hash its dataset row records")
        yield path


def _shard_records(ctx: CycleContext, dataset: Dataset) -> Iterator[dict[str, Any]]:
    """The window records of a recorded dataset, shard by shard."""
    for shard in (dataset.stats or {}).get("shards", []):
        with _local_shard(ctx, shard) as path, gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    yield json.loads(line)


def _complete_window_index(ctx: CycleContext, dataset: Dataset) -> None:
    """Index the windows of a recorded dataset that a crash left unindexed (rows come after the dataset row)."""
    if ctx.repo.record_windows(dataset.id, []) >= dataset.windows:
        return
    stats = ctx.artifacts.get_json((dataset.stats or {})["stats_key"])
    ids = stats.get("episode_ids", {})
    rows = [_index_row(r, position, ids.get(r["episode"])) for position, r in enumerate(_shard_records(ctx, dataset))]
    ctx.repo.record_windows(dataset.id, rows)


def _dataset_summary(dataset: Dataset, *, reused: bool) -> dict[str, Any]:
    return {
        "split": dataset.split,
        "dataset_id": dataset.id,
        "uri": dataset.uri,
        "episodes": dataset.episodes,
        "windows": dataset.windows,
        "loss_tokens": dataset.loss_tokens,
        "total_tokens": dataset.total_tokens,
        "reused": reused,
    }


def _parent_tokenizer(ctx: CycleContext, dest: Path) -> Any:
    """The tokenizer (and chat template) of the BF16 parent, fetched without its weights."""
    from transformers import AutoTokenizer

    folder = fetch_model(ctx.artifacts, ctx.config.models.parent_bf16, dest, include=is_side_file)
    return AutoTokenizer.from_pretrained(str(folder))


def render(config: CycleConfig) -> dict[str, Any]:
    """Render the selected train and val episodes into window datasets; a split already recorded is skipped.

    Returns {"cycle", "datasets": {split: {dataset_id, uri, episodes, windows, loss_tokens, total_tokens, reused}}}.
    """
    _refuse_remote(config, "render")
    ctx = attach_cycle(config)
    summaries: dict[str, dict[str, Any]] = {}
    pending = []
    for split in SPLITS:
        existing = ctx.repo.get_dataset(ctx.cycle_id, split)
        if existing is None:
            pending.append(split)
        else:
            _complete_window_index(ctx, existing)
            summaries[split] = _dataset_summary(existing, reused=True)
    if pending:
        selected = {split: _selected_episodes(ctx, split) for split in pending}
        with tempfile.TemporaryDirectory(prefix="mass-render-") as scratch:
            tokenizer = _parent_tokenizer(ctx, Path(scratch) / "tokenizer")
            # Every pending split is rendered and checked before any is published: a bad episode in val leaves
            # no train dataset behind either.
            rendered = [_render_split(ctx, split, selected[split], tokenizer, Path(scratch)) for split in pending]
            for split_render in rendered:
                dataset = _publish_split(ctx, split_render)
                summaries[split_render.split] = _dataset_summary(dataset, reused=False)
    return {"cycle": ctx.cycle_name, "datasets": {split: summaries[split] for split in SPLITS}}


# =====================================================================================================================
# train


def _training_run(ctx: CycleContext) -> TrainingRun | None:
    # The repository offers ensure_training_run only; reading must not create a run as a side effect.
    statement = sa.select(TrainingRun).where(TrainingRun.cycle_id == ctx.cycle_id, TrainingRun.key == TRAINING_RUN_KEY)
    with ctx.repo.store.read() as session:
        return session.scalars(statement).one_or_none()


def _rendered_datasets(ctx: CycleContext, stage: str) -> dict[str, Dataset]:
    datasets = {}
    for split in SPLITS:
        dataset = ctx.repo.get_dataset(ctx.cycle_id, split)
        if dataset is None:
            raise PostTrainingError(
                f"{stage}: cycle {ctx.cycle_name} has no rendered {split} dataset; run render first"
            )
        datasets[split] = dataset
    return datasets


def _run_spec(config: CycleConfig, parent_uri: str, datasets: Mapping[str, Dataset]) -> dict[str, Any]:
    """What defines the training run: the trainer's knobs (machine-independent paths), its inputs and world size."""
    args = train_args_for(
        config, model_dir=PARENT_DIR, train_data=DATA_FILES["train"], val_data=DATA_FILES["val"], out_dir=OUT_DIR
    ).to_dict()
    for machine_specific in ("resume_from", "accelerator"):
        args.pop(machine_specific)
    return {
        "trainer": args,
        "parent": parent_uri,
        "datasets": {split: {"id": d.id, "uri": d.uri} for split, d in datasets.items()},
        "world_size": config.training.replicas,
    }


@contextlib.contextmanager
def _scratch(workdir: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    if workdir is not None:
        path = Path(workdir).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
            yield Path(scratch)


def _stage_parent(ctx: CycleContext, root: Path) -> None:
    """Make `root/parent` the parent model: downloaded there, or a link to a local folder used in place."""
    dest = root / PARENT_DIR
    if dest.is_symlink():
        dest.unlink()
    folder = fetch_model(ctx.artifacts, ctx.config.models.parent_bf16, dest)
    if folder != dest:
        if dest.exists():
            shutil.rmtree(dest)
        dest.symlink_to(folder, target_is_directory=True)


def _stage_dataset(ctx: CycleContext, dataset: Dataset, dest: Path) -> None:
    """Concatenate a dataset's shards into the one JSONL file the trainer reads (temp file, then rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.with_name(dest.name + ".partial")
    count = 0
    with temp.open("wb") as out:
        for shard in (dataset.stats or {}).get("shards", []):
            with _local_shard(ctx, shard) as path, gzip.open(path, "rb") as lines:
                for line in lines:
                    out.write(line)
                    count += 1
    if count != dataset.windows:
        temp.unlink()
        raise PostTrainingError(
            f"dataset {dataset.uri}: its shards hold {count} windows, its row says {dataset.windows}"
        )
    os.replace(temp, dest)


def _log_key(cycle: str, name: str) -> str:
    return f"{training_prefix(cycle)}/{name}"


def _checkpoint_key(cycle: str, step: int) -> str:
    return f"{training_prefix(cycle)}/step_{step:05d}"


def _published_checkpoints(ctx: CycleContext, run_id: int) -> dict[int, str]:
    """Checkpoints of the run that are durable: recorded in the run's rows, or published to the store by an attempt
    that stopped before recording them (their rows follow at the next record)."""
    found = {c.step: c.uri for c in ctx.repo.checkpoints(run_id) if c.uri}
    prefix = training_prefix(ctx.cycle_name)
    for key in ctx.artifacts.list(f"{prefix}/step_"):
        match = _PUBLISHED_CHECKPOINT.fullmatch(key.removeprefix(f"{prefix}/"))
        if match is not None:
            found.setdefault(int(match.group(1)), ctx.artifacts.uri(key.rpartition("/")[0]))
    return found


def _restore_progress(ctx: CycleContext, published: Mapping[int, str], out_dir: Path) -> Path:
    """Put the run's published logs and its newest checkpoint into `out_dir`; return the checkpoint to resume from."""
    for name in LOG_FILES:
        key = _log_key(ctx.cycle_name, name)
        if ctx.artifacts.exists(key):
            ctx.artifacts.get_file(key, out_dir / name)
    step = max(published)
    folder = fetch_model(ctx.artifacts, published[step], out_dir / f"step_{step:05d}")
    if not is_complete(folder):
        raise PostTrainingError(f"checkpoint {published[step]} is incomplete; it cannot be resumed from")
    logger.info("resuming training from step %d (%s)", step, published[step])
    return folder


def _read_log_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL log the trainer may be appending to: a last line without its newline is not read yet."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True), start=1):
        if not line.endswith("\n"):
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise PostTrainingError(f"{path}:{number}: not valid JSON") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _TrainingProgress:
    """Publishes checkpoints as the trainer writes them, then the logs, then records the rows (in that order).

    Log rows are recorded only up to the newest published checkpoint: a resume starts from there, so those rows are
    final and a rerun never meets a recorded value it would compute differently.
    """

    def __init__(self, ctx: CycleContext, run_id: int, out_dir: Path, published: Mapping[int, str]) -> None:
        self.ctx = ctx
        self.run_id = run_id
        self.out_dir = out_dir
        self.published = dict(published)
        self._lock = threading.Lock()

    def poll(self) -> None:
        with self._lock:
            new = self._publish_checkpoints()
            if new:
                self.publish_logs()
                self._record(max(self.published))

    def finish(self, stdout_log: Path) -> None:
        with self._lock:
            self._publish_checkpoints()
            self.publish_logs(stdout_log)
            if self.published:
                self._record(max(self.published))

    def _publish_checkpoints(self) -> list[int]:
        new = []
        for folder in sorted(self.out_dir.glob("step_[0-9][0-9][0-9][0-9][0-9]")):
            step = int(folder.name.removeprefix("step_"))
            if step in self.published or not folder.is_dir() or not is_complete(folder):
                continue
            published = publish_model(self.ctx.artifacts, _checkpoint_key(self.ctx.cycle_name, step), folder)
            self.published[step] = published.uri
            new.append(step)
        return new

    def publish_logs(self, stdout_log: Path | None = None) -> None:
        """Copy the trainer's logs to the store, whole lines only: the trainer may be appending, and a resume parses
        every line of the copy it restores."""
        sources = [self.out_dir / name for name in LOG_FILES]
        if stdout_log is not None:
            sources.append(stdout_log)
        for path in sources:
            if path.is_file():
                data = path.read_bytes()
                self.ctx.artifacts.put_bytes(_log_key(self.ctx.cycle_name, path.name), data[: data.rfind(b"\n") + 1])

    def _record(self, through: int) -> None:
        fields: dict[int, dict[str, Any]] = {}
        for row in _read_log_rows(self.out_dir / TRAIN_LOG_FILE):
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or step > through:
                continue
            if "val_loss" in row:
                entry = fields.setdefault(step, {})
                if _finite(row["val_loss"]):
                    entry["val_loss"] = float(row["val_loss"])
                else:  # kept out of the row; select_checkpoint reads the log and refuses the run
                    logger.warning("step %d: non-finite validation loss %r", step, row["val_loss"])
                if _finite(row.get("val_tokens")):
                    entry["val_tokens"] = int(row["val_tokens"])
            elif "loss" in row and step in self.published and _finite(row["loss"]):
                fields.setdefault(step, {})["train_loss"] = float(row["loss"])
        for step, uri in self.published.items():
            if step <= through:
                fields.setdefault(step, {})["uri"] = uri
        for step, values in sorted(fields.items()):
            self.ctx.repo.record_checkpoint(self.run_id, step, **values)


def _default_accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _training_env(config: CycleConfig, accelerator: str) -> dict[str, str]:
    """The trainer's environment: ours without the API keys it has no use for, plus the CPU/DeepSpeed settings."""
    secrets = {config.inference.api_key_env, *(judge.api_key_env for judge in config.evaluation.judges)}
    env = {name: value for name, value in os.environ.items() if name not in secrets}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Ranks share the cores; without a cap every rank starts one thread per core and they thrash.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.training.ranks_per_node)))
    return env


def _stop(process: subprocess.Popen[str]) -> None:
    """Stop the launcher and the ranks it started (they share its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_training(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], stdout_log: Path, progress: _TrainingProgress
) -> tuple[int, list[str]]:
    """Run the launcher, streaming its output to our log and `stdout_log`, publishing checkpoints as they appear."""
    tail: deque[str] = deque(maxlen=40)
    logger.info("launching training: %s", " ".join(command))
    with stdout_log.open("a", encoding="utf-8") as out:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                out.write(line)
                out.flush()
                text = line.rstrip()
                if text:
                    tail.append(text)
                    logger.info("train | %s", text)

        reader = threading.Thread(target=pump, name="train-log", daemon=True)
        reader.start()
        try:
            while True:
                try:
                    process.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    progress.poll()
        except BaseException:
            _stop(process)
            raise
        reader.join()
    return process.returncode, list(tail)


def _checkpoint_rows(ctx: CycleContext, run_id: int) -> list[dict[str, Any]]:
    return [
        {"step": c.step, "uri": c.uri, "train_loss": c.train_loss, "val_loss": c.val_loss, "val_tokens": c.val_tokens}
        for c in ctx.repo.checkpoints(run_id)
    ]


def _training_summary(ctx: CycleContext, run: TrainingRun, *, reused: bool, resumed_from: int | None = None) -> dict:
    return {
        "run_id": run.id,
        "status": run.status,
        "steps": ctx.config.training.steps,
        "train_log_uri": run.log_uri,
        "output_uri": run.output_uri,
        "checkpoints": _checkpoint_rows(ctx, run.id),
        "resumed_from_step": resumed_from,
        "reused": reused,
    }


def train(
    config: CycleConfig, *, workdir: str | os.PathLike[str] | None = None, accelerator: str | None = None
) -> dict[str, Any]:
    """LoRA SFT of the parent on the rendered datasets (local backend), checkpoints published as they appear.

    `workdir` holds the staged parent, data and the run folder (a temporary folder when None); `accelerator` is
    "cpu" or "cuda" (default: cuda when available). A finished run is not started again (returns its summary); a
    run with published checkpoints resumes from the newest one.
    """
    _refuse_remote(config, "train")
    if config.compute.backend != "local":
        raise PostTrainingError(
            f"train: compute.backend is {config.compute.backend}; this function launches the local backend only "
            "(on Kubernetes the training Job runs the same trainer command)"
        )
    if config.training.nnodes != 1:
        raise PostTrainingError(f"train: training.nnodes is {config.training.nnodes}; a local run uses one node")
    if accelerator not in (None, "cpu", "cuda"):
        raise PostTrainingError(f"train: accelerator must be cpu or cuda (got {accelerator!r})")
    ctx = attach_cycle(config)
    datasets = _rendered_datasets(ctx, "train")
    parent_uri = resolve_model_location(ctx.artifacts, config.models.parent_bf16).uri
    run = ctx.repo.ensure_training_run(ctx.cycle_id, TRAINING_RUN_KEY, _run_spec(config, parent_uri, datasets))
    if run.status == RunStatus.SUCCEEDED:
        logger.info("training run %s of cycle %s already finished", TRAINING_RUN_KEY, ctx.cycle_name)
        return _training_summary(ctx, run, reused=True)
    device = accelerator or _default_accelerator()
    published = _published_checkpoints(ctx, run.id)
    with _scratch(workdir, "mass-train-") as root:
        out_dir = root / OUT_DIR
        shutil.rmtree(out_dir, ignore_errors=True)  # scratch: everything durable is in the stores
        out_dir.mkdir(parents=True)
        _stage_parent(ctx, root)
        for split, dataset in datasets.items():
            _stage_dataset(ctx, dataset, root / DATA_FILES[split])
        resume_from = _restore_progress(ctx, published, out_dir) if published else None
        args = train_args_for(
            config,
            model_dir=PARENT_DIR,
            train_data=DATA_FILES["train"],
            val_data=DATA_FILES["val"],
            out_dir=OUT_DIR,
            accelerator=device,
            resume_from=resume_from,
        )
        args.write(root / ARGS_FILE)
        command = training_command_for(config, ARGS_FILE, python=sys.executable)
        output_uri = ctx.artifacts.uri(training_prefix(ctx.cycle_name))
        ctx.repo.set_training_run_status(run.id, RunStatus.RUNNING, output_uri=output_uri)
        progress = _TrainingProgress(ctx, run.id, out_dir, published)
        stdout_log = root / STDOUT_LOG
        try:
            code, tail = _run_training(command, root, _training_env(config, device), stdout_log, progress)
            progress.finish(stdout_log)
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the logs help whoever looks at the failure
                progress.publish_logs(stdout_log)
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED)
            raise
        log_uri = ctx.artifacts.uri(_log_key(ctx.cycle_name, TRAIN_LOG_FILE))
        if code != 0:
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED, log_uri=log_uri)
            last = tail[-1] if tail else "no output"
            raise PostTrainingError(f"train: the training job exited with status {code}: {last}")
        if config.training.steps not in progress.published:
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED, log_uri=log_uri)
            raise PostTrainingError(
                f"train: the job finished without a checkpoint at the last step {config.training.steps}"
            )
        run = ctx.repo.set_training_run_status(run.id, RunStatus.SUCCEEDED, log_uri=log_uri)
    return _training_summary(ctx, run, reused=False, resumed_from=max(published) if published else None)


# =====================================================================================================================
# select checkpoint


def _finished_run(ctx: CycleContext, stage: str) -> TrainingRun:
    run = _training_run(ctx)
    if run is None or run.status != RunStatus.SUCCEEDED:
        state = "no training run" if run is None else f"training run {run.key} is {run.status}"
        raise PostTrainingError(f"{stage}: cycle {ctx.cycle_name} has {state}; run the train stage first")
    return run


def select_checkpoint(config: CycleConfig) -> dict[str, Any]:
    """The checkpoint of minimum validation loss over saved steps > 0 (ties: earlier step), frozen in
    `selected_checkpoint.json` next to the checkpoints.

    The published training log is checked as the reference checks it: a non-finite validation loss or a validation
    without tokens is an error; its choice must agree with the checkpoint rows.
    """
    _refuse_remote(config, "select_checkpoint")
    ctx = attach_cycle(config)
    run = _finished_run(ctx, "select_checkpoint")
    rows = {c.step: c for c in ctx.repo.checkpoints(run.id)}
    log_key = _log_key(ctx.cycle_name, TRAIN_LOG_FILE)
    log_uri = ctx.artifacts.uri(log_key)
    with tempfile.TemporaryDirectory(prefix="mass-select-") as scratch:
        path = Path(scratch) / TRAIN_LOG_FILE
        ctx.artifacts.get_file(log_key, path)
        try:
            log = read_train_log(path)
        except CheckpointSelectionError as exc:
            raise PostTrainingError(f"select_checkpoint: {log_uri}: {exc}") from None
    candidates = []
    for row in log:
        if "val_loss" not in row:
            continue
        step, loss, tokens = row.get("step"), row.get("val_loss"), row.get("val_tokens")
        if not _finite(loss):
            raise PostTrainingError(f"select_checkpoint: {log_uri}: validation loss at step {step} is not finite")
        if not _finite(tokens) or tokens <= 0:
            raise PostTrainingError(f"select_checkpoint: {log_uri}: validation at step {step} counted no tokens")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0 and step in rows and rows[step].uri:
            candidates.append((float(loss), step))
    if not candidates:
        raise PostTrainingError(f"select_checkpoint: {log_uri}: no validated step > 0 has a published checkpoint")
    val_loss, step = min(candidates)
    best = ctx.repo.best_checkpoint(run.id)
    if best is None or best.step != step:
        raise PostTrainingError(
            f"select_checkpoint: the training log selects step {step}, the checkpoint rows of run {run.id} select "
            f"{best.step if best else 'nothing'}"
        )
    choice = {
        "step": step,
        "val_loss": val_loss,
        "checkpoint": best.uri,
        "criterion": CRITERION,
        "checkpoint_id": best.id,
        "run_id": run.id,
    }
    key = _log_key(ctx.cycle_name, SELECTION_FILE)
    if ctx.artifacts.exists(key):
        stored = ctx.artifacts.get_json(key)
        if stored != choice:
            raise PostTrainingError(
                f"select_checkpoint: {ctx.artifacts.uri(key)} already records step {stored.get('step')}; the "
                f"records now select step {step} (a cycle's selection never changes)"
            )
    else:
        ctx.artifacts.put_json(key, choice)
    return {**choice, "selection_uri": ctx.artifacts.uri(key)}


# =====================================================================================================================
# export


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


def _export_targets(config: CycleConfig) -> dict[str, str]:
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
    _refuse_remote(config, "export")
    selected = select_checkpoint(config)
    ctx = attach_cycle(config)
    provenance = _provenance(ctx, selected)
    targets = _export_targets(config)
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
                export_fp8(bf16_dir, scratch / "fp8", reference_dir=reference_dir)
        else:
            parent_dir = fetch_model(ctx.artifacts, config.models.parent_bf16, scratch / "parent")
            adapter_dir = fetch_model(
                ctx.artifacts, selected["checkpoint"], scratch / "adapter", include=lambda n: n == LORA_STATE_FILE
            )
            adapter = adapter_dir / LORA_STATE_FILE
            r, alpha = config.training.lora_r, config.training.lora_alpha
            if fp8_due:
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


# =====================================================================================================================
# register


def register(config: CycleConfig) -> dict[str, Any]:
    """Register L(generation+1) with its parent L(generation) (registered first as a base model when absent), its
    weights, checkpoint and lineage: config hash, datasets, selected episodes, comparison counts, checkpoint."""
    ctx = attach_cycle(config)
    g = config.generation
    parent_name, child_name = f"L{g}", f"L{g + 1}"
    selection_key = _log_key(ctx.cycle_name, SELECTION_FILE)
    if not ctx.artifacts.exists(selection_key):
        raise PostTrainingError(f"register: cycle {ctx.cycle_name} has no selected checkpoint; run export first")
    selected = ctx.artifacts.get_json(selection_key)
    targets = _export_targets(config)
    uris: dict[str, str] = {}
    export_record: dict[str, Any] | None = None
    for fmt, location in targets.items():
        manifest = read_manifest(ctx.artifacts, location)
        uri = resolve_model_location(ctx.artifacts, location).uri
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

    datasets = _rendered_datasets(ctx, "register")
    run = _finished_run(ctx, "register")
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


# =====================================================================================================================
# CLI rows


def run_render(config: CycleConfig) -> list[dict[str, Any]]:
    """The `render` command: one row per split."""
    return list(render(config)["datasets"].values())


def run_train(config: CycleConfig, *, workdir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The `train` command: one row per recorded step (checkpoints and validations)."""
    summary = train(config, workdir=workdir)
    return [{"run": summary["run_id"], **row} for row in summary["checkpoints"]]


def run_export(config: CycleConfig) -> list[dict[str, Any]]:
    """The `export` command: select the checkpoint, export BF16 and FP8, register the next generation."""
    exported = export(config)
    registered = register(config)
    return [
        {"item": "checkpoint", "name": f"step {exported['checkpoint_step']}", "uri": exported["checkpoint_uri"]},
        {"item": "bf16", "name": registered["generation"], "uri": exported["bf16_uri"]},
        {"item": "fp8", "name": registered["generation"], "uri": exported["fp8_uri"]},
        {"item": "generation", "name": registered["generation"], "uri": f"parent {registered['parent']}"},
    ]
