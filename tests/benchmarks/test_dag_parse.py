"""`benchmarks/dag_parse.py` on one DAG file with one process each, so it cannot rot: the file parses into its DAG
and the figure lines parse (the parse time against its target is the benchmark's verdict, not the suite's)."""

from __future__ import annotations

import pytest

from benchmarks.dag_parse import main
from tests.support.benchmarks import figure


def test_one_dag_file_parses_and_the_figures_print(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--runs", "1", "--files", "mass_benchmarks.py"])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # 1: over the target, on a busy machine
    assert figure(out, "baseline (empty DAG file): best") > 0  # ms
    row = next(line for line in out.splitlines() if line.startswith("mass_benchmarks.py"))
    assert row.split()[1] == "mass_benchmarks", row  # the DAG the file defines
    assert figure(out, "mass_benchmarks.py") > 0  # best ms
    assert figure(out, "worst file at") > 0  # × the target


def test_an_unknown_dag_file_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--files", "no_such_dag.py"])
    assert exited.value.code == 2
    assert "no_such_dag.py" in capsys.readouterr().err.splitlines()[-1]
