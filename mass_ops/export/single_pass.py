"""LoRA merge and block FP8 export in one pass over the base checkpoint (MASS_SPEC §9's two steps, fused).

Each base shard is read once and each targeted weight merged once; every merged row chunk is written to the BF16
shard and, while still in memory, quantized into the FP8 shards. The separate steps read the base, write the merged
model, then read it all back to quantize it; this pass skips that second read. The merge runs on the calling thread
and the FP8 half on one worker thread, a chunk behind, so two CPUs share the work.

Both outputs are bit-identical to ``merge_lora`` followed by ``export_fp8`` of its result: the same row chunks
(``row_chunks``), the same arithmetic, the same header order, the same side files. The BF16 folder is published
first, then the FP8 folder, as the two steps would; each appears only when complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from mass_ops.export.fp8 import Fp8Info, Fp8Output, export_fp8
from mass_ops.export.merge import (
    ROW_ALIGN,
    MergeInfo,
    finish_merge,
    merge_lora,
    merge_targets,
    merged_chunks,
    merged_shard_writer,
    read_adapter,
    read_factors,
)
from mass_ops.export.safetensors_io import (
    CheckpointLayout,
    ExportError,
    ScratchBuffers,
    ShardReader,
    ShardWriter,
    TensorEntry,
    TensorSpec,
    read_layout,
    refuse_populated,
    staged_output_dir,
    storage_order,
)
from mass_ops.export.torch_threads import export_threads


def _stored_order(layout: CheckpointLayout, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """``entries`` in the order the merged checkpoint stores them (shard by shard, in each shard's storage order):
    the order ``export_fp8`` would meet them in the merged folder, which fixes the FP8 headers' order."""
    ordered: dict[str, TensorEntry] = {}
    for shard in layout.shard_files:
        specs = [TensorSpec.like(e) for e in entries.values() if layout.weight_map[e.name] == shard]
        ordered.update({spec.name: entries[spec.name] for spec in storage_order(specs)})
    return ordered


class _Fp8Lane:
    """The FP8 half of the pass, on a worker thread: quantizing (or copying) one chunk overlaps merging the next, so
    two CPUs work without OpenMP's per-operation barriers. Jobs run one at a time, in submission order, and only
    they touch the FP8 shard writers.

    Leaving the ``with`` block waits for every job, so none outlives the shard files it reads or writes; a job's
    error is raised there (or earlier, from ``submit``) unless the pass is already failing.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8-export")
        self._jobs: deque[Future[None]] = deque()
        self.scratch = ScratchBuffers()  # the worker's own: the main thread's are reused while jobs still run
        self._last_chunk: Future[None] | None = None

    def submit(self, job: Callable[..., None], *args: object) -> Future[None]:
        while self._jobs and self._jobs[0].done():
            self._jobs.popleft().result()  # surfaces a failed job's error now rather than at the end
        future = self._pool.submit(job, *args)
        self._jobs.append(future)
        return future

    def submit_chunk(self, job: Callable[[torch.Tensor], None], chunk: torch.Tensor) -> None:
        """Submit ``job(chunk)`` for a chunk from a pair of buffers used in turn, then wait for the job of the chunk
        submitted before it: on return, the other buffer is free to be refilled."""
        future = self.submit(job, chunk)
        if self._last_chunk is not None:
            self._last_chunk.result()
        self._last_chunk = future

    def __enter__(self) -> _Fp8Lane:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        errors = []
        for future in self._jobs:
            try:
                future.result()
            except Exception as error:
                errors.append(error)
        self._pool.shutdown()
        if exc_type is None and errors:
            raise errors[0]


def _export_shard(
    reader: ShardReader,
    writer: ShardWriter,
    visible: set[str],
    targets: dict[str, tuple[str, str]],
    lora: ShardReader,
    scale: float,
    fp8: Fp8Output,
    scratch: ScratchBuffers,
    lane: _Fp8Lane,
) -> None:
    """Every tensor of one base shard into its merged shard (``writer``, on this thread) and, those in ``visible``,
    into the FP8 shards (on ``lane``)."""
    for name in reader.entries:
        if name not in visible:  # the index assigns it elsewhere: kept in the merged file, unseen by loaders
            writer.copy_from(reader, name)
        elif name in targets:
            # The lane works on chunk i while chunk i+1 is merged into the other of two buffers.
            chunks = merged_chunks(reader, name, read_factors(lora, targets[name]), scale, scratch, turns=2)
            if fp8.quantizes(name):
                quantizer = fp8.quantizer(name, reader.path, lane.scratch)
                consume, finish = quantizer.add, quantizer.close
            else:
                consume, finish = partial(fp8.write, name), None
            for rows in chunks:
                writer.write(name, rows)
                lane.submit_chunk(consume, rows)
            if finish is not None:
                lane.submit(finish)
        else:
            writer.copy_from(reader, name)
            if fp8.quantizes(name):
                chunks = reader.read_chunks(name, fp8.block[0], lane.scratch, "fp8.raw")
                lane.submit(fp8.quantize, name, chunks, reader.path, lane.scratch)
            else:
                lane.submit(fp8.copy, reader, name)


@export_threads(lanes=2)
def merge_and_export_fp8(
    base_dir: str | Path,
    lora_path: str | Path,
    bf16_out: str | Path,
    fp8_out: str | Path,
    *,
    r: int | None = None,
    alpha: float | None = None,
    reference_dir: str | Path | None = None,
) -> tuple[MergeInfo, Fp8Info]:
    """``merge_lora(base_dir, lora_path, bf16_out)`` then ``export_fp8(bf16_out, fp8_out, reference_dir=…)``, in one
    pass; returns what each would.

    Everything either step would refuse (adapter, base, reference, a populated output folder) is refused before any
    data is written. A reference whose block height does not divide the merge's row chunks (never the case for the
    128×128 blocks of MASS_SPEC §9) makes the two steps run one after the other instead.
    """
    base_dir = Path(base_dir)
    ref_dir = Path(reference_dir) if reference_dir is not None else None
    if Path(bf16_out).resolve() == Path(fp8_out).resolve():
        raise ExportError(f"{fp8_out}: the BF16 and FP8 exports need different output folders")
    refuse_populated(Path(bf16_out))
    refuse_populated(Path(fp8_out))
    adapter = read_adapter(lora_path, r=r, alpha=alpha)
    layout = read_layout(base_dir)
    entries = layout.entries()
    with ShardReader(adapter.path) as lora:
        targets = merge_targets(adapter, entries, lora, base_dir)
        # The merged folder carries the base's config.json verbatim, so the FP8 plan can read it from the base.
        fp8 = Fp8Output(_stored_order(layout, entries), layout.weight_map, base_dir, ref_dir)
        if ROW_ALIGN % fp8.block[0]:
            merge_info = merge_lora(base_dir, lora_path, bf16_out, r=r, alpha=alpha)
            return merge_info, export_fp8(bf16_out, fp8_out, reference_dir=ref_dir)

        with staged_output_dir(fp8_out) as fp8_stage:
            with staged_output_dir(bf16_out) as bf16_stage:
                scratch = ScratchBuffers()
                with fp8.shards_open(fp8_stage):
                    for shard in layout.shard_files:
                        visible = {name for name, file in layout.weight_map.items() if file == shard}
                        with (
                            ShardReader(base_dir / shard) as reader,
                            merged_shard_writer(bf16_stage / shard, reader) as writer,
                            _Fp8Lane() as lane,
                        ):
                            _export_shard(reader, writer, visible, targets, lora, adapter.scale, fp8, scratch, lane)
                merge_info = finish_merge(bf16_stage, base_dir, layout.shard_files, adapter, Path(lora_path), bf16_out)
            # Side files come from the published BF16 folder, as export_fp8 of it would copy them.
            fp8_info = fp8.finish(fp8_stage, Path(bf16_out), layout.shard_files, fp8_out)
    return merge_info, fp8_info
