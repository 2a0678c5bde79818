"""Promotion (issue 29, item 6): a generation registered by a cycle that requires approval is not served to nightly
evaluation until its promotion is recorded; the approval's headline is the cycle's recorded evaluation in plain text;
a cycle without the gate serves its generation at once; promoting twice records once."""

from __future__ import annotations

from pathlib import Path

from mass_ops.config import load_config
from mass_ops.context import CycleContext
from mass_ops.layout import PAIRWISE_KIND
from mass_ops.stages.nightly import nightly_config, nightly_targets
from mass_ops.stages.promotion import PROMOTION_KIND, promote, promotion_headline, promotion_request
from tests.inner_loop_fakes import migrated_sqlite, open_test_cycle

OVERALL = {"wins": 18, "losses": 11, "ties": 3, "invalid": 0, "judgments": 32, "pairs": 16, "win_rate": 0.6207,
           "wilson_95": [0.4427, 0.7727], "bootstrap_95": [0.45, 0.78]}  # fmt: skip


def open_cycle_for(tmp_path: Path, *, require_approval: bool, name: str, generation: int = 0) -> CycleContext:
    url = (
        migrated_sqlite(tmp_path / "meta.db")
        if not (tmp_path / "meta.db").exists()
        else f"sqlite:///{tmp_path}/meta.db"
    )
    config = load_config(
        "demo",
        [
            f"name={name}",
            f"generation={generation}",
            f"storage.metadata_url={url}",
            f"storage.artifact_url={tmp_path / 'artifacts'}",
            f"promotion.require_approval={'true' if require_approval else 'false'}",
        ],
    )
    return open_test_cycle(config)


def register(ctx: CycleContext, name: str, generation: int, parent_id: int | None) -> int:
    return ctx.repo.register_generation(
        name, generation, bf16_uri=f"models/{name}-bf16", parent_id=parent_id, cycle_id=ctx.cycle_id,
        lineage={"cycle": ctx.cycle_name},
    ).id  # fmt: skip


def test_a_gated_generation_is_served_only_once_promoted(tmp_path: Path) -> None:
    ctx = open_cycle_for(tmp_path, require_approval=True, name="gated-L0")
    base = ctx.repo.register_generation("L0", 0, bf16_uri="models/L0-bf16")
    child = register(ctx, "L1", 1, base.id)
    nightly = open_test_cycle(nightly_config(ctx.config))
    assert nightly_targets(nightly) == [], "L1 awaits approval; L0 alone has nothing to compare with"

    request = promotion_request(ctx)
    assert request["required"] is True and (request["generation"], request["baseline"]) == ("L1", "L0")
    assert "No evaluation of L1 against L0 is recorded in this cycle." in request["headline"]
    ctx.repo.record_evaluation(
        "pairwise/gated-L0/test", PAIRWISE_KIND, generation_id=child, baseline_generation_id=base.id,
        cycle_id=ctx.cycle_id,
        results={"generation_a": "L1", "generation_b": "L0", "pairs": 16, "judges": ["judge-a", "judge-b"],
                 "summary": {"overall": OVERALL}},
    )  # fmt: skip
    assert promotion_headline(ctx).split("\n\n") == [
        "Cycle gated-L0 trained L1 from L0.",
        "L1 against L0: win rate 0.62, 95% interval 0.44 to 0.77 (Wilson).",
        "18 wins, 11 losses, 3 ties in 32 judgments of 16 pairs; judges: judge-a, judge-b.",
        "Report: /mass-ops/reports/gated-L0/",
        "Approve to serve L1 to nightly evaluation and the next cycle; reject to keep serving L0.",
    ]

    promoted = promote(ctx, "ops-lead")
    assert (promoted["generation"], promoted["approval"], promoted["approved_by"]) == ("L1", "approved", "ops-lead")
    assert nightly_targets(nightly) == ["L1"]
    assert promote(ctx, "someone-else")["approved_by"] == "ops-lead", "recorded once; a rerun returns it"
    assert len(ctx.repo.evaluations(kind=PROMOTION_KIND)) == 1


def test_without_the_gate_a_generation_is_served_at_once_and_a_newer_gated_one_is_passed_over(tmp_path: Path) -> None:
    free = open_cycle_for(tmp_path, require_approval=False, name="free-L0")
    base = free.repo.register_generation("L0", 0, bf16_uri="models/L0-bf16")
    first = register(free, "L1", 1, base.id)
    nightly = open_test_cycle(nightly_config(free.config))
    assert nightly_targets(nightly) == ["L1"], "no approval required: served when registered"
    gated = open_cycle_for(tmp_path, require_approval=True, name="gated-L1", generation=1)
    register(gated, "L2", 2, first)
    assert nightly_targets(nightly) == ["L1"], "L2 awaits approval: nightly keeps evaluating L1"
    promote(gated, "ops-lead")
    assert nightly_targets(nightly) == ["L2"]
