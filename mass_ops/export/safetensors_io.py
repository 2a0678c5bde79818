"""Streaming safetensors shards: read one tensor (or a row range) at a time, write into a pre-planned file.

Why not ``safetensors.safe_open`` + ``save_file``: ``safe_open`` memory-maps the shard and every page a tensor read
touches stays resident until the handle closes, so the process ends up holding the whole shard; ``save_file`` needs
every output tensor in memory at once. Export runs on 50+ GB checkpoints, so this module reads with positioned reads
into small buffers and writes each output shard into a file whose header (names, dtypes, shapes, offsets) is planned
before any data exists. Peak memory is then bounded by the chunk being processed, not by the shard.

The on-disk format is the public safetensors layout: little-endian u64 header length, a JSON header (padded with
spaces to a multiple of 8), then the tensor bytes, contiguous and without holes. Tensors are laid out by decreasing
element size so every tensor starts at an offset aligned to its own element size, as ``safetensors`` itself does.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from mass_ops.errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

# safetensors dtype code -> torch dtype. Tensors of any other code can still be copied byte for byte.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {code: dtype.itemsize for code, dtype in DTYPES.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bytes moved per read/write call when copying or streaming; large enough for full disk bandwidth, small for RSS.
COPY_CHUNK_BYTES = 64 * 1024 * 1024
# Elements of one streamed row chunk of a weight being merged or quantized (fp32: 4 MiB); memory stays bounded by a
# chunk, not by the tensor or the shard. Fastest in benchmarks/export_throughput.py: at 4x this size the buffers fall
# out of cache between the several conversions done on each chunk, at 1/4 the per-call overhead shows.
CHUNK_ELEMENTS = 1024 * 1024


class ExportError(InputError):
    """A checkpoint, adapter or output directory that export cannot process; the message names what and where."""


def row_chunks(rows: int, cols: int, align: int) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges ``[start, stop)`` covering ``rows``, each about ``CHUNK_ELEMENTS`` elements and a whole
    number of ``align`` rows (only the last may be shorter).

    The LoRA merge, the FP8 export and the fused pass all split a weight with this one function: a gemm's rounding
    can depend on how many rows it is given, so the same split is what makes their results bit-identical.
    """
    step = max(align, (CHUNK_ELEMENTS // max(cols, 1)) // align * align)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class ScratchBuffers:
    """Flat work buffers reused across chunks.

    A fresh multi-megabyte tensor is page-faulted in (and zeroed by the kernel) on every allocation, which on CPU
    costs several times the arithmetic done on it; reusing a few buffers keeps conversions at memory bandwidth.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._turns: dict[str, int] = {}

    def take(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of ``numel`` elements; its content is garbage and it is valid until ``key`` is taken again."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:numel]

    def take_turn(self, key: str, numel: int, dtype: torch.dtype, turns: int) -> torch.Tensor:
        """Like ``take``, but each call under ``key`` gets the next of ``turns`` buffers in rotation, so a result
        stays valid until ``turns`` more calls with that key (a consumer on another thread may still be reading it).
        """
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return self.take(f"{key}#{turn % turns}", numel, dtype)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: its safetensors dtype code, shape and byte range relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ExportError(f"tensor {self.name}: dtype {self.dtype} has no torch equivalent") from None

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the first dimension (the whole tensor for a scalar)."""
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0


@dataclass(frozen=True)
class TensorSpec:
    """A tensor an output shard will hold: what the header needs before any data is written."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        try:
            return count * _ITEMSIZE[self.dtype]
        except KeyError:
            raise ExportError(f"tensor {self.name}: unknown safetensors dtype {self.dtype}") from None

    @classmethod
    def like(cls, entry: TensorEntry) -> TensorSpec:
        return cls(entry.name, entry.dtype, entry.shape)


def storage_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The order a shard stores its tensors in: larger elements first (stable), so every tensor starts at an offset
    aligned to its own element size (the header is padded to 8 bytes)."""
    return sorted(specs, key=lambda spec: -_ITEMSIZE.get(spec.dtype, 1))


def _read_exact(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ExportError(f"{where}: file ends before the bytes its header promises")
        done += got


def _write_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class ShardReader:
    """Positioned reads of single tensors (or row ranges) from one safetensors file, without memory-mapping it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ExportError(f"{self.path}: cannot open shard ({exc.strerror})") from None
        try:
            self.entries, self.metadata, self._data_start = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
        size = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) < 8:
            raise ExportError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ExportError(f"{self.path}: not a safetensors file (header length {header_len} is invalid)")
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ExportError(f"{self.path}: safetensors header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ExportError(f"{self.path}: safetensors header is not a JSON object")
        data_start = 8 + header_len
        data_size = size - data_start
        metadata = header.pop("__metadata__", None) or {}
        entries: dict[str, TensorEntry] = {}
        for name, raw in header.items():
            try:
                dtype, shape, (start, end) = raw["dtype"], tuple(int(d) for d in raw["shape"]), raw["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ExportError(f"{self.path}: header entry {name!r} lacks dtype/shape/data_offsets") from None
            if not 0 <= start <= end <= data_size:
                raise ExportError(f"{self.path}: tensor {name} has byte range [{start}, {end}) outside the file")
            entry = TensorEntry(name, dtype, shape, int(start), int(end))
            if dtype in _ITEMSIZE and TensorSpec.like(entry).nbytes != entry.nbytes:
                raise ExportError(f"{self.path}: tensor {name} byte range does not match {dtype}{list(shape)}")
            entries[name] = entry
        return entries, dict(metadata), data_start

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise ExportError(f"{self.path}: no tensor named {name}") from None

    def read_rows(self, name: str, start: int, stop: int, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` along dimension 0, in the stored dtype.

        The result is a fresh tensor, or a view of the flat uint8 buffer ``into`` (valid until it is reused).
        """
        entry = self.entry(name)
        if not entry.shape:
            return self.read(name)
        nbytes = (stop - start) * entry.row_bytes
        buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into[:nbytes]
        _read_exact(
            self._fd,
            buffer.numpy().data,
            self._data_start + entry.start + start * entry.row_bytes,
            f"{self.path} [{name}]",
        )
        return buffer.view(entry.torch_dtype).reshape((stop - start, *entry.shape[1:]))

    def read_chunks(self, name: str, align: int, scratch: ScratchBuffers, key: str) -> Iterator[torch.Tensor]:
        """A 2-D tensor's rows in the chunks of ``row_chunks``, each read into scratch buffer ``key`` and valid until
        the next one is produced."""
        entry = self.entry(name)
        rows, cols = entry.shape
        for start, stop in row_chunks(rows, cols, align):
            yield self.read_rows(
                name, start, stop, into=scratch.take(key, (stop - start) * entry.row_bytes, torch.uint8)
            )

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor as a fresh tensor (not a view of the file)."""
        entry = self.entry(name)
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        _read_exact(self._fd, buffer.numpy().data, self._data_start + entry.start, f"{self.path} [{name}]")
        return buffer.view(entry.torch_dtype).reshape(entry.shape)

    def raw_span(self, name: str) -> tuple[int, int, int]:
        """(file descriptor, absolute offset, length) of a tensor's bytes, for a byte-for-byte copy."""
        entry = self.entry(name)
        return self._fd, self._data_start + entry.start, entry.nbytes


class ShardWriter:
    """Writes one safetensors file whose tensors are declared up front and then filled in any order.

    Each tensor is filled front to back by one or more ``write`` calls (whole tensor or consecutive row chunks);
    ``close`` fails if any declared tensor is incomplete, so a truncated shard is never mistaken for a finished one.
    """

    def __init__(
        self, path: str | os.PathLike[str], specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None
    ):
        self.path = Path(path)
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ExportError(f"{self.path}: duplicate tensor names in the planned shard")
        ordered = storage_order(specs)
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._layout: dict[str, tuple[TensorSpec, int]] = {}
        offset = 0
        for spec in ordered:
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._layout[spec.name] = (spec, offset)
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(encoded)
        self.size = self._data_start + offset
        self._written = dict.fromkeys(names, 0)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.size)
        _write_exact(self._fd, memoryview(struct.pack("<Q", len(encoded)) + encoded), 0)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _claim(self, name: str, nbytes: int) -> int:
        """Absolute file offset for the next ``nbytes`` of tensor ``name``; checks they fit."""
        try:
            spec, start = self._layout[name]
        except KeyError:
            raise ExportError(f"{self.path}: tensor {name} was not declared for this shard") from None
        done = self._written[name]
        if done + nbytes > spec.nbytes:
            raise ExportError(f"{self.path}: more bytes written for {name} than its shape {list(spec.shape)} holds")
        self._written[name] = done + nbytes
        return self._data_start + start + done

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (the whole tensor, or the next rows of it) to the declared tensor ``name``."""
        spec, _ = self._layout.get(name, (None, 0))
        if spec is None:
            raise ExportError(f"{self.path}: tensor {name} was not declared for this shard")
        code = DTYPE_CODES.get(tensor.dtype)
        if code != spec.dtype:
            raise ExportError(f"{self.path}: tensor {name} declared {spec.dtype}, got {tensor.dtype}")
        if spec.shape and tuple(tensor.shape[1:]) != spec.shape[1:] and tuple(tensor.shape) != spec.shape:
            raise ExportError(
                f"{self.path}: tensor {name} chunk shape {list(tensor.shape)} does not fit {list(spec.shape)}"
            )
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        _write_exact(self._fd, data.numpy().data, self._claim(name, data.numel()))

    def copy_from(self, reader: ShardReader, name: str, *, as_name: str | None = None) -> None:
        """Copy a tensor byte for byte from ``reader`` (in kernel space where the platform allows)."""
        src_fd, src_offset, nbytes = reader.raw_span(name)
        target = as_name or name
        spec, _ = self._layout.get(target, (None, 0))
        entry = reader.entry(name)
        if spec is None or spec.dtype != entry.dtype or spec.shape != entry.shape:
            raise ExportError(f"{self.path}: tensor {target} was not declared as {entry.dtype}{list(entry.shape)}")
        dst_offset = self._claim(target, nbytes)
        copied = 0
        while copied < nbytes:
            step = min(COPY_CHUNK_BYTES, nbytes - copied)
            moved = 0
            if hasattr(os, "copy_file_range"):
                try:
                    moved = os.copy_file_range(src_fd, self._fd, step, src_offset + copied, dst_offset + copied)
                except OSError:
                    moved = 0
            if moved <= 0:  # Cross-filesystem or unsupported: plain read/write of one chunk.
                chunk = os.pread(src_fd, step, src_offset + copied)
                if not chunk:
                    raise ExportError(f"{reader.path}: file ends inside tensor {name}")
                _write_exact(self._fd, memoryview(chunk), dst_offset + copied)
                moved = len(chunk)
            copied += moved

    def close(self) -> None:
        if self._fd < 0:
            return
        missing = [name for name, (spec, _) in self._layout.items() if self._written[name] != spec.nbytes]
        os.close(self._fd)
        self._fd = -1
        if missing:
            raise ExportError(f"{self.path}: shard closed with incomplete tensors: {', '.join(sorted(missing)[:5])}")

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class CheckpointLayout:
    """Which shard file holds which tensor, read from the index (or the single ``model.safetensors``)."""

    root: Path
    weight_map: dict[str, str]
    has_index: bool

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def entries(self) -> dict[str, TensorEntry]:
        """Header entries of every tensor in the checkpoint (headers only; no tensor data is read)."""
        found: dict[str, TensorEntry] = {}
        for shard in self.shard_files:
            with ShardReader(self.root / shard) as reader:
                # A tensor the index does not assign to this shard is invisible to every loader; ignore it too.
                found.update({n: e for n, e in reader.entries.items() if self.weight_map.get(n) == shard})
        missing = sorted(set(self.weight_map) - set(found))
        if missing:
            raise ExportError(f"{self.root}: index names {missing[0]} but no shard holds it")
        return found


def read_layout(root: str | os.PathLike[str]) -> CheckpointLayout:
    """Layout of the safetensors checkpoint in ``root``; an error if there is none."""
    root = Path(root)
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ExportError(f"{index_path}: not a safetensors index ({exc})") from None
        for shard in set(weight_map.values()):
            if not (root / shard).is_file():
                raise ExportError(f"{index_path}: shard {shard} is listed but missing")
        return CheckpointLayout(root, dict(weight_map), has_index=True)
    single = root / SINGLE_FILE_NAME
    if single.is_file():
        with ShardReader(single) as reader:
            return CheckpointLayout(root, dict.fromkeys(reader.entries, SINGLE_FILE_NAME), has_index=False)
    raise ExportError(f"{root}: no {INDEX_NAME} or {SINGLE_FILE_NAME} (not a safetensors checkpoint)")


def write_index(root: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, dst: Path, *, skip: set[str]) -> list[str]:
    """Copy every entry of ``src`` (files and folders) except the names in ``skip``; returns the names copied."""
    copied = []
    for item in sorted(src.iterdir()):
        if item.name in skip:
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        else:
            shutil.copy2(item, dst / item.name)
        copied.append(item.name)
    return copied


def refuse_populated(out_dir: Path) -> None:
    """An error unless ``out_dir`` is absent or an empty folder (a finished export is never overwritten)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: output directory exists and is not empty; refusing to overwrite it")


@contextmanager
def staged_output_dir(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp folder next to ``out_dir`` that becomes ``out_dir`` only if the block succeeds.

    Refuses an ``out_dir`` that already has content, so a finished export is never overwritten or mixed with a
    partial one; on failure the temp folder is removed and ``out_dir`` is left as it was.
    """
    out_dir = Path(out_dir)
    refuse_populated(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield staging
        staging.chmod(0o755)
        # rename(2) replaces an empty directory atomically; a concurrent writer that filled it meanwhile makes it fail.
        try:
            os.replace(staging, out_dir)
        except OSError as exc:
            raise ExportError(f"{out_dir}: cannot publish the finished export ({exc.strerror})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
