"""The render stage: selected trajectories → training windows with assistant-only loss masks (MASS_SPEC §1, §7).

Selected train/val episodes → their proxy logs, the frozen teacher prompt and the bare prompt → windows tokenised
with the parent's tokenizer (strict, successful episodes only) → gzip JSONL shards and stats.json under
`cycles/<cycle>/datasets/<split>/`, a `datasets` row and the window index per split. Idempotent: a split whose
dataset row exists is reused. OpenRouter configs are refused before anything is written (MASS_SPEC §1).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.layout import (
    dataset_key,
    dataset_stats_key,
    episode_name,
    teacher_condition,
    teacher_prompt_key,
)
from mass_ops.render import (
    EpisodeSource,
    RenderError,
    RenderOptions,
    dataset_stats,
    ensure_every_episode_has_windows,
    iter_episode_renders,
)
from mass_ops.render.proxy_log import capped_lines
from mass_ops.stages.common import SPLITS, PostTrainingError, refuse_remote
from mass_ops.store.artifacts import ArtifactKeyError, ArtifactStore
from mass_ops.store.model_folders import (
    fetch_model,
    is_side_file,
    resolve_model_location,
)
from mass_ops.store.schema import Dataset

logger = logging.getLogger(__name__)

# Windows per dataset shard: a paper-sized window is ~49 K tokens, so a shard stays in the tens of MB compressed.
WINDOWS_PER_SHARD = 256
_GZIP_MAGIC = b"\x1f\x8b"


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
                yield from capped_lines(gzip.GzipFile(fileobj=raw) if compressed else raw, f"proxy log {uri}")
        except (OSError, EOFError, zlib.error) as exc:
            raise RenderError(f"proxy log {uri}: unreadable ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class _SelectedEpisode:
    source: EpisodeSource
    episode_id: int


def _store_key(artifacts: ArtifactStore, uri: str, what: str) -> str:
    try:
        return artifacts.key_of(uri)
    except ArtifactKeyError:
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


class _WindowShardWriter:
    """Windows as gzip JSONL shards of at most `per_shard` lines; byte-identical for identical windows."""

    def __init__(self, folder: Path, per_shard: int) -> None:
        self.folder = folder
        self.per_shard = per_shard
        self.paths: list[Path] = []
        self.counts: list[int] = []
        self._handle: gzip.GzipFile | None = None
        self._file: BinaryIO | None = None  # the shard file under `_handle` (GzipFile does not close it)

    def add(self, record: Mapping[str, Any]) -> None:
        if self._handle is None or self.counts[-1] >= self.per_shard:
            self._close_current()
            path = self.folder / f"shard-{len(self.paths):05d}.jsonl.gz"
            self.paths.append(path)
            self.counts.append(0)
            # No name and mtime 0 in the gzip header: a re-render of the same windows gives the same bytes.
            self._file = path.open("wb")
            self._handle = gzip.GzipFile(filename="", mode="wb", fileobj=self._file, mtime=0)
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        self._handle.write(line.encode("utf-8"))
        self.counts[-1] += 1

    def _close_current(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._file is not None:
            self._file.close()
            self._file = None

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
    writer = _WindowShardWriter(folder, WINDOWS_PER_SHARD)
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
def local_shard(ctx: CycleContext, shard: Mapping[str, Any]) -> Iterator[Path]:
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
        with local_shard(ctx, shard) as path, gzip.open(path, "rt", encoding="utf-8") as lines:
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
    refuse_remote(config, "render")
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


def run_render(config: CycleConfig) -> list[dict[str, Any]]:
    """The `render` command: one row per split."""
    return list(render(config)["datasets"].values())
