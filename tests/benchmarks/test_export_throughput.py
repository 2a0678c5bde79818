"""`benchmarks/export_throughput.py` on a model of one tiny shard, so it cannot rot: every phase runs in its own
process and the figure lines parse (throughput and memory targets are the benchmark's verdict, not the suite's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.export_throughput import main
from tests.support.benchmarks import figure


def test_a_tiny_model_is_merged_and_exported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--layers", "1", "--hidden", "64", "--intermediate", "128", "--repeat", "1", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert figure(out, "in 1 shards (largest") >= 0  # MiB
    for label in ("baseline load+save", "merge_lora", "export_fp8", "merge, then FP8", "merge + FP8, 1 pass"):
        assert figure(out, f"{label:<20}:") >= 0, label  # seconds
    assert figure(out, "throughput ratio (one-pass merge+FP8 / load+save):") >= 0
    assert figure(out.splitlines()[-1], "merge + FP8, 1 pass") > 0  # its peak RSS, MiB
    assert list(tmp_path.iterdir()) == []  # the scratch folder is gone
