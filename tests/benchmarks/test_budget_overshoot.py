"""`benchmarks/budget_overshoot.py` at a tiny size: every attack is refused within its bound and fully counted."""

from __future__ import annotations

from benchmarks.budget_overshoot import Settings, report, run


def test_every_generation_path_stays_within_one_allowance_per_request_in_flight() -> None:
    results = run(Settings(budget=1500, max_tokens=64, default_max_tokens=128, parallel=2, n=8))
    text = report(results)
    assert {r.scope for r in results} == {"episode", "task"} and len(results) >= 16, text
    assert all(r.refused for r in results), text  # every attack ended at a 402, not at the safety stop
    assert all(r.counted >= r.served for r in results), text
    assert all(r.overshoot <= r.bound for r in results), text
    assert text.splitlines()[-1].startswith("verdict:") and ": OK (" in text.splitlines()[-1]
