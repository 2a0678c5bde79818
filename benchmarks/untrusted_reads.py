"""Bounded reading of what the agent produced (issue #25 item 9): what the limits cost on a plausible workspace, and
what they save on hostile ones. Every figure is printed beside a baseline measured in the same run.

- extract: a plausible workspace archive (text files) unpacked by `store.untrusted.extract_tar_gz` against the
  standard library's plain ``extractall(filter="data")`` of the same archive; the ratio is the checks' overhead
  (they read every header before anything is written).
- bomb: a ~5 MB tar.gz of 5 GiB of zeros refused by the extractor (time, bytes written) against the plain
  extractor unpacking a smaller bomb of the same kind (`--bomb-baseline-mib`): what the whole one would cost it.
- evidence: peak traced memory of an evidence bundle of a workspace whose report is a sparse 500 MB file, against
  reading that report whole, as the judge did before.

    .venv/bin/python benchmarks/untrusted_reads.py [--files 2000 --file-kib 16 --bomb-gib 5 --report-mb 500]
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
import tarfile
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mass_ops.judge.evidence import EvidenceCaps, build_bundle  # noqa: E402
from mass_ops.store.untrusted import ArchiveTooLargeError, extract_tar_gz  # noqa: E402

_MIB = 1 << 20


@dataclass(frozen=True)
class Figures:
    """One run's measurements (seconds, bytes)."""

    extract_s: float
    plain_extract_s: float
    bomb_refuse_s: float
    bomb_written: int
    bomb_archive: int
    bomb_unpacked: int
    plain_bomb_s: float
    plain_bomb_unpacked: int
    evidence_peak: int
    whole_read_peak: int

    def lines(self) -> list[str]:
        per_byte = self.plain_bomb_s / self.plain_bomb_unpacked
        return [
            f"extract: {self.extract_s * 1000:.1f} ms bounded vs {self.plain_extract_s * 1000:.1f} ms plain "
            f"(ratio {self.extract_s / self.plain_extract_s:.2f})",
            f"bomb: {self.bomb_archive / _MIB:.1f} MiB archive of {self.bomb_unpacked / 2**30:.1f} GiB refused in "
            f"{self.bomb_refuse_s * 1000:.2f} ms, {self.bomb_written} bytes written; the plain extractor would write "
            f"{self.bomb_unpacked / 2**30:.1f} GiB in ~{per_byte * self.bomb_unpacked:.1f} s "
            f"(measured {self.plain_bomb_unpacked / _MIB:.0f} MiB in {self.plain_bomb_s:.2f} s; ratio "
            f"{self.bomb_refuse_s / (per_byte * self.bomb_unpacked):.2e})",
            f"evidence: peak {self.evidence_peak / _MIB:.2f} MiB for a sparse report vs "
            f"{self.whole_read_peak / _MIB:.0f} MiB reading it whole "
            f"(ratio {self.evidence_peak / self.whole_read_peak:.4f})",
        ]


def zero_bomb(path: Path, unpacked: int) -> Path:
    """A tar.gz of one member of `unpacked` zero bytes (a multiple of 1 MiB): concatenated gzip members of one
    compressed MiB each, so it is built in milliseconds at ~1000:1."""
    header = tarfile.TarInfo("zeros.bin")
    header.size = unpacked
    zeros = gzip.compress(bytes(_MIB), compresslevel=9, mtime=0)
    with path.open("wb") as out:
        out.write(gzip.compress(header.tobuf(format=tarfile.GNU_FORMAT), mtime=0))
        for _ in range(unpacked // _MIB):
            out.write(zeros)
        out.write(gzip.compress(bytes(2 * tarfile.RECORDSIZE), mtime=0))
    return path


def workspace_archive(path: Path, files: int, file_bytes: int) -> Path:
    """A tar.gz of `files` text files of `file_bytes` bytes each in a few folders (numbers: compresses like code)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for index in range(files):
            text = "".join(f"{index},{row},{row * 7919 % 10007}\n" for row in range(file_bytes // 12 + 1))
            data = text.encode()[:file_bytes]
            info = tarfile.TarInfo(f"dir{index % 16}/file{index}.csv")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=6, mtime=0))
    return path


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _plain_extract(archive: Path, destination: Path) -> None:
    with tarfile.open(archive, mode="r:gz") as tar:
        tar.extractall(destination, filter="data")


def _disk_bytes(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*"))


def _peak(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(
    scratch: Path, *, files: int, file_bytes: int, bomb_bytes: int, bomb_baseline_bytes: int, report_bytes: int
) -> Figures:
    """Run the three measurements in `scratch` (see the module docstring)."""
    archive = workspace_archive(scratch / "ws.tar.gz", files, file_bytes)
    plain_extract_s = _timed(lambda: _plain_extract(archive, scratch / "plain"))
    extract_s = _timed(lambda: extract_tar_gz(archive, scratch / "bounded", what="workspace"))

    bomb = zero_bomb(scratch / "bomb.tar.gz", bomb_bytes)

    def refuse() -> None:
        try:
            extract_tar_gz(bomb, scratch / "refused", what="bomb")
        except ArchiveTooLargeError:
            return
        raise AssertionError("the bomb was not refused")

    bomb_refuse_s = _timed(refuse)
    bomb_written = _disk_bytes(scratch / "refused")
    small_bomb = zero_bomb(scratch / "small-bomb.tar.gz", bomb_baseline_bytes)
    plain_bomb_s = _timed(lambda: _plain_extract(small_bomb, scratch / "plain-bomb"))

    workspace = scratch / "report-ws"
    workspace.mkdir()
    report = workspace / "research_report.md"
    with report.open("wb") as out:
        out.write(b"# Report\n")
        out.truncate(report_bytes)
    caps = EvidenceCaps.local("qwen")
    evidence_peak = _peak(lambda: build_bundle(workspace, task_id=51, task_text="t", location="ws", caps=caps))
    whole_read_peak = _peak(lambda: report.read_bytes().decode("utf-8", errors="replace"))
    return Figures(
        extract_s,
        plain_extract_s,
        bomb_refuse_s,
        bomb_written,
        bomb.stat().st_size,
        bomb_bytes,
        plain_bomb_s,
        bomb_baseline_bytes,
        evidence_peak,
        whole_read_peak,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kib", type=int, default=16)
    parser.add_argument("--bomb-gib", type=float, default=5.0)
    parser.add_argument("--bomb-baseline-mib", type=int, default=256)
    parser.add_argument("--report-mb", type=int, default=500)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mass-untrusted-bench-") as scratch:
        figures = measure(
            Path(scratch),
            files=args.files,
            file_bytes=args.file_kib * 1024,
            bomb_bytes=int(args.bomb_gib * 1024) * _MIB,
            bomb_baseline_bytes=args.bomb_baseline_mib * _MIB,
            report_bytes=args.report_mb * 1_000_000,
        )
    for line in figures.lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
