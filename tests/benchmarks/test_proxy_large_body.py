"""`benchmarks/proxy_large_body.py` at a tiny size: the phases run, the flood really is in flight, and every small
request is answered (the latency figures themselves are the benchmark's to print, not a test's to assert)."""

from __future__ import annotations

from benchmarks.proxy_large_body import report, run


def test_small_requests_are_answered_while_large_bodies_are_in_flight() -> None:
    limit = 1024**2
    phases = run(limit, 4 * limit, limit - 64 * 1024, 20)  # the body under the limit goes to the parser process
    text = report(phases, limit)
    assert [phase.statuses for phase in phases] == [{200}, {200}, {200}], text
    assert phases[1].flood_sent >= 1 and phases[1].flood_status in ("413", "0"), text  # 0: closed while sending
    assert phases[2].flood_sent >= 1 and phases[2].flood_status == "200", text
    assert all(len(phase.samples) == 20 for phase in phases)
    assert text.splitlines()[-1].startswith("verdict: worst p99")
