"""Estimates at the preset's own scale, checked against the actuals of a recorded demo cycle.

`fixtures/demo_cycle.json` holds every episode and LLM call attempt of one `mass-ops demo` run (tokens, seconds and
unit keys, read from its metadata store; no content). The demo preset's estimate, made before any cycle has run, is
within ±50% of those actuals in total, and the estimate of its next cycle (generation 1, per-unit figures measured on
the recorded cycle) within ±20%, taking the next cycle to repeat the recorded one's work.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mass_ops.config import load_config
from mass_ops.cost.estimate import CycleEstimate
from mass_ops.ops.plan import build_plan, cycle_estimate
from mass_ops.store.repository import MetadataRepository
from mass_ops.train.plan import training_command_for
from tests.inner_loop_fakes import migrated_sqlite

FIXTURE = Path(__file__).parent / "fixtures" / "demo_cycle.json"
STAGE_OF_EPISODE = {"reference": "search", "search": "search", "collection": "collect", "rollout": "evaluate"}


def recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def actual_tokens_by_stage(cycle: dict[str, Any]) -> dict[str, int]:
    """The recorded cycle's tokens per stage, as the report's stage tables count them."""
    totals: dict[str, int] = {}
    for e in cycle["episodes"]:
        stage = STAGE_OF_EPISODE[e["kind"]]
        totals[stage] = totals.get(stage, 0) + e["prompt_tokens"] + e["completion_tokens"]
    for c in cycle["calls"]:
        stage = (
            "evaluate" if c["unit_key"].startswith("eval/") else "rank" if c["purpose"] == "self_judge" else "search"
        )
        totals[stage] = totals.get(stage, 0) + c["prompt_tokens"] + c["completion_tokens"]
    return totals


def record_cycle(repo: MetadataRepository, name: str, cycle: dict[str, Any]) -> int:
    """Write the fixture's episodes and call attempts as the cycle `name`; returns its id."""
    row = repo.ensure_cycle(name, {"preset": "demo"}, "d" * 64)
    start = datetime(2026, 12, 5, 3, 46, tzinfo=UTC)
    for e in cycle["episodes"]:
        repo.record_episode(
            row.id, task_id=e["task_id"], kind=e["kind"], seed=e["seed"], version=e["version"],
            candidate=e["candidate"], generation=e["generation"], status="succeeded",
            prompt_tokens=e["prompt_tokens"], completion_tokens=e["completion_tokens"], started_at=start,
            finished_at=start + timedelta(seconds=e["seconds"]), duration_s=e["seconds"],
        )  # fmt: skip
    for c in cycle["calls"]:
        repo.record_llm_call(row.id, c["unit_key"], purpose=c["purpose"], model="mass-tiny-L0", task_id=c["task_id"],
                             status="invalid", prompt_tokens=c["prompt_tokens"],
                             completion_tokens=c["completion_tokens"], latency_s=c["seconds"])  # fmt: skip
    return row.id


def per_stage(estimate: CycleEstimate, actual: dict[str, int]) -> str:
    lines = [f"{s.stage}: est. {s.tokens:,} / actual {actual.get(s.stage, 0):,}" for s in estimate.stages]
    return "; ".join(lines)


def test_the_demo_estimate_is_within_half_of_a_demo_cycle_s_actuals(tmp_path: Path) -> None:
    config = load_config("demo", [f"storage.metadata_url=sqlite:///{tmp_path}/absent.db"])
    estimate = cycle_estimate(config, build_plan(config, training_command_for(config)))
    actual = actual_tokens_by_stage(recorded())
    assert estimate.lineage_cycle is None and estimate.scale == "demo"
    ratio = estimate.total.tokens / sum(actual.values())
    assert 0.5 <= ratio <= 1.5, f"estimate/actual {ratio:.2f}: {per_stage(estimate, actual)}"
    # Every stage that spends tokens within ±50% as well, and a CPU run has no GPU-hours to price.
    for stage in ("search", "collect", "rank", "evaluate"):
        found = estimate.stage(stage)
        assert found is not None and 0.5 <= found.tokens / actual[stage] <= 1.5, per_stage(estimate, actual)
    assert estimate.total.gpu_hours == 0.0 and estimate.total.cost_usd == 0.0


def test_a_cycle_with_a_parent_is_estimated_within_a_fifth_of_its_actuals(tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path / "meta.db")
    repo = MetadataRepository.from_url(url)
    cycle = recorded()
    parent = record_cycle(repo, "demo-L0", cycle)
    repo.register_generation("L1", 1, cycle_id=parent, bf16_uri="models/L1-bf16")
    config = load_config("demo", [f"storage.metadata_url={url}", "generation=1"])
    estimate = cycle_estimate(config, build_plan(config, training_command_for(config)))
    actual = actual_tokens_by_stage(cycle)
    assert estimate.lineage_cycle == "demo-L0"
    ratio = estimate.total.tokens / sum(actual.values())
    assert 0.8 <= ratio <= 1.2, f"estimate/actual {ratio:.2f}: {per_stage(estimate, actual)}"
    # Per stage too: a judge call measured as one unit with all its retried attempts (rank is judge calls only).
    for stage in ("search", "collect", "rank", "evaluate"):
        found = estimate.stage(stage)
        assert found is not None and 0.8 <= found.tokens / actual[stage] <= 1.2, per_stage(estimate, actual)
