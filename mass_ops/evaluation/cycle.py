"""The evaluation phase of a cycle: L(k+1) against its parent L(k) on held-out rollouts (ARCHITECTURE step 10).

1. `rollout_units` — one unit per (generation, task, replicate) of the rollout pool, for both generations; the DAG
   maps one task instance over each.
2. `run_rollout_unit` — one bare-task rollout episode of one generation, on that generation's server.
3. `evaluate` — records both rollout sets (every episode is already recorded, so nothing runs again), pairs them by
   (task, replicate), has every external judge judge every pair with every presentation seed, has the new
   generation's in-loop judge judge the same pairs (for the agreement table), and records the summary.

With no external judge configured (the demo has no keys), the parent's in-loop judge stands in as the external
judge; the summary says so (`stand_in_judge`), since a model judging its own child is not an independent verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.evaluation.external import SELF_JUDGE, ReportJudge, external_judges, self_judge
from mass_ops.evaluation.rollouts import (
    RolloutError,
    Split,
    default_label,
    resolve_rollout_tasks,
    rollout_requests,
    run_rollouts,
)
from mass_ops.evaluation.serving import GenerationServer, generation_server, serving_context
from mass_ops.evaluation.stage import judge_pairs, pair_rollouts, summarize
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest

STAND_IN_JUDGE_PREFIX = "in-loop-"


def evaluation_scope(config: CycleConfig) -> str:
    """The serving scope of a cycle's evaluation servers (the inference operator's default scope: the cycle)."""
    return config.cycle_name


def evaluated_generations(config: CycleConfig) -> tuple[str, str]:
    """(new generation, parent): ``L<g+1>`` and ``L<g>``."""
    return f"L{config.generation + 1}", f"L{config.generation}"


def rollout_units(config: CycleConfig) -> list[tuple[str, int, int]]:
    """Every (generation, task, replicate) the evaluation needs, the new generation first."""
    tasks = resolve_rollout_tasks(config)
    count = config.evaluation.rollout_count
    return [(g, t, r) for g in evaluated_generations(config) for t in tasks for r in range(count)]


ExecutorFactory = Callable[[CycleContext], AbstractContextManager[EpisodeExecutor]]


@contextmanager
def episode_pool(ctx: CycleContext) -> Iterator[EpisodeExecutor]:
    """The local executor for `ctx` (qwen-code processes behind an EpisodePool)."""
    from mass_ops.runtime.pool import EpisodePool

    with EpisodePool(ctx) as pool:
        yield pool


def rollout_unit_request(ctx: CycleContext, generation: str, task: int, replicate: int) -> EpisodeRequest:
    """The request of one evaluation rollout of the cycle: replicate i of task q run by `generation` (the request
    names no server: the episode runs on the generation's, see `run_rollout_unit`). RolloutError for a generation
    the cycle does not evaluate, a task outside the rollout pool or a replicate outside the count."""
    new, parent = evaluated_generations(ctx.config)
    if generation not in (new, parent):
        raise RolloutError(f"rollout: this cycle evaluates {new} and {parent}, not {generation!r}")
    pool = resolve_rollout_tasks(ctx.config)
    if task not in pool:
        # A train candidate outside the pool would be rolled out and recorded, but no rollout set would use it.
        raise RolloutError(f"rollout: task {task} is not in this cycle's rollout pool {pool}")
    count = ctx.config.evaluation.rollout_count
    if not 0 <= replicate < count:
        raise RolloutError(f"rollout: replicate {replicate} is outside 0..{count - 1} (evaluation.rollout_count)")
    (request,) = [r for r in rollout_requests(ctx, generation, [task], count) if r.unit.candidate == replicate]
    return request


def run_rollout_unit(
    ctx: CycleContext, generation: str, task: int, replicate: int, *, executor: ExecutorFactory = episode_pool
) -> EpisodeOutcome:
    """One rollout episode of `generation` on its server (reused when already recorded)."""
    request = rollout_unit_request(ctx, generation, task, replicate)
    served = serving_context(ctx, generation_server(ctx, generation, evaluation_scope(ctx.config)))
    with executor(served) as pool:
        (outcome,) = pool.run([request])
    return outcome


def rollout_set(
    ctx: CycleContext,
    server: GenerationServer,
    executor: ExecutorFactory,
    *,
    split: Split | None = None,
    label: str | None = None,
) -> str:
    """Record (or find) the generation's rollout set over the configured pool (or `split`); returns its label."""
    served = serving_context(ctx, server)
    pool = resolve_rollout_tasks(ctx.config, split=split)
    label = label or default_label(server.generation, pool, ctx.config.evaluation.rollout_count)
    with executor(served) as runner:
        return run_rollouts(served, runner, server.generation, split=split, label=label).label


def _in_loop_judge(ctx: CycleContext, server: GenerationServer, name: str, stack: ExitStack) -> ReportJudge:
    from mass_ops.llm_calls import open_client

    served = serving_context(ctx, server)
    client = stack.enter_context(open_client(served.config))
    return self_judge(served.config, client, name=name)


def stand_in_note(parent: str) -> str:
    return f"no external judge is configured: {parent}'s in-loop judge stands in (not an independent verdict)"


def open_judges(
    ctx: CycleContext, new: GenerationServer, parent: GenerationServer, stack: ExitStack
) -> tuple[list[ReportJudge], ReportJudge, bool]:
    """(external judges — or the parent's in-loop judge standing in —, the new generation's in-loop judge,
    whether a stand-in is used); clients close with `stack`."""
    externals = stack.enter_context(external_judges(ctx.config))
    stand_in = not externals
    if stand_in:
        externals = [_in_loop_judge(ctx, parent, f"{STAND_IN_JUDGE_PREFIX}{parent.generation}", stack)]
    return externals, _in_loop_judge(ctx, new, SELF_JUDGE, stack), stand_in


def evaluate(ctx: CycleContext, *, executor: ExecutorFactory = episode_pool) -> dict[str, Any]:
    """Judge L(k+1) against L(k) on the paired rollouts and record the summary (idempotent: reruns judge only what
    is missing and return the recorded summary)."""
    scope = evaluation_scope(ctx.config)
    new, parent = evaluated_generations(ctx.config)
    servers = {name: generation_server(ctx, name, scope) for name in (new, parent)}
    labels = {name: rollout_set(ctx, server, executor) for name, server in servers.items()}
    pairs = pair_rollouts(ctx, labels[new], labels[parent])
    with ExitStack() as stack:
        externals, own, stand_in = open_judges(ctx, servers[new], servers[parent], stack)
        judged = judge_pairs(ctx, pairs, [*externals, own])
        summary = summarize(
            ctx,
            pairs,
            judges=[judge.name for judge in externals],
            extra={"note": stand_in_note(parent)} if stand_in else None,
        )
    overall = summary.results["summary"]["overall"]
    return {
        "evaluation": summary.key,
        "generation": new,
        "baseline": parent,
        "pairs": len(pairs),
        "judged_now": judged.judged,
        "win_rate": overall["win_rate"],
        "stand_in_judge": stand_in,
        "results_uri": summary.results_uri,
    }
