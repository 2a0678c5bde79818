"""Promotion: when a registered generation L(k+1) becomes the served model (nightly evaluation, the next cycle).

A cycle registers L(k+1) before evaluating it (the evaluation serves it). With `promotion.require_approval` the cycle
DAG then asks a person, in Airflow's human-in-the-loop approval, showing `promotion_headline`; approved, `promote`
records a ``promotion`` evaluation row for the generation. Without the gate `promote` records it at once.

`is_promoted` is what nightly evaluation reads: a generation is served once its promotion is recorded, or when the
cycle that registered it did not require approval (its frozen config; generations registered before the gate existed
and base models included). A rejected or unanswered approval leaves the previous generation served.
"""

from __future__ import annotations

from typing import Any

from mass_ops.context import CycleContext
from mass_ops.layout import PAIRWISE_KIND
from mass_ops.stages.common import PostTrainingError
from mass_ops.stages.evaluate import evaluated_generations
from mass_ops.store.schema import ModelGeneration

PROMOTION_KIND = "promotion"
REPORT_PATH = "/mass-ops/reports/{cycle}/"


def promotion_key(generation: str) -> str:
    """The promotion record's key: one per generation, whichever cycle or run promotes it."""
    return f"{PROMOTION_KIND}/{generation}"


def _rate(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _interval(overall: dict[str, Any]) -> str:
    wilson = overall.get("wilson_95")
    if not wilson:
        return "no interval: no decisive judgment"
    return f"95% interval {wilson[0]:.2f} to {wilson[1]:.2f} (Wilson)"


def promotion_headline(ctx: CycleContext) -> str:
    """Plain text a person decides on: the cycle's recorded evaluation of L(k+1) against L(k) (win rate, interval,
    counts, judges) and what approving does."""
    new, parent = evaluated_generations(ctx.config)
    rows = [
        row
        for row in ctx.repo.evaluations(kind=PAIRWISE_KIND)
        if row.cycle_id == ctx.cycle_id
        and row.results.get("generation_a") == new
        and row.results.get("generation_b") == parent
    ]
    lines = [f"Cycle {ctx.cycle_name} trained {new} from {parent}."]
    if not rows:
        lines.append(f"No evaluation of {new} against {parent} is recorded in this cycle.")
    else:
        results = rows[-1].results
        overall = results["summary"]["overall"]
        lines += [
            f"{new} against {parent}: win rate {_rate(overall.get('win_rate'))}, {_interval(overall)}.",
            f"{overall['wins']} wins, {overall['losses']} losses, {overall['ties']} ties in {overall['judgments']} "
            f"judgments of {results.get('pairs', overall.get('pairs'))} pairs; judges: {', '.join(results['judges'])}.",
        ]
        if results.get("note"):
            lines.append(str(results["note"]))
    lines += [
        f"Report: {REPORT_PATH.format(cycle=ctx.cycle_name)}",
        f"Approve to serve {new} to nightly evaluation and the next cycle; reject to keep serving {parent}.",
    ]
    return "\n\n".join(lines)  # paragraphs: the approval form renders its body as Markdown


def promotion_request(ctx: CycleContext) -> dict[str, Any]:
    """Whether this cycle's new generation waits for approval, and the headline the approval shows."""
    new, parent = evaluated_generations(ctx.config)
    return {
        "required": ctx.config.promotion.require_approval,
        "generation": new,
        "baseline": parent,
        "headline": promotion_headline(ctx),
    }


def promote(ctx: CycleContext, approved_by: str | None = None) -> dict[str, Any]:
    """Record L(k+1) as promoted (once: a rerun returns the recorded promotion); `approved_by` names who approved."""
    new, parent = evaluated_generations(ctx.config)
    child, base = ctx.repo.get_generation(new), ctx.repo.get_generation(parent)
    if child is None or base is None:
        raise PostTrainingError(f"promote: {new} is not registered with its parent {parent}; run register first")
    key = promotion_key(new)
    existing = [row for row in ctx.repo.evaluations(generation_id=child.id, kind=PROMOTION_KIND) if row.key == key]
    if existing:
        return {**_identity(child, base), **existing[0].results}
    required = ctx.config.promotion.require_approval
    results = {
        "cycle": ctx.cycle_name,
        "approval": "approved" if required else "not required",
        "approved_by": approved_by if required else None,
    }
    ctx.repo.record_evaluation(
        key,
        PROMOTION_KIND,
        generation_id=child.id,
        baseline_generation_id=base.id,
        results=results,
        cycle_id=ctx.cycle_id,
    )
    return {**_identity(child, base), **results}


def _identity(child: ModelGeneration, base: ModelGeneration) -> dict[str, Any]:
    """What the promotion's asset event carries besides the decision: the generation, its parent, its weights."""
    return {
        "generation": child.name,
        "generation_id": child.id,
        "parent": base.name,
        "bf16_uri": child.bf16_uri,
        "fp8_uri": child.fp8_uri,
    }


def _required_by_cycle(ctx: CycleContext, generation: ModelGeneration) -> bool:
    """Whether the cycle that registered `generation` required approval (its frozen config; false when unknown)."""
    cycle_name = (generation.lineage or {}).get("cycle")
    cycle = ctx.repo.get_cycle(cycle_name) if isinstance(cycle_name, str) else None
    frozen = (cycle.config or {}) if cycle is not None else {}
    return bool((frozen.get("promotion") or {}).get("require_approval", False))


def is_promoted(ctx: CycleContext, generation: ModelGeneration) -> bool:
    """Whether `generation` may be served: its promotion is recorded, or its cycle did not require approval."""
    # `evaluations(generation_id=…)` also returns the rows where it is the baseline: match the key.
    rows = ctx.repo.evaluations(generation_id=generation.id, kind=PROMOTION_KIND)
    if any(row.key == promotion_key(generation.name) for row in rows):
        return True
    return not _required_by_cycle(ctx, generation)


def served_generation(ctx: CycleContext) -> ModelGeneration | None:
    """The newest registered generation that may be served (a newer one awaiting approval is passed over)."""
    newest = ctx.repo.latest_generation()
    if newest is None:
        return None
    return next((row for row in ctx.repo.lineage(newest.id) if is_promoted(ctx, row)), None)
