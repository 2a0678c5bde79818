"""`benchmarks/untrusted_reads.py` at a tiny size, so it cannot rot: the bomb is refused with nothing written and
the evidence of a sparse report stays far below reading it whole (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.untrusted_reads import main, measure


def test_the_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    figures = measure(
        tmp_path,
        files=20,
        file_bytes=2048,
        bomb_bytes=1 << 30,
        bomb_baseline_bytes=4 << 20,
        report_bytes=50_000_000,
    )
    assert figures.bomb_written == 0 and figures.bomb_archive < 2 << 20
    assert figures.evidence_peak < figures.whole_read_peak / 10
    lines = figures.lines()
    assert [line.split(":")[0] for line in lines] == ["extract", "bomb", "evidence"]
    assert all("ratio" in line for line in lines)


def test_the_command_line_prints_three_figures(capsys) -> None:  # type: ignore[no-untyped-def]
    assert (
        main(["--files", "5", "--file-kib", "1", "--bomb-gib", "1", "--bomb-baseline-mib", "2", "--report-mb", "20"])
        == 0
    )
    assert len(capsys.readouterr().out.splitlines()) == 3
