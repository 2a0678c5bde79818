"""`benchmarks/fault_matrix.py` on one stage without kills, so it cannot rot: the stage runs clean in its own process
and the table parses. The kills themselves are tested in `tests/hardening/test_fault_matrix.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fault_matrix import main
from tests.support.benchmarks import figure


def test_the_search_stage_runs_clean_and_the_table_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--stages", "search", "--kills", "0", "--server-latency", "0", "--keep", str(tmp_path / "matrix")])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.startswith("search "))
    assert [int(cell) for cell in row.split()[1:5]] == [0, 0, 0, 0], row  # kills, reruns, lost, duplicated
    assert float(row.split()[-1]) > 0  # the clean run's working seconds
    assert figure(out, "ledger window (answer -> committed row) over") > 0  # calls
    assert figure(out, "calls: median") >= 0  # ms
    assert out.splitlines()[-1] == "result: 0 lost, 0 duplicated"
