"""RHI workflow search per task (MASS_SPEC §1 search, §3.3): resumable steps, one task chain, many tasks at once.

Step k of task q:
1. runs episode v_k (and, at k = 0, the bare reference episode) through the executor — reused when done;
2. for k ≥ 1 judges v0 (once per task) and v_k against the fixed reference, then arbitrates between the champion
   and v_k when both beat the reference;
3. for k < L asks the optimizer for v_{k+1} and records it; at k = L writes the retained workflow instead.

Every unit is keyed and recorded (episodes by the executor, verdicts in the `rhi`/`champion` ledgers, proposals as
workflow versions, every call attempt in the call ledger), so rerunning a step after a crash anywhere repeats no
finished episode, judge call or proposal. A task's steps run in order; different tasks run concurrently.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.critical_path import server_priority
from mass_ops.errors import InfrastructureError, InputError
from mass_ops.judge.evidence import (
    EvidenceBundle,
    EvidenceCaps,
    ResultsAppendix,
    build_bundle,
    refused_bundle,
    results_json_appendix,
)
from mass_ops.judge.invalid_verdicts import InvalidVerdictBudget
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import REFERENCE_LABEL, version_label
from mass_ops.judge.workspaces import EvidenceCache, ExecutorWorkspace, WorkspaceSource
from mass_ops.layout import EpisodeUnit, bare_condition, version_condition, workflow_version_key
from mass_ops.llm import LLMClient, LLMOutputError
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling, open_client
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest
from mass_ops.search.champion import ChampionState, arbitration_key, baseline_key, derive_champion
from mass_ops.search.prompt import (
    BestDesign,
    HistoryEntry,
    OptimizerInputs,
    optimizer_system_prompt,
    optimizer_user_prompt,
    select_best,
    version_diff,
)
from mass_ops.search.proposal import Proposal, ProposalError, parse_proposal
from mass_ops.seeds import reference_episode_seed, search_call_seed, version_episode_seed
from mass_ops.store.schema import Comparison, Ledger, WorkflowVersion, episode_unit_key
from mass_ops.tasks.catalogue import Task
from mass_ops.workflow import WorkflowPrompt, design_diff

logger = logging.getLogger(__name__)

_BASELINE_KEY = re.compile(r"^v(\d+)_vs_no_harness$")
_ARBITRATION_KEY = re.compile(r"^champion_v(\d+)_vs_v(\d+)$")


class SearchError(InputError):
    """A search step asked for something that cannot be done: unknown task, version out of range, wrong order."""


class SearchEpisodeError(InfrastructureError):
    """An episode of the search ended in an infrastructure failure after every allowed attempt."""


@dataclass(frozen=True)
class StepResult:
    """What step k of a task did or found done."""

    task_id: int
    version: int
    episode_status: str
    champion: int
    retained: int | None
    judge_calls: int = 0
    arbitrated: bool = False
    proposed_version: int | None = None
    final: bool = False
    invalid_verdicts: int = 0  # the task's verdicts recorded invalid so far (counted as ties)


@dataclass(frozen=True)
class TaskSearchResult:
    """The outcome of a task's whole search."""

    task_id: int
    retained_version: int | None
    beats_reference: bool
    last_evaluated_version: int
    scoreboard: str
    steps: tuple[StepResult, ...] = ()
    error: str | None = None

    def as_row(self) -> dict[str, Any]:
        """Summary row for the CLI table."""
        return {
            "task": self.task_id,
            "retained_version": self.retained_version,
            "beats_reference": self.beats_reference,
            "last_evaluated_version": self.last_evaluated_version,
            "scoreboard": self.scoreboard,
            "judge_calls": sum(step.judge_calls for step in self.steps),
            "invalid_verdicts": self.steps[-1].invalid_verdicts if self.steps else 0,
            "error": self.error,
        }


class SearchFailedError(InfrastructureError):
    """Some tasks' searches failed; `results` holds every task's result (failed ones carry `error`)."""

    def __init__(self, results: list[TaskSearchResult]) -> None:
        self.results = results
        failed = [r for r in results if r.error]
        lines = [f"task {r.task_id}: {r.error}" for r in failed]
        super().__init__(f"search failed for {len(failed)} of {len(results)} tasks:\n" + "\n".join(lines))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def search_task_ids(config: CycleConfig, task_ids: Sequence[int] | None) -> list[int]:
    """The tasks to search: given ids (each a train candidate or test task), else the train candidates."""
    allowed = set(config.tasks.train_candidates) | set(config.tasks.test)
    chosen = list(task_ids) if task_ids else list(config.tasks.train_candidates)
    unknown = sorted({t for t in chosen if t not in allowed})
    if unknown:
        raise SearchError(f"search: tasks {unknown} are neither train candidates nor test tasks of this cycle")
    return list(dict.fromkeys(chosen))


def check_step(config: CycleConfig, task_id: int, version: int) -> None:
    """SearchError unless `version` is a step of the configured budget (0..search.iterations)."""
    if not 0 <= version <= config.search.iterations:
        raise SearchError(
            f"task {task_id}: step {version} is outside 0..{config.search.iterations} (search.iterations)"
        )


def reference_request(ctx: CycleContext, task_id: int) -> EpisodeRequest:
    """The bare reference episode of task q's search (seed `reference_episode_seed`)."""
    seed = reference_episode_seed(ctx.config.search.seed_base, task_id)
    unit = EpisodeUnit(cycle=ctx.cycle_name, task_id=task_id, kind="reference", seed=seed)
    return EpisodeRequest(unit=unit, condition=bare_condition(task_id), prompt=ctx.catalogue.task(task_id).bare_prompt)


def version_request(ctx: CycleContext, task_id: int, version: int, prompt: str) -> EpisodeRequest:
    """The episode of workflow version k of task q, given v_k's full prompt (seed `version_episode_seed`)."""
    seed = version_episode_seed(ctx.config.search.seed_base, task_id, version)
    unit = EpisodeUnit(cycle=ctx.cycle_name, task_id=task_id, kind="search", seed=seed, version=version)
    return EpisodeRequest(unit=unit, condition=version_condition(task_id, version), prompt=prompt)


def recorded_version_prompt(ctx: CycleContext, task_id: int, version: int, row: WorkflowVersion | None) -> str:
    """The full prompt of v_k: v0 from the catalogue, a later version as stored when step k-1 proposed it (`row`),
    checked against its recorded hash. SearchError when v_k has not been proposed yet."""
    if version == 0:
        return ctx.catalogue.task(task_id).initial_prompt
    if row is None:
        raise SearchError(
            f"task {task_id}: workflow version v{version} does not exist yet; run step {version - 1} first"
        )
    text = ctx.artifacts.get_bytes(workflow_version_key(ctx.cycle_name, task_id, version)).decode("utf-8")
    if row.prompt_sha256 and _sha256(text) != row.prompt_sha256:
        raise SearchError(f"task {task_id}: stored prompt of v{version} does not match its recorded hash")
    return text


def search_episode_request(ctx: CycleContext, task_id: int, version: int) -> EpisodeRequest:
    """The episode of v_k that step k of task q runs (what an episode pod runs before the step); SearchError for a
    task outside the search, a step outside the budget, or a version not proposed yet."""
    search_task_ids(ctx.config, [task_id])
    check_step(ctx.config, task_id, version)
    rows = {row.version: row for row in ctx.repo.workflow_versions(ctx.cycle_id, task_id)}
    return version_request(ctx, task_id, version, recorded_version_prompt(ctx, task_id, version, rows.get(version)))


@dataclass(frozen=True)
class Verdicts:
    """A snapshot of a task's two ledgers: verdicts against the reference and champion arbitrations."""

    rhi: tuple[Comparison, ...]
    champion: tuple[Comparison, ...]

    def baseline(self) -> dict[int, str]:
        """Version → verdict against the reference."""
        return {int(m.group(1)): row.verdict for row in self.rhi if (m := _BASELINE_KEY.match(row.key))}

    def arbitration(self) -> dict[tuple[int, int], str]:
        """(champion, challenger) → arbitration verdict."""
        return {
            (int(m.group(1)), int(m.group(2))): row.verdict
            for row in self.champion
            if (m := _ARBITRATION_KEY.match(row.key))
        }

    def get(self, ledger: Ledger, key: str) -> Comparison | None:
        rows = self.rhi if ledger == Ledger.RHI else self.champion
        return next((row for row in rows if row.key == key), None)

    def state(self, current: int) -> ChampionState:
        return derive_champion(self.baseline(), self.arbitration(), current)

    def including(self, rows: Sequence[Comparison]) -> Verdicts:
        """This snapshot plus rows just recorded (the rows a re-read would add; a row already held is kept once)."""
        rhi, champion = list(self.rhi), list(self.champion)
        for row in rows:
            held = rhi if row.ledger == Ledger.RHI else champion
            if not any(old.id == row.id for old in held):
                held.append(row)
        return Verdicts(tuple(rhi), tuple(champion))


class _TaskSearch:
    """The search state of one task: ids, seeds, prompts and ledgers."""

    def __init__(
        self, ctx: CycleContext, executor: EpisodeExecutor, task_id: int, client: LLMClient, ledger: CallLedger
    ) -> None:
        config = ctx.config
        self.ctx = ctx
        self.executor = executor
        self.task: Task = ctx.catalogue.task(task_id)
        self.task_id = task_id
        self.iterations = config.search.iterations
        self.seed_base = config.search.seed_base
        self.call_seed = search_call_seed(self.seed_base, task_id)
        self.template: WorkflowPrompt = self.task.initial_workflow
        self.client = client
        self.ledger = ledger
        self.judge = PairwiseJudge(
            client,
            ledger,
            lambda seed: in_loop_sampling(config, seed),
            invalid_retries=config.judge.invalid_retries,
            swap_consistent=config.search.swap_consistent,
            position_bias_sample=config.judge.position_bias_sample,
            prompts=ctx.prompts,
            verdict_parsing=config.judge.verdict_parsing,
        )
        token_model = config.models.served_name
        self.caps = EvidenceCaps.remote(token_model) if config.is_remote_backend else EvidenceCaps.local(token_model)
        # A workspace is judged in several steps (the reference in every one): build its evidence once per process.
        self.evidence: EvidenceCache[tuple[EvidenceBundle, ResultsAppendix]] = EvidenceCache(
            self._build_evidence, refuse=lambda value, reason: (refused_bundle(value[0], reason), value[1])
        )
        # Finished episodes (succeeded or model failure) never change: the reference and the champion are needed
        # again in later steps, and asking the executor again would only repeat its lookups.
        self._finished: dict[EpisodeRequest, EpisodeOutcome] = {}
        # Prompt texts of versions this process stored or verified against their recorded hash.
        self._prompts: dict[int, str] = {}
        self.invalid_budget = self._invalid_budget(Verdicts((), ()))

    def _build_evidence(self, root: Path, source: WorkspaceSource) -> tuple[EvidenceBundle, ResultsAppendix]:
        """The judge bundle of a workspace and the optimizer's results/ appendix, from one materialisation (cut
        markers measured with the cycle's templates)."""
        bundle = build_bundle(
            root,
            task_id=self.task_id,
            task_text=self.task.task_text,
            location=source.location,
            caps=self.caps,
            name=source.name,
            prompts=self.ctx.prompts,
        )
        search = self.ctx.config.search
        appendix = results_json_appendix(
            root,
            self.task_id,
            per_file_chars=search.results_json_max_chars,
            total_chars=search.results_json_total_max_chars,
            prompts=self.ctx.prompts,
        )
        return bundle, appendix

    # -- versions --------------------------------------------------------------------------------------------------

    def _store_prompt(self, version: int, prompt: str) -> str:
        key = workflow_version_key(self.ctx.cycle_name, self.task_id, version)
        existing = self.ctx.artifacts.exists(key) and self.ctx.artifacts.get_bytes(key).decode("utf-8")
        if existing and existing != prompt:
            raise SearchError(f"task {self.task_id}: stored prompt of v{version} at {key} differs from this run's")
        return self.ctx.artifacts.uri(key) if existing else self.ctx.artifacts.put_bytes(key, prompt.encode()).uri

    def ensure_v0(self) -> WorkflowVersion:
        prompt = self.task.initial_prompt
        uri = self._store_prompt(0, prompt)
        return self.ctx.repo.record_workflow_version(
            self.ctx.cycle_id,
            self.task_id,
            0,
            design=self.template.design_block,
            prompt_uri=uri,
            prompt_sha256=_sha256(prompt),
        )

    def versions(self) -> dict[int, WorkflowVersion]:
        return {row.version: row for row in self.ctx.repo.workflow_versions(self.ctx.cycle_id, self.task_id)}

    def prompt_of(self, version: int, versions: dict[int, WorkflowVersion]) -> str:
        if version not in self._prompts:
            self._prompts[version] = recorded_version_prompt(self.ctx, self.task_id, version, versions.get(version))
        return self._prompts[version]

    # -- episodes --------------------------------------------------------------------------------------------------

    def reference_request(self) -> EpisodeRequest:
        return reference_request(self.ctx, self.task_id)

    def version_request(self, version: int, prompt: str) -> EpisodeRequest:
        return version_request(self.ctx, self.task_id, version, prompt)

    def run(self, requests: list[EpisodeRequest]) -> list[EpisodeOutcome]:
        """Outcomes of `requests` in order: finished ones this process already holds, the others from the executor."""
        todo = [request for request in requests if request not in self._finished]
        outcomes = self.executor.run(todo) if todo else []
        for request, outcome in zip(todo, outcomes, strict=True):  # the executor answers in request order
            if outcome.status == "infra_failure":
                raise SearchEpisodeError(
                    f"task {self.task_id}: episode {outcome.request.unit.slug} ended in an infrastructure failure "
                    f"after {outcome.attempt} attempt(s); rerun the step once the endpoint is healthy"
                )
            self._finished[request] = outcome
        return [self._finished[request] for request in requests]

    def workspace(self, outcome: EpisodeOutcome) -> ExecutorWorkspace:
        kind = outcome.request.unit.kind
        name = self.task.name if kind == "reference" else self.task.workflow_name
        return ExecutorWorkspace(self.executor, outcome, name)

    def bundle(self, outcome: EpisodeOutcome) -> EvidenceBundle:
        return self.evidence.get(str(outcome.episode_id), self.workspace(outcome))[0]

    # -- verdicts --------------------------------------------------------------------------------------------------

    def _invalid_budget(self, verdicts: Verdicts) -> InvalidVerdictBudget:
        """The task's invalid-verdict budget: one verdict per version plus each arbitration recorded so far."""
        return InvalidVerdictBudget(
            f"search task {self.task_id}",
            max_fraction=self.ctx.config.judge.max_invalid_fraction,
            planned=self.iterations + 1 + len(verdicts.champion),
            already_invalid=_invalid_count(verdicts),
        )

    def verdicts(self) -> Verdicts:
        rows = self.ctx.repo.task_comparisons(self.ctx.cycle_id, self.task_id, (Ledger.RHI, Ledger.CHAMPION))
        return Verdicts(
            tuple(row for row in rows if row.ledger == Ledger.RHI),
            tuple(row for row in rows if row.ledger == Ledger.CHAMPION),
        )

    def record_verdict(
        self,
        ledger: Ledger,
        key: str,
        purpose: str,
        sides: tuple[str, str],
        labels: tuple[str, str],
        outcomes: tuple[EpisodeOutcome, EpisodeOutcome],
        bundles: tuple[EvidenceBundle, EvidenceBundle],
        version: int,
    ) -> Comparison:
        """Judge one pair of the step at `version` and record its verdict in `ledger`."""
        unit = CallUnit(f"task{self.task_id}/{ledger.value}/{key}", purpose, self.task_id)
        case = PairwiseCase(
            unit=unit,
            task_id=self.task_id,
            task_text=self.task.task_text,
            label_a=labels[0],
            label_b=labels[1],
            bundle_a=bundles[0],
            bundle_b=bundles[1],
            seed=self.call_seed,
            priority=server_priority(self.ctx.config, "search", version),
        )
        outcome = self.judge.judge(case)
        if outcome.verdict == "invalid":
            # Beyond judge.max_invalid_fraction the step fails here, unrecorded: a rerun judges the pair again.
            self.invalid_budget.admit(unit.key, outcome.rationale)
            logger.warning(
                "task %s: %s recorded as invalid (counted as a tie): %s", self.task_id, key, outcome.rationale
            )
        return self.ctx.repo.record_comparison(
            self.ctx.cycle_id,
            self.task_id,
            ledger.value,
            key,
            side_a=sides[0],
            side_b=sides[1],
            judge_model=self.ctx.config.models.served_name,
            verdict=outcome.verdict,
            episode_a_id=outcomes[0].episode_id,
            episode_b_id=outcomes[1].episode_id,
            judge_provider=self.ctx.config.inference.backend,
            seed=self.call_seed,
            rationale=outcome.rationale,
            llm_call_id=outcome.call_id,
            usage=outcome.usage or None,
        )

    def judge_baselines(
        self, reference: EpisodeOutcome, by_version: dict[int, EpisodeOutcome], verdicts: Verdicts
    ) -> list[Comparison]:
        """Judge every given version against the reference unless already recorded; returns the recorded rows."""
        recorded = {row.key for row in verdicts.rhi}
        todo = [v for v in sorted(by_version) if baseline_key(v) not in recorded]
        if not todo:
            return []
        reference_bundle = self.bundle(reference)

        def judge_one(version: int) -> Comparison:
            outcome = by_version[version]
            return self.record_verdict(
                Ledger.RHI,
                baseline_key(version),
                "judge",
                ("reference", f"v{version}"),
                (REFERENCE_LABEL, version_label(version)),
                (reference, outcome),
                (reference_bundle, self.bundle(outcome)),
                version,
            )

        if len(todo) == 1:
            return [judge_one(todo[0])]
        # v0 and v_k against the same reference are independent calls: judge them at the same time.
        with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix=f"judge-t{self.task_id}") as pool:
            return [future.result() for future in [pool.submit(judge_one, v) for v in todo]]

    def arbitrate(self, champion: int, current: int, outcomes: dict[int, EpisodeOutcome]) -> Comparison:
        return self.record_verdict(
            Ledger.CHAMPION,
            arbitration_key(champion, current),
            "arbitration",
            (f"v{champion}", f"v{current}"),
            (version_label(champion), version_label(current)),
            (outcomes[champion], outcomes[current]),
            (self.bundle(outcomes[champion]), self.bundle(outcomes[current])),
            current,
        )

    # -- proposal --------------------------------------------------------------------------------------------------

    def episode_keys(self, episode_ids: set[int]) -> dict[int, str]:
        """Unit keys of episode rows: from the outcomes this process holds when they cover `episode_ids`, else read."""
        held = {
            outcome.episode_id: episode_unit_key(
                task_id=str(outcome.request.unit.task_id),
                kind=outcome.request.unit.kind,
                seed=outcome.request.unit.seed,
                attempt=outcome.attempt,
                version=outcome.request.unit.version,
                candidate=outcome.request.unit.candidate,
                generation=outcome.request.generation,
            )
            for outcome in self._finished.values()
        }
        if episode_ids <= held.keys():
            return held
        return {e.id: e.unit_key for e in self.ctx.repo.episodes(self.ctx.cycle_id, task_id=self.task_id)}

    def history(self, versions: dict[int, WorkflowVersion], verdicts: Verdicts) -> list[HistoryEntry]:
        entries = []
        referenced = {i for row in verdicts.rhi for i in (row.episode_a_id, row.episode_b_id) if i is not None}
        episodes = self.episode_keys(referenced)
        for row in verdicts.rhi:
            found = _BASELINE_KEY.match(row.key)
            if not found:
                continue
            version = int(found.group(1))
            diff = None
            if version >= 1 and version - 1 in versions and version in versions:
                diff = version_diff(versions[version - 1].design, versions[version].design, version - 1, version)
            entries.append(
                HistoryEntry(
                    key=row.key,
                    version=version,
                    winner=row.verdict,
                    judge_model=row.judge_model,
                    judged_at=row.created_at.isoformat() if row.created_at else None,
                    side_a=row.side_a,
                    side_b=row.side_b,
                    rationale=row.rationale or "",
                    diff=diff,
                    episode_a=episodes.get(row.episode_a_id) if row.episode_a_id is not None else None,
                    episode_b=episodes.get(row.episode_b_id) if row.episode_b_id is not None else None,
                    label_a=REFERENCE_LABEL,
                    label_b=version_label(version),
                )
            )
        return sorted(entries, key=lambda e: e.version)

    def best_design(
        self, state: ChampionState, current: int, versions: dict[int, WorkflowVersion], verdicts: Verdicts
    ) -> BestDesign | None:
        arbitration = verdicts.get(Ledger.CHAMPION, arbitration_key(state.champion, current))
        baseline = verdicts.get(Ledger.RHI, baseline_key(current))
        return select_best(
            state.champion,
            state.has_win,
            current,
            versions[state.champion].design,  # the champion is one of v0..v_current, all recorded by now
            None if arbitration is None else arbitration.rationale or "",
            None if baseline is None else baseline.rationale,
        )

    def optimizer_inputs(
        self,
        current: int,
        outcome: EpisodeOutcome,
        versions: dict[int, WorkflowVersion],
        verdicts: Verdicts,
    ) -> OptimizerInputs:
        state = verdicts.state(current)
        bundle, appendix = self.evidence.get(str(outcome.episode_id), self.workspace(outcome))
        baseline = verdicts.baseline()
        run_status = dict(outcome.status_record)
        run_status.setdefault("trace_has_success_result", outcome.succeeded)
        return OptimizerInputs(
            version=current,
            task_text=self.template.task_text,
            current_design=versions[current].design,
            evidence=bundle.variables(),
            results_appendix=appendix.variables(),
            run_status=run_status,
            history=self.history(versions, verdicts) if current >= 1 else (),
            scoreboard=[(v, baseline.get(v)) for v in range(current + 1)],
            retained=state.retained,
            best=self.best_design(state, current, versions, verdicts),
            v0_design=versions[0].design if current >= 1 else None,  # shown unless it is the best shown above
        )

    def propose(
        self, current: int, outcome: EpisodeOutcome, versions: dict[int, WorkflowVersion], verdicts: Verdicts
    ) -> int:
        """Ask the optimizer for v_{current+1} (or reuse its finished answer) and record the new version."""
        step = f"task {self.task_id}, step v{current}->v{current + 1}"
        unit = CallUnit(f"task{self.task_id}/optimizer/v{current}_to_v{current + 1}", "optimizer", self.task_id)
        search = self.ctx.config.search

        def parse(answer: dict[str, Any] | None) -> Proposal:
            return parse_proposal(
                answer,
                self.template,
                reject_numeric_caps=search.reject_numeric_caps,
                max_design_chars=search.max_design_chars,
            )

        attempts = self.ledger.attempts(unit)
        stored = self.ledger.finished(unit, attempts)
        if stored is not None:
            proposal = parse(stored.parsed)
            call_id: int | None = stored.row.id
        else:
            inputs = self.optimizer_inputs(current, outcome, versions, verdicts)
            prompts = self.ctx.prompts
            system, user = optimizer_system_prompt(prompts=prompts), optimizer_user_prompt(inputs, prompts=prompts)
            try:
                with self.ledger.attempt(unit, len(attempts) + 1) as attempt:
                    result = self.client.chat(
                        system,
                        user,
                        purpose="optimizer",
                        sampling=in_loop_sampling(
                            self.ctx.config,
                            self.call_seed,
                            priority=server_priority(self.ctx.config, "search", current),
                        ),
                        json_mode="json_object",
                    )
                    try:
                        proposal = parse(result.parsed_json)
                    except ProposalError as exc:
                        attempt.mark_invalid(str(exc))
                        raise
                    attempt.parsed = result.parsed_json
                    attempt.extra = {"proposal": proposal.notes}
            except (ProposalError, LLMOutputError) as exc:
                if search.on_invalid_proposal != "keep_design":
                    raise ProposalError(
                        f"{step}: optimizer output unusable ({exc}); no version written, rerun the step to retry"
                    ) from None
                # Demo behaviour: the next version repeats the current design, visibly (identical diff, a log line,
                # and the invalid optimizer call linked), so the cycle can go on with a model that writes no JSON.
                logger.warning("%s: optimizer output unusable (%s); carrying v%s's design forward", step, exc, current)
                invalid_row = attempt.row if "attempt" in locals() else None
                invalid_id = invalid_row.id if invalid_row is not None else None
                return self._record_version(current, versions[current].design, versions, call_id=invalid_id)
            call_id = attempt.row.id if attempt.row is not None else None
        return self._record_version(current, proposal.design, versions, call_id=call_id)

    def _record_version(
        self, current: int, design: str, versions: dict[int, WorkflowVersion], *, call_id: int | None
    ) -> int:
        """Store the prompt of v_{current+1} with `design` and record its row."""
        proposal_design = design
        prompt = self.template.render(proposal_design)
        uri = self._store_prompt(current + 1, prompt)
        self.ctx.repo.record_workflow_version(
            self.ctx.cycle_id,
            self.task_id,
            current + 1,
            design=proposal_design,
            parent_version=current,
            diff=design_diff(versions[current].design, proposal_design, context=1),
            prompt_uri=uri,
            prompt_sha256=_sha256(prompt),
            proposal_call_id=call_id,
        )
        self._prompts[current + 1] = prompt
        return current + 1

    # -- the step --------------------------------------------------------------------------------------------------

    def step(self, current: int) -> StepResult:
        check_step(self.ctx.config, self.task_id, current)
        versions = self.versions()
        if 0 not in versions:
            versions[0] = self.ensure_v0()
        prompt = self.prompt_of(current, versions)
        # v0 runs with the reference at step 0 and is judged at step 1; later steps need only the reference (for
        # judging) and v_k, which keeps the reuse checks of finished episodes off the hot path.
        needed = sorted({0, current}) if current <= 1 else [current]
        requests = [self.reference_request()]
        requests += [self.version_request(v, self.task.initial_prompt if v == 0 else prompt) for v in needed]
        outcomes = self.run(requests)
        reference = outcomes[0]
        by_version = dict(zip(needed, outcomes[1:], strict=True))
        judged = 0
        arbitrated = False
        # One read of the ledgers per step; what this step records is added to the snapshot as it is recorded.
        verdicts = self.verdicts()
        self.invalid_budget = self._invalid_budget(verdicts)
        if current >= 1:
            baselines = self.judge_baselines(reference, by_version, verdicts)
            judged = len(baselines)
            verdicts = verdicts.including(baselines)
            state = verdicts.state(current)
            if state.arbitration_needed:
                champion = state.champion
                if champion not in by_version:
                    champion_prompt = self.prompt_of(champion, versions)
                    by_version[champion] = self.run([self.version_request(champion, champion_prompt)])[0]
                verdicts = verdicts.including([self.arbitrate(champion, current, by_version)])
                judged += 1
                arbitrated = True
        state = verdicts.state(current)
        current_outcome = by_version[current]
        if current == self.iterations:
            self.ctx.repo.record_retained_workflow(
                self.ctx.cycle_id,
                self.task_id,
                version=state.retained,
                beats_reference=state.retained is not None,
                last_evaluated_version=current,
                model=self.ctx.config.models.served_name,
            )
            return StepResult(
                self.task_id, current, current_outcome.status, state.champion, state.retained, judged, arbitrated,
                final=True, invalid_verdicts=_invalid_count(verdicts),
            )  # fmt: skip
        if current + 1 in versions:
            proposed = current + 1
        else:
            proposed = self.propose(current, current_outcome, versions, verdicts)
        return StepResult(
            self.task_id, current, current_outcome.status, state.champion, state.retained, judged, arbitrated, proposed,
            invalid_verdicts=_invalid_count(verdicts),
        )  # fmt: skip

    def scoreboard(self) -> str:
        baseline = self.verdicts().baseline()
        marks = {"B": "W", "A": "L", "tie": "T", "invalid": "T!"}
        return " ".join(f"v{v}:{marks.get(baseline.get(v, ''), '?')}" for v in range(self.iterations + 1))


def _invalid_count(verdicts: Verdicts) -> int:
    """Verdicts of a task's two ledgers recorded invalid."""
    return sum(1 for row in (*verdicts.rhi, *verdicts.champion) if row.verdict == "invalid")


@dataclass
class _Shared:
    """A client and ledger shared by the steps of one process (one HTTP pool, one recorder)."""

    ctx: CycleContext
    client: LLMClient
    ledger: CallLedger
    owns_client: bool

    def close(self) -> None:
        if self.owns_client:
            self.client.close()


def _shared(ctx: CycleContext, client: LLMClient | None) -> _Shared:
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    if client is None:
        return _Shared(ctx, ledger.bind(open_client(ctx.config)), ledger, owns_client=True)
    return _Shared(ctx, ledger.bind(client), ledger, owns_client=False)


def search_step(
    ctx: CycleContext, executor: EpisodeExecutor, task_id: int, version: int, *, client: LLMClient | None = None
) -> StepResult:
    """Step `version` of task `task_id` (one Airflow task instance per step); resumable and idempotent."""
    search_task_ids(ctx.config, [task_id])
    shared = _shared(ctx, client)
    try:
        return _TaskSearch(ctx, executor, task_id, shared.client, shared.ledger).step(version)
    finally:
        shared.close()


def _search_chain(ctx: CycleContext, executor: EpisodeExecutor, task_id: int, shared: _Shared) -> TaskSearchResult:
    search = _TaskSearch(ctx, executor, task_id, shared.client, shared.ledger)
    steps = [search.step(version) for version in range(ctx.config.search.iterations + 1)]
    final = steps[-1]
    return TaskSearchResult(
        task_id=task_id,
        retained_version=final.retained,
        beats_reference=final.retained is not None,
        last_evaluated_version=final.version,
        scoreboard=search.scoreboard(),
        steps=tuple(steps),
    )


def search_task(
    ctx: CycleContext, executor: EpisodeExecutor, task_id: int, *, client: LLMClient | None = None
) -> TaskSearchResult:
    """Every step of one task, in order (steps already done are found done)."""
    search_task_ids(ctx.config, [task_id])
    shared = _shared(ctx, client)
    try:
        return _search_chain(ctx, executor, task_id, shared)
    finally:
        shared.close()


def search_tasks(
    ctx: CycleContext,
    executor: EpisodeExecutor,
    task_ids: Sequence[int] | None = None,
    *,
    client: LLMClient | None = None,
) -> list[TaskSearchResult]:
    """All tasks' searches at once (one thread per task, each chain sequential); results in task order.

    A failing task does not stop the others; when any failed, SearchFailedError carries every result.
    """
    chosen = search_task_ids(ctx.config, task_ids)
    shared = _shared(ctx, client)
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(chosen)), thread_name_prefix="search") as pool:
            futures = {task: pool.submit(_search_chain, ctx, executor, task, shared) for task in chosen}
            results = []
            for task, future in futures.items():
                try:
                    results.append(future.result())
                except Exception as exc:  # one task's failure is reported with the others' results
                    logger.error("search of task %s failed: %s", task, exc)
                    results.append(TaskSearchResult(task, None, False, -1, "", error=f"{type(exc).__name__}: {exc}"))
    finally:
        shared.close()
    if any(result.error for result in results):
        raise SearchFailedError(results)
    return results
