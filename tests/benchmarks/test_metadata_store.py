"""`benchmarks/metadata_store.py --tiny` on a fresh Postgres database (created and dropped by the script, on the
suite's server), so it cannot rot: a rerun writes nothing and the figure lines parse (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks.metadata_store import main
from tests.fixtures.postgres import admin_url
from tests.support.benchmarks import figure


def test_a_tiny_cycle_is_recorded_twice_and_the_queries_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--repeat", "1", "--admin-url", admin_url()]) == 0
    out = capsys.readouterr().out
    assert figure(out, "tiny cycle:") > 0  # rows
    assert figure(out, "idempotent units, one transaction each :") > 0  # seconds
    assert figure(out, "rerun, every unit a no-op             :") > 0
    assert figure(out, "ratio idempotent / plain per unit:") > 0
    assert figure(out, "ratio idempotent / one transaction:") > 0
    assert figure(out, "best checkpoint") >= 0  # ms of a hot query
