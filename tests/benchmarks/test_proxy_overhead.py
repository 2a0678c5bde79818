"""`benchmarks/proxy_overhead.py` at a tiny size, so it cannot rot: streams relay, every record is whole and the
figure lines parse (the relay and latency targets are the benchmark's verdict, not the suite's)."""

from __future__ import annotations

import pytest

from benchmarks.proxy_overhead import main
from tests.support.benchmarks import figure


def test_a_few_streams_and_requests_go_through_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--events", "200", "--repeats", "1", "--requests", "5"])
    out = capsys.readouterr().out
    assert figure(out, "proxied  best") > 0  # MB/s
    assert figure(out, "relay ratio (best/best)") > 0
    figure(out, "added    p50")  # ms, negative when the proxied path happened to answer faster
    assert "raw SSE kept whole: True, in request order: True" in out, out
