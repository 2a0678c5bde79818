"""Evaluation stages of a cycle: L(k+1) against its parent L(k) on held-out rollouts (MASS_SPEC §10; ARCHITECTURE
step 10), for the CLI and the DAG tasks.

`rollout_units`/`run_rollout_unit`/`run_rollouts` run bare-task rollouts of both generations; `pair_rollouts` pairs
the two sets by (task, replicate) and publishes the pairs; `judge_pairs` judges every (pair, judge, seed) once into
the ``external`` ledger, resumably (no judgment is ever made twice); `summarize` records win rates with intervals
as a ``pairwise`` evaluation; `evaluate` is the whole cycle evaluation (the parent's in-loop judge stands in when no
external judge is configured); `write_report` writes Markdown + HTML. Each step in depth: docs/evaluation.md
(`mass_ops.stages.evaluate`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.evaluation.agreement import judge_agreement
from mass_ops.evaluation.external import SELF_JUDGE, ReportJudge, external_judges, judge_presentation, self_judge
from mass_ops.evaluation.pairing import RolloutPair, pairs_document
from mass_ops.evaluation.pairing import pair_rollouts as _pair_sets
from mass_ops.evaluation.rollouts import (
    RolloutError,
    Split,
    default_label,
    load_rollout_set,
    resolve_rollout_tasks,
    rollout_requests,
    run_rollouts,
)
from mass_ops.evaluation.stats import (
    DEFAULT_BOOTSTRAP_SAMPLES,
    Judgment,
    judgments_from_ledger,
    ledger_key,
    summarize_judgments,
)
from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, build_bundle
from mass_ops.judge.invalid_verdicts import InvalidVerdictBudget, TooManyInvalidVerdictsError
from mass_ops.judge.workspaces import EvidenceCache, StoredWorkspace, WorkspaceSource
from mass_ops.layout import PAIRWISE_KIND, report_prefix
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest
from mass_ops.serving import GenerationServer, evaluation_scope, generation_server, serving_context
from mass_ops.store.schema import Comparison, Ledger

logger = logging.getLogger(__name__)

# External reporting caps of the reference: no report token cap, JSON 50000 and code 10000 tokens, o200k counting.
REPORT_TOKEN_MODEL = "gpt-5.5"
DEFAULT_JUDGE_WORKERS = 4


class EvaluationStageError(InputError):
    """An evaluation step cannot proceed (judgments missing or failed, a label reused for other results)."""


# -- rollouts and pairing --------------------------------------------------------------------------------------------


def pairs_key(cycle: str, label_a: str, label_b: str) -> str:
    """Artifact key of the pairs document of two sets."""
    return f"{report_prefix(cycle)}/pairs/{label_a}_vs_{label_b}.json"


def pair_rollouts(ctx: CycleContext, label_a: str, label_b: str) -> list[RolloutPair]:
    """Pair set `label_a` (side A, the generation under evaluation) with `label_b` and publish the pairs document;
    an existing document with other pairs is refused rather than overwritten."""
    pairs = _pair_sets(load_rollout_set(ctx, label_a), load_rollout_set(ctx, label_b))
    document = pairs_document(pairs)
    key = pairs_key(ctx.cycle_name, label_a, label_b)
    if ctx.artifacts.exists(key):
        if ctx.artifacts.get_json(key) != document:
            raise EvaluationStageError(f"pairs {ctx.artifacts.uri(key)} exist with other pairs; pair new set labels")
    else:
        ctx.artifacts.put_json(key, document)
    return pairs


# -- judging ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _JudgedWorkspace:
    """A stored rollout workspace shown under an alias: paths in prompts must not reveal which generation made it."""

    stored: StoredWorkspace
    alias: str
    task: int

    @property
    def name(self) -> str:
        return self.stored.name

    @property
    def location(self) -> str:
        return self.alias

    def materialize(self, dest: Path) -> Path:
        return self.stored.materialize(dest)


def workspace_alias(episode_ref: str) -> str:
    """The neutral name a judge sees for an episode's workspace."""
    return f"workspace-{hashlib.sha256(episode_ref.encode()).hexdigest()[:12]}"


@dataclass
class JudgingResult:
    """What `judge_pairs` did: judgments made now, judgments already recorded, failures by ledger key, and each
    judge's verdicts over these pairs and seeds recorded invalid (counted as ties), earlier runs' included."""

    judged: int = 0
    skipped: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    invalid: dict[str, int] = field(default_factory=dict)


def _side(ref: str) -> str:
    # side_a/side_b hold 128 characters; a longer reference is shortened to a stable digest.
    return ref if len(ref) <= 128 else f"{ref[:60]}…{hashlib.sha256(ref.encode()).hexdigest()[:16]}"


def _checked_judges(judges: Sequence[ReportJudge]) -> None:
    """Raise EvaluationStageError unless there is at least one judge and their names are unique."""
    if not judges:
        raise EvaluationStageError("judge_pairs: no judges given (configure evaluation.judges)")
    names = [judge.name for judge in judges]
    if len(set(names)) != len(names):
        raise EvaluationStageError(f"judge_pairs: judge names must be unique, got {names}")


def _invalid_budgets(
    config: CycleConfig,
    pairs: Sequence[RolloutPair],
    judges: Sequence[ReportJudge],
    seeds: Sequence[int],
    recorded: dict[str, Comparison],
) -> dict[str, InvalidVerdictBudget]:
    """Each judge's invalid-verdict budget over its (pair, seed) judgments, counting those already recorded invalid."""
    budgets: dict[str, InvalidVerdictBudget] = {}
    for judge in judges:
        keys = {ledger_key(pair.pair_id, judge.name, seed) for pair in pairs for seed in seeds}
        budgets[judge.name] = InvalidVerdictBudget(
            f"evaluate judge {judge.name}",
            max_fraction=config.judge.max_invalid_fraction,
            planned=len(keys),
            already_invalid=sum(1 for key in keys if key in recorded and recorded[key].verdict == "invalid"),
        )
    return budgets


class _ExternalJudging:
    """Judges one (pair, judge, seed) and records it in the ``external`` ledger; each workspace's evidence is built
    once (under its neutral alias), and invalid verdicts count against the judge's budget."""

    def __init__(
        self,
        ctx: CycleContext,
        pairs: Sequence[RolloutPair],
        budgets: dict[str, InvalidVerdictBudget],
        *,
        swap_consistent: bool,
        invalid_retries: int,
    ) -> None:
        self.ctx = ctx
        self.budgets = budgets
        self.swap_consistent = swap_consistent
        self.invalid_retries = invalid_retries
        self.ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
        self.caps = EvidenceCaps.local(REPORT_TOKEN_MODEL)
        self.texts = {pair.task: ctx.catalogue.task(pair.task).task_text for pair in pairs}
        self.evidence: EvidenceCache[EvidenceBundle] = EvidenceCache(self._build)

    def _build(self, root: Path, source: WorkspaceSource) -> EvidenceBundle:
        if not isinstance(source, _JudgedWorkspace):
            raise TypeError(f"unexpected workspace source {source!r}")
        task = source.task
        return build_bundle(
            root,
            task_id=task,
            task_text=self.texts[task],
            location=source.location,
            caps=self.caps,
            name=source.name,
            prompts=self.ctx.prompts,
        )

    def bundle(self, task: int, ref: str, uri: str) -> EvidenceBundle:
        stored = StoredWorkspace(self.ctx.artifacts, uri, self.ctx.catalogue.task(task).name)
        return self.evidence.get(ref, _JudgedWorkspace(stored, workspace_alias(ref), task))

    def judge_one(self, pair: RolloutPair, judge: ReportJudge, seed: int) -> Comparison:
        """Judge `pair` with `judge` under presentation `seed` and record the judgment."""
        ctx, config = self.ctx, self.ctx.config
        key = ledger_key(pair.pair_id, judge.name, seed)
        presented = judge_presentation(
            judge,
            self.ledger,
            CallUnit(f"eval/external/{key}", judge.purpose, pair.task),
            task_id=pair.task,
            task_text=self.texts[pair.task],
            bundle_a=self.bundle(pair.task, pair.a, pair.workspace_a),
            bundle_b=self.bundle(pair.task, pair.b, pair.workspace_b),
            seed=seed,
            prompts=ctx.prompts,
            invalid_retries=self.invalid_retries,
            swap_consistent=self.swap_consistent,
            position_bias_sample=config.judge.position_bias_sample,
            verdict_parsing=config.judge.verdict_parsing,
        )
        outcome = presented.outcome
        if outcome.verdict == "invalid":
            # Beyond judge.max_invalid_fraction this judgment fails, unrecorded: a rerun judges it again.
            self.budgets[judge.name].admit(key, outcome.rationale)
            logger.warning("external judgment %s recorded as invalid (a tie): %s", key, outcome.rationale)
        rationale = outcome.rationale
        if presented.swapped:
            # The rationale speaks of the workspaces as shown; say which side "A" was for readers of the ledger.
            rationale = f"[shown swapped: 'Workspace A' is side B ({pair.b})] {rationale}"
        return ctx.repo.record_comparison(
            ctx.cycle_id,
            pair.task,
            Ledger.EXTERNAL.value,
            key,
            side_a=_side(pair.a),
            side_b=_side(pair.b),
            judge_model=judge.model,
            verdict=presented.verdict,
            episode_a_id=pair.episode_a_id,
            episode_b_id=pair.episode_b_id,
            judge_provider=judge.provider,
            seed=seed,
            swapped=presented.swapped,
            rationale=rationale,
            llm_call_id=outcome.call_id,
            usage=outcome.usage or None,
        )


def _judge_all(
    judging: _ExternalJudging,
    todo: Sequence[tuple[RolloutPair, ReportJudge, int]],
    max_workers: int,
    result: JudgingResult,
) -> list[TooManyInvalidVerdictsError]:
    """Run every judgment of `todo` on a thread pool, counting successes and failures into `result`; returns the
    failures that were invalid-verdict budget overruns."""
    workers = max(1, min(max_workers, len(todo)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="external-judge")
    too_many: list[TooManyInvalidVerdictsError] = []
    try:
        futures = {ledger_key(p.pair_id, j.name, s): pool.submit(judging.judge_one, p, j, s) for p, j, s in todo}
        for key, future in futures.items():
            try:
                future.result()
                result.judged += 1
            except Exception as exc:  # one failed judgment must not lose the others: report them all
                result.failures[key] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, TooManyInvalidVerdictsError):
                    too_many.append(exc)
    except BaseException:
        # Terminated (signal, task kill): start nothing new; what finished is recorded and a rerun does the rest.
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return too_many


def judge_pairs(
    ctx: CycleContext,
    pairs: Sequence[RolloutPair],
    judges: Sequence[ReportJudge],
    seeds: Sequence[int] | None = None,
    *,
    max_workers: int = DEFAULT_JUDGE_WORKERS,
    swap_consistent: bool | None = None,
    invalid_retries: int | None = None,
) -> JudgingResult:
    """Judge every (pair, judge, seed) not yet in the external ledger; concurrent within `max_workers`.

    Raises EvaluationStageError after the batch when some judgments failed (the rest stay recorded; rerun to
    finish), or TooManyInvalidVerdictsError when the only failures are a judge's invalid verdicts beyond
    `judge.max_invalid_fraction` of its (pair, seed) judgments. Seeds default to `evaluation.judge_seeds`.
    """
    config = ctx.config
    seeds = list(config.evaluation.judge_seeds if seeds is None else seeds)
    _checked_judges(judges)
    swap = config.evaluation.swap_consistent if swap_consistent is None else swap_consistent
    retries = config.judge.invalid_retries if invalid_retries is None else invalid_retries
    recorded = {row.key: row for row in ctx.repo.comparisons(ctx.cycle_id, Ledger.EXTERNAL)}
    budgets = _invalid_budgets(config, pairs, judges, seeds, recorded)
    todo = [
        (pair, judge, seed)
        for pair in pairs
        for judge in judges
        for seed in seeds
        if ledger_key(pair.pair_id, judge.name, seed) not in recorded
    ]
    result = JudgingResult(skipped=len(pairs) * len(judges) * len(seeds) - len(todo))
    if not todo:
        result.invalid = {name: budget.invalid for name, budget in budgets.items()}
        return result
    judging = _ExternalJudging(ctx, pairs, budgets, swap_consistent=swap, invalid_retries=retries)
    too_many = _judge_all(judging, todo, max_workers, result)
    result.invalid = {name: budget.invalid for name, budget in budgets.items()}
    if result.failures and len(too_many) == len(result.failures):
        raise too_many[0]  # already one line naming the judge, the count, the limit and what to do
    if result.failures:
        first = next(iter(result.failures.items()))
        raise EvaluationStageError(
            f"judge_pairs: {len(result.failures)} of {len(todo)} judgments failed (first: {first[0]}: {first[1]}); "
            f"{result.judged} recorded — rerun to judge only the missing ones"
        )
    return result


# -- summary ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvaluationSummary:
    """A recorded pairwise evaluation: its key, results document and where the document is stored."""

    key: str
    results: dict[str, Any]
    results_uri: str | None


def default_summary_label(pairs: Sequence[RolloutPair]) -> str:
    """``<A>_vs_<B>-<digest of the pair ids>``."""
    digest = hashlib.sha256("".join(sorted(p.pair_id for p in pairs)).encode()).hexdigest()[:8]
    return f"{pairs[0].generation_a}_vs_{pairs[0].generation_b}-{digest}"


def pairwise_key(cycle: str, label: str) -> str:
    return f"{cycle}/{PAIRWISE_KIND}/{label}"


def evaluation_judgments(ctx: CycleContext, pairs: Sequence[RolloutPair], judge_names: Sequence[str]) -> list[Judgment]:
    """The ledger's judgments of these pairs by these judges, in side-A orientation, tagged with A's generation."""
    generation_of = {pair.pair_id: pair.generation_a for pair in pairs}
    wanted = set(judge_names)
    rows = [
        row for row in ctx.repo.comparisons(ctx.cycle_id, Ledger.EXTERNAL) if row.key.split("/", 1)[0] in generation_of
    ]
    return [j for j in judgments_from_ledger(rows, generation_of) if j.judge in wanted]


def summarize(
    ctx: CycleContext,
    pairs: Sequence[RolloutPair],
    *,
    label: str | None = None,
    judges: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    self_judge: str = SELF_JUDGE,
    bootstrap_samples: int = DEFAULT_BOOTSTRAP_SAMPLES,
    extra: dict[str, Any] | None = None,
) -> EvaluationSummary:
    """Summarize and record the evaluation of side A over `pairs` (all from one pair of rollout sets).

    Every (pair, external judge, seed) must be judged (else EvaluationStageError with the count missing); the
    self-judge's judgments, when present, feed the agreement table only. `extra` fields (a `note` the report
    shows, e.g. that a stand-in judged; the nightly date) are kept with the results.
    """
    if not pairs:
        raise EvaluationStageError("summarize: no pairs")
    config = ctx.config
    generations = {(p.generation_a, p.generation_b) for p in pairs}
    if len(generations) != 1:
        raise EvaluationStageError(f"summarize: pairs mix generation pairs {sorted(generations)}")
    generation_a, generation_b = next(iter(generations))
    names = [j.name for j in config.evaluation.judges] if judges is None else list(judges)
    if not names:
        raise EvaluationStageError("summarize: no external judges (configure evaluation.judges)")
    seeds = list(config.evaluation.judge_seeds if seeds is None else seeds)
    judgments = evaluation_judgments(ctx, pairs, [*names, self_judge])
    external = [j for j in judgments if j.judge in names and j.seed in seeds]
    expected = len(pairs) * len(names) * len(seeds)
    if len(external) != expected:
        raise EvaluationStageError(
            f"summarize: {expected - len(external)} of {expected} external judgments are missing; run judge_pairs"
        )
    test = set(config.tasks.test)
    summary = summarize_judgments(
        external, lambda task: "test" if task in test else "train", bootstrap_samples=bootstrap_samples
    )
    own = [j for j in judgments if j.judge == self_judge]
    agreement = judge_agreement(external + own, self_judge=self_judge) if own else {}
    label = label or default_summary_label(pairs)
    results = {
        "label": label,
        "cycle": ctx.cycle_name,
        "generation_a": generation_a,
        "generation_b": generation_b,
        "pairs": len(pairs),
        "tasks": sorted({p.task for p in pairs}),
        "judges": names,
        "seeds": seeds,
        "swap_consistent": config.evaluation.swap_consistent,
        "summary": summary.as_dict(),
        "self_judge": self_judge if own else None,
        "self_judgments": len(own),
        "agreement": {generation: item.as_dict() for generation, item in agreement.items()},
    }
    results.update(extra or {})
    results = json.loads(json.dumps(results))  # as the JSON column reads it back, for the comparison below
    model_a, model_b = ctx.repo.get_generation(generation_a), ctx.repo.get_generation(generation_b)
    if model_a is None or model_b is None:
        missing = [g for g, m in ((generation_a, model_a), (generation_b, model_b)) if m is None]
        raise EvaluationStageError(f"summarize: generations {missing} are not registered models")
    key = pairwise_key(ctx.cycle_name, label)
    existing = [row for row in ctx.repo.evaluations(kind=PAIRWISE_KIND) if row.key == key]
    if existing:
        if existing[0].results != results:
            raise EvaluationStageError(
                f"summarize: evaluation {key} is already recorded with other results; use a new label"
            )
        return EvaluationSummary(key=key, results=existing[0].results, results_uri=existing[0].results_uri)
    info = ctx.artifacts.put_json(f"{report_prefix(ctx.cycle_name)}/evaluations/{label}.json", results)
    row = ctx.repo.record_evaluation(
        key,
        PAIRWISE_KIND,
        generation_id=model_a.id,
        baseline_generation_id=model_b.id,
        results=results,
        cycle_id=ctx.cycle_id,
        results_uri=info.uri,
        results_sha256=info.sha256,
    )
    return EvaluationSummary(key=row.key, results=row.results, results_uri=row.results_uri)


def write_report(ctx: CycleContext, out_prefix: str | None = None) -> dict[str, Any]:
    """Render the cycle's report (Markdown, HTML, figures) under `out_prefix` (default the cycle's report folder);
    returns the URIs: ``{"markdown", "html", "figures": {name: uri}}``."""
    from mass_ops.evaluation.report import write_report as render

    return render(ctx, out_prefix)


STAND_IN_JUDGE_PREFIX = "in-loop-"


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
    from mass_ops.llm.calls import open_client

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
        "invalid_verdicts": judged.invalid,
        "win_rate": overall["win_rate"],
        "stand_in_judge": stand_in,
        "results_uri": summary.results_uri,
    }
