"""Where a cycle stands, read from the metadata store only (a cycle run from the CLI and one run from Airflow alike):
per stage, units planned / done / failed / stopped by a budget / in flight, tokens and cost so far
(`cost.records.StageUsage`), budgets against the ledger, elapsed wall-clock and an ETA.

Unit states: ``done`` (a final record; a model failure is data, never redone), ``failed`` (on infrastructure),
``budget_exhausted`` (raise the budget, then redo), ``running`` (part of its records, or a fresh episode lease of a
later attempt; `IN_FLIGHT_NOTE`) and ``pending`` (nothing recorded). ``pending`` counts every unit neither finished
nor failed, ``in_flight`` those of them that started. The cycle is ``finished`` once every unit is done, ``in
progress`` once any has a record, else ``not started``; a row marked succeeded or failed says so.

The unit lists here are also what `ops.repair` redoes: one place decides what a missing or failed unit is. How each
stage's units are told in flight, and how leases and clocks are read: docs/operations.md, "Unit states".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig, validate_config
from mass_ops.cost.prices import token_cost
from mass_ops.cost.records import CarriesUsage, StageUsage, total_usage
from mass_ops.errors import InputError
from mass_ops.ops.leases import describe_lease, lease_horizon_s, lease_is_fresh
from mass_ops.stage_registry import (
    COLLECT,
    EVALUATE,
    EXPORT,
    RANK,
    RENDER,
    ROLLOUT,
    SEARCH,
    SELECT,
    TRACKED,
    TRAIN,
    stage_of_episode,
)
from mass_ops.stages.common import TRAINING_RUN_KEY
from mass_ops.store.budgets import BudgetLimits
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import (
    Cycle,
    Dataset,
    Episode,
    EpisodeLease,
    Evaluation,
    LLMCall,
    ModelGeneration,
    Ranking,
    RetainedWorkflow,
    RunStatus,
    Selection,
    TrainingRun,
    WorkflowVersion,
)
from mass_ops.store.urls import mask_url

# An episode unit: (kind, task, version, candidate, generation).
UnitKey = tuple[str, str, int | None, int | None, str | None]

FINAL_EPISODE = ("succeeded", "model_failure")
IN_FLIGHT_NOTE = (
    "in flight = an agent episode whose attempt has started and is not recorded yet (its lease), or a unit with part "
    "of its records in the store, not the last (a search step judging or proposing, a task being ranked, a render, "
    "the training run, the evaluation's judging); a lease older than the episode wall-clock limit plus a margin, or "
    "a local runner's lease not renewed for 5 minutes, was left by a crash and counts as pending"
)
NOT_RECORDED = IN_FLIGHT_NOTE  # the former name


class StatusError(InputError):
    """No such cycle in the store (or no store at all); the message names the cycle and the store."""


@dataclass(frozen=True)
class UnitState:
    """One unit of a stage and its state (see the module docstring); `key` names it for people and for repair."""

    stage: str
    key: str
    state: str
    detail: str = ""
    task_id: int | None = None
    finished_at: datetime | None = None
    leased: bool = False  # running under a fresh episode lease: an agent is at work on it right now


@dataclass(frozen=True)
class StageStatus(CarriesUsage):
    """Progress, spend and timing of one stage (its tokens and cost read through `usage`)."""

    stage: str
    planned: int
    done: int
    failed: int
    budget_exhausted: int
    pending: int  # not finished, not failed: in flight or not started
    in_flight: int  # of those, the started ones (state ``running``: see IN_FLIGHT_NOTE)
    started: bool
    usage: StageUsage = field(default_factory=StageUsage)  # tokens and cost so far (status reads no GPU-hours)
    elapsed_s: float | None = None  # the stage's clock: to now while it has units left
    eta_s: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain data with the usage's tokens and cost in the row, where `status --json` has always had them."""
        row: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "usage":
                row.update({name: value[name] for name in ("prompt_tokens", "completion_tokens", "cost_usd")})
            else:
                row[key] = value
        row["tokens"] = self.tokens
        return row


@dataclass(frozen=True)
class BudgetStatus:
    """One ledger scope: spend so far and its limits (None = unlimited)."""

    scope: str
    tokens: int
    cost_usd: float
    requests: int
    token_limit: int | None
    cost_limit: float | None
    exhausted: bool


@dataclass(frozen=True)
class CycleStatus:
    """Everything `mass-ops status` prints."""

    cycle: str
    cycle_status: str  # finished, in progress, not started, failed (see the module docstring)
    generated_at: datetime
    created_at: datetime
    elapsed_s: float
    stages: list[StageStatus]
    budgets: list[BudgetStatus]
    budgets_from: str
    units: list[UnitState] = field(default_factory=list)
    eta_s: float | None = None
    in_flight_note: str = IN_FLIGHT_NOTE
    store: str = ""  # the metadata store read, password masked

    @property
    def tokens(self) -> int:
        return total_usage(self.stages).tokens

    @property
    def cost_usd(self) -> float:
        return total_usage(self.stages).cost_usd

    def stage(self, name: str) -> StageStatus:
        return next(s for s in self.stages if s.stage == name)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data (`status --json`): units other than done are listed; times as ISO strings."""

        def plain(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, list):
                return [plain(v) for v in value]
            return value

        data = asdict(self)
        data["units"] = [u for u in data["units"] if u["state"] != "done"]
        data["tokens"] = self.tokens
        data["cost_usd"] = self.cost_usd
        data["stages"] = [stage.as_dict() for stage in self.stages]
        result: dict[str, Any] = plain(data)
        return result


# -- reading the cycle ------------------------------------------------------------------------------------------------


def open_repository(config: CycleConfig) -> MetadataRepository:
    """The metadata store of `config`, opened read-only in spirit: a missing SQLite file is an error, never created."""
    url = config.storage.metadata_url
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        if not database or not Path(database).is_file():
            raise StatusError(f"no metadata store at {url}: nothing has been recorded there")
    return MetadataRepository.from_url(url)


def cycle_row(repo: MetadataRepository, cycle: str) -> Cycle:
    """The cycle's row; StatusError when it was never opened in this store."""
    row = repo.get_cycle(cycle)
    if row is None:
        store = mask_url(repo.store.url)
        raise StatusError(f"cycle {cycle!r}: not in the metadata store {store}; run validate_config first")
    return row


def recorded_config(config: CycleConfig, row: Cycle) -> tuple[CycleConfig, str]:
    """The cycle's own config: `config` when it is the one frozen in the row (same name and hash: its budgets are
    the operator's current ones), else the row's frozen config on `config`'s storage. Second: where budgets came
    from."""
    if config.cycle_name == row.name and config.config_hash() == row.config_hash:
        return config, "the given config"
    data = dict(row.config)
    data["storage"] = config.storage.model_dump(mode="json")
    return validate_config(data), "the config frozen in the cycle row"


@dataclass
class _Records:
    """The rows of one cycle that decide its units (read once per status)."""

    episodes: list[Episode]
    calls: list[LLMCall]
    versions: list[WorkflowVersion]
    retained: list[RetainedWorkflow]
    rankings: list[Ranking]
    selections: list[Selection]
    datasets: list[Dataset]
    runs: list[TrainingRun]
    generations: list[ModelGeneration]
    evaluations: list[Evaluation]
    leases: list[EpisodeLease] = field(default_factory=list)
    now: datetime = field(default_factory=lambda: datetime.now(UTC))

    @classmethod
    def read(cls, repo: MetadataRepository, cycle_id: int, now: datetime | None = None) -> _Records:
        return cls(
            episodes=repo.episodes(cycle_id),
            calls=repo.llm_calls(cycle_id),
            versions=repo.cycle_workflow_versions(cycle_id),
            retained=repo.retained_workflows(cycle_id),
            rankings=repo.cycle_rankings(cycle_id),
            selections=repo.cycle_selections(cycle_id),
            datasets=repo.datasets(cycle_id),
            runs=repo.training_runs(cycle_id),
            generations=repo.cycle_generations(cycle_id),
            evaluations=repo.evaluations(cycle_id=cycle_id),
            leases=repo.episode_leases(cycle_id),
            now=now or datetime.now(UTC),
        )

    def latest_attempts(self) -> dict[UnitKey, Episode]:
        """The latest attempt of every episode unit, by (kind, task, version, candidate, generation)."""
        latest: dict[UnitKey, Episode] = {}
        for e in self.episodes:
            key = (e.kind, e.task_id, e.version, e.candidate, e.generation)
            if key not in latest or e.attempt > latest[key].attempt:
                latest[key] = e
        return latest

    def running_leases(self, config: CycleConfig) -> dict[UnitKey, str]:
        """The detail of every episode unit in flight, keyed as `latest_attempts`: a fresh lease of an attempt later
        than the unit's latest recorded one (an older attempt's lease outlived its row: its end was lost)."""
        horizon = lease_horizon_s(config)
        latest = self.latest_attempts()
        running = {}
        for lease in self.leases:
            key = (lease.kind, lease.task_id, lease.version, lease.candidate, lease.generation)
            recorded = latest.get(key)
            if lease_is_fresh(lease, horizon, self.now) and (recorded is None or lease.attempt > recorded.attempt):
                running[key] = describe_lease(lease, self.now)
        return running


def _episode_state(stage: str, key: str, task: int, episode: Episode | None, running: str | None = None) -> UnitState:
    """A unit whose record is one episode (its latest attempt), `running` the detail of its lease when a later attempt
    is in flight."""
    if episode is not None and episode.status in FINAL_EPISODE:
        return UnitState(stage, key, "done", episode.status, task, episode.finished_at)
    if running is not None:
        return UnitState(stage, key, "running", running, task, leased=True)
    if episode is None:
        return UnitState(stage, key, "pending", task_id=task)
    state = "budget_exhausted" if episode.status == "budget_exhausted" else "failed"
    return UnitState(stage, key, state, f"attempt {episode.attempt} {episode.status}", task, episode.finished_at)


def collected_tasks(config: CycleConfig, retained: Sequence[RetainedWorkflow]) -> tuple[list[int], bool]:
    """Training tasks whose candidates are collected (the rule of `stages.collect.eligibility`), and whether every
    one of them has finished its search (else the list is not final)."""
    by_task = {int(r.task_id): r for r in retained}
    chosen = []
    for task in config.tasks.train:
        row = by_task.get(task)
        if row is None:
            continue
        beats = row.beats_reference and row.version is not None
        if beats or not config.collection.require_beats_reference:
            chosen.append(task)
    return chosen, all(task in by_task for task in config.tasks.train)


def cycle_units(config: CycleConfig, records: _Records) -> list[UnitState]:
    """Every unit of every stage with its state, in stage order."""
    latest = records.latest_attempts()
    running = records.running_leases(config)
    collected, _ = collected_tasks(config, records.retained)
    return [
        *_search_units(config, records, latest, running),
        *_collection_units(config, collected, latest, running),
        *_ranking_units(records, collected),
        *_training_units(config, records),
        *_evaluation_units(config, records, latest, running),
    ]


def _search_units(
    config: CycleConfig, records: _Records, latest: Mapping[UnitKey, Episode], running: Mapping[UnitKey, str]
) -> list[UnitState]:
    """Search step k of each task: done once it proposed v(k+1), the last step once the task's retained workflow is
    recorded; its episodes' latest attempts tell a failed step from one not run."""
    proposed = {(int(v.task_id), v.version): v for v in records.versions}
    retained = {int(r.task_id): r for r in records.retained}
    last = config.search.iterations
    units = []
    for task in config.tasks.train_candidates:
        for version in range(last + 1):
            key = f"search-t{task}-v{version}"
            record = retained.get(task) if version == last else proposed.get((task, version + 1))
            if record is not None:
                units.append(UnitState(SEARCH.name, key, "done", task_id=task, finished_at=record.created_at))
                continue
            keys: list[UnitKey] = [("search", str(task), version, None, None)]
            if version == 0:
                keys.append(("reference", str(task), None, None, None))
            next_record = "the retained workflow" if version == last else f"v{version + 1}"
            units.append(_search_step(key, task, keys, next_record, latest, running))
    return units


def _search_step(
    key: str,
    task: int,
    keys: Sequence[UnitKey],
    next_record: str,
    latest: Mapping[UnitKey, Episode],
    running: Mapping[UnitKey, str],
) -> UnitState:
    """A search step not done yet, from its episodes (`keys`): failed or budget-stopped, running under a lease, in
    flight with an episode recorded and `next_record` not, or pending."""
    states = [
        _episode_state(SEARCH.name, key, task, latest.get(k), running.get(k))
        for k in keys
        if k in latest or k in running
    ]
    broken = [u for u in states if u.state in ("failed", "budget_exhausted")]
    leased = [u for u in states if u.state == "running"]
    if broken:
        return broken[0]
    if leased:  # an episode of the step is running
        return leased[0]
    if states:  # an episode of the step is recorded, its judging and proposal are not (yet)
        what = "episodes recorded" if len(states) == len(keys) else "an episode recorded"
        return UnitState(SEARCH.name, key, "running", f"{what}; {next_record} not yet", task)
    return UnitState(SEARCH.name, key, "pending", task_id=task)


def _collection_units(
    config: CycleConfig, collected: Sequence[int], latest: Mapping[UnitKey, Episode], running: Mapping[UnitKey, str]
) -> list[UnitState]:
    """One unit per teacher candidate of each collected task."""
    units = []
    for task in collected:
        for candidate in range(config.collection.candidates):
            unit: UnitKey = ("collection", str(task), None, candidate, None)
            key = f"collection-t{task}-c{candidate}"
            units.append(_episode_state(COLLECT.name, key, task, latest.get(unit), running.get(unit)))
    return units


def _ranking_units(records: _Records, collected: Sequence[int]) -> list[UnitState]:
    """Ranking and selection of each collected task: done once its rows are written; a ranking with calls recorded
    and no ranks is in flight."""
    ranked = defaultdict(list)
    for r in records.rankings:
        ranked[int(r.task_id)].append(r.created_at)
    selected = defaultdict(list)
    for s in records.selections:
        selected[int(s.task_id)].append(s.created_at)
    # a task's ranking matches and self-judge calls: its ranking has started
    ranking_calls: defaultdict[int, int] = defaultdict(int)
    for c in records.calls:
        if c.task_id is not None and call_stage(c) == RANK.name:
            ranking_calls[int(c.task_id)] += 1
    units = []
    for stage, rows, what in ((RANK.name, ranked, "rank"), (SELECT.name, selected, "select")):
        for task in collected:
            done = rows.get(task)
            if not done and stage == RANK.name and ranking_calls.get(task):
                detail = f"{ranking_calls[task]} ranking calls recorded; no ranks yet"
                units.append(UnitState(stage, f"{what}-t{task}", "running", detail, task))
                continue
            units.append(
                UnitState(stage, f"{what}-t{task}", "done" if done else "pending", task_id=task,
                          finished_at=max(done) if done else None)
            )  # fmt: skip
    return units


def _training_units(config: CycleConfig, records: _Records) -> list[UnitState]:
    """The render's two splits, the training run and the new generation's registration."""
    units = []
    datasets = {d.split: d for d in records.datasets}
    for split in ("train", "val"):
        row = datasets.get(split)
        state = "done" if row else "running" if datasets else "pending"  # one split of the one render written
        units.append(UnitState(RENDER.name, f"render-{split}", state,
                               finished_at=row.created_at if row else None))  # fmt: skip
    run = next((r for r in records.runs if r.key == TRAINING_RUN_KEY), None)
    run_states: dict[str, str] = {RunStatus.SUCCEEDED: "done", RunStatus.FAILED: "failed", RunStatus.RUNNING: "running"}
    units.append(
        UnitState(TRAIN.name, f"train-{TRAINING_RUN_KEY}", run_states.get(run.status, "pending") if run else "pending",
                  finished_at=run.finished_at if run else None)
    )  # fmt: skip
    from mass_ops.stages.evaluate import evaluated_generations

    new, _ = evaluated_generations(config)
    registered = next((g for g in records.generations if g.name == new), None)
    units.append(UnitState(EXPORT.name, f"register-{new}", "done" if registered else "pending",
                           finished_at=registered.registered_at if registered else None))  # fmt: skip
    return units


def _evaluation_units(
    config: CycleConfig, records: _Records, latest: Mapping[UnitKey, Episode], running: Mapping[UnitKey, str]
) -> list[UnitState]:
    """Each rollout episode, then the pairwise evaluation: in flight while judge calls are recorded without its
    summary."""
    from mass_ops.stages.evaluate import rollout_units

    units = []
    for generation, task, replicate in rollout_units(config):
        unit: UnitKey = ("rollout", str(task), None, replicate, generation)
        key = f"rollout-{generation}-t{task}-r{replicate}"
        units.append(_episode_state(ROLLOUT.name, key, task, latest.get(unit), running.get(unit)))
    evaluation = next((e for e in records.evaluations if e.kind == "pairwise"), None)
    judged = sum(call_stage(c) == EVALUATE.name for c in records.calls)
    if evaluation is None and judged:
        detail = f"{judged} judge calls recorded; no summary"
        units.append(UnitState(EVALUATE.name, "evaluate-pairwise", "running", detail))
    else:
        units.append(UnitState(EVALUATE.name, "evaluate-pairwise", "done" if evaluation else "pending",
                               finished_at=evaluation.created_at if evaluation else None))  # fmt: skip
    return units


# -- spend ------------------------------------------------------------------------------------------------------------


def episode_stage(kind: str) -> str | None:
    """The followed stage that records episodes of `kind` (`stages.registry`), or None (benchmark episodes)."""
    stage = stage_of_episode(kind)
    return stage.name if stage else None


def call_stage(call: LLMCall) -> str:
    """The stage an LLM call belongs to, from its unit key (``eval/…`` evaluation, ``task<q>/ranking/…`` ranking,
    ``task<q>/{rhi,champion,optimizer}/…`` search)."""
    if EVALUATE.call_prefix and call.unit_key.startswith(EVALUATE.call_prefix):
        return EVALUATE.name
    if "/ranking/" in call.unit_key or call.purpose in RANK.call_purposes:
        return RANK.name
    return SEARCH.name


@dataclass
class _Spend:
    """A stage's tokens and cost (`usage`), added row by row, and the times of its activity."""

    usage: StageUsage = field(default_factory=StageUsage)
    starts: list[datetime] = field(default_factory=list)
    ends: list[datetime] = field(default_factory=list)


def stage_spend(config: CycleConfig, records: _Records) -> dict[str, _Spend]:
    """Tokens, cost and activity times per stage from episode and LLM-call rows. Cost: what the server reported for
    a call, else the price table's per-token price of its model (0 for self-hosted models, paid by the GPU-hour)."""
    spend: dict[str, _Spend] = defaultdict(_Spend)
    for e in records.episodes:
        stage = episode_stage(e.kind)
        if stage is None:
            continue
        bucket = spend[stage]
        prompt, completion = e.prompt_tokens or 0, e.completion_tokens or 0
        cost = token_cost(config.prices, e.model or "", prompt, completion, e.cached_prompt_tokens or 0)
        bucket.usage += StageUsage(prompt, completion, cost)
        bucket.starts += [t for t in (e.started_at,) if t is not None]
        bucket.ends += [t for t in (e.finished_at,) if t is not None]
    for c in records.calls:
        bucket = spend[call_stage(c)]
        prompt, completion = c.prompt_tokens or 0, c.completion_tokens or 0
        cost = (
            c.cost_usd
            if c.cost_usd is not None  # what the server reported, else the price table's
            else token_cost(config.prices, c.model, prompt, completion, c.cached_prompt_tokens or 0)
        )
        bucket.usage += StageUsage(prompt, completion, cost)
        if c.created_at is not None:
            bucket.ends.append(c.created_at)
            bucket.starts.append(datetime.fromtimestamp(c.created_at.timestamp() - (c.latency_s or 0.0), UTC))
    for run in records.runs:
        bucket = spend[TRAIN.name]
        bucket.starts += [t for t in (run.started_at,) if t is not None]
        bucket.ends += [t for t in (run.finished_at,) if t is not None]
    return spend


def budget_statuses(repo: MetadataRepository, cycle_id: int, limits: BudgetLimits) -> list[BudgetStatus]:
    """Every ledger scope of the cycle with its limits (``cycle`` first, then ``in_loop``, then tasks)."""
    rows = repo.budget_spend(cycle_id)
    scopes = sorted(rows, key=lambda s: (s != "cycle", s != "in_loop", s))
    for scope in ("cycle", "in_loop"):  # a limited scope with no spend yet still shows its limit
        if scope not in rows and limits.limited([scope]):
            scopes.append(scope)
    result = []
    for scope in scopes:
        row = rows.get(scope)
        token_limit, cost_limit, _ = limits.for_scope(scope)
        tokens, cost = (row.tokens, row.cost_usd) if row else (0, 0.0)
        need = (row.refused_need if row and row.refused_need else 0) or 1
        exhausted = (token_limit is not None and tokens + need > token_limit) or (
            cost_limit is not None and cost >= cost_limit
        )
        result.append(BudgetStatus(scope, tokens, cost, row.requests if row else 0, token_limit, cost_limit, exhausted))
    return result


# -- the status -------------------------------------------------------------------------------------------------------


def _elapsed(times: Iterable[datetime], end: datetime) -> float | None:
    times = list(times)
    return (end - min(times)).total_seconds() if times else None


def cycle_state(row: Cycle, units: Sequence[UnitState]) -> str:
    """finished / in progress / not started from the units; the row's own state when a run marked it ended."""
    if row.status == RunStatus.FAILED:
        return "failed"
    if row.status == RunStatus.SUCCEEDED or (units and all(u.state == "done" for u in units)):
        return "finished"
    return "in progress" if any(u.state != "pending" for u in units) else "not started"


def _last_record(units: Sequence[UnitState], spend: Mapping[str, _Spend]) -> datetime | None:
    """When the cycle's last record was written: the latest finished unit or spend row."""
    times = [u.finished_at for u in units if u.finished_at is not None]
    times += [t for bucket in spend.values() for t in bucket.ends]
    return max(times) if times else None


def _stage_status(
    stage: str, units: Sequence[UnitState], spend: _Spend | None, now: datetime, note: str
) -> StageStatus:
    counts: defaultdict[str, int] = defaultdict(int)
    for unit in units:
        counts[unit.state] += 1
    finished = [u.finished_at for u in units if u.state == "done" and u.finished_at is not None]
    starts = list(spend.starts) if spend else []
    starts += finished
    ends = [*(spend.ends if spend else []), *finished]
    started = bool(starts) or any(u.state != "pending" for u in units)
    remaining = counts["pending"] + counts["running"] + counts["failed"] + counts["budget_exhausted"]
    eta = None
    first = min(starts) if starts else None
    if finished and first is not None and remaining and counts["done"]:
        # The measured rate: units done over the time from the stage's first activity to its latest finished unit.
        span = (max(finished) - first).total_seconds()
        if span > 0:
            eta = remaining * span / counts["done"]
    return StageStatus(
        stage=stage,
        planned=len(units),
        done=counts["done"],
        failed=counts["failed"],
        budget_exhausted=counts["budget_exhausted"],
        pending=counts["pending"] + counts["running"],
        in_flight=counts["running"],
        started=started,
        usage=spend.usage if spend else StageUsage(),
        # A stage with nothing left stops its clock at its last record, however long ago that was.
        elapsed_s=_elapsed(starts, now if remaining or not ends else max(ends)) if started else None,
        eta_s=eta,
        note=note,
    )


def cycle_status(config: CycleConfig, cycle: str, *, now: datetime | None = None) -> CycleStatus:
    """The status of `cycle` in `config`'s metadata store (see the module docstring); StatusError when the store or
    the cycle is not there."""
    now = now or datetime.now(UTC)
    repo = open_repository(config)
    row = cycle_row(repo, cycle)
    own, budgets_from = recorded_config(config, row)
    records = _Records.read(repo, row.id, now)
    units = cycle_units(own, records)
    spend = stage_spend(own, records)
    _, search_final = collected_tasks(own, records.retained)
    notes = {
        COLLECT: "" if search_final else "planned counts final once every training task's search has finished",
        RANK: "" if search_final else f"see {COLLECT.name}",
        SELECT: "" if search_final else f"see {COLLECT.name}",
    }
    by_stage: defaultdict[str, list[UnitState]] = defaultdict(list)
    for unit in units:
        by_stage[unit.stage].append(unit)
    stages = [
        _stage_status(s.name, by_stage.get(s.name, []), spend.get(s.name), now, notes.get(s, "")) for s in TRACKED
    ]
    limits = BudgetLimits.from_mapping(own.budgets.model_dump())
    etas = [s.eta_s for s in stages if s.eta_s is not None]
    state = cycle_state(row, units)
    end = row.finished_at or (_last_record(units, spend) if state == "finished" else None) or now
    return CycleStatus(
        cycle=row.name,
        cycle_status=state,
        generated_at=now,
        created_at=row.created_at,
        elapsed_s=(end - row.created_at).total_seconds(),
        stages=stages,
        budgets=budget_statuses(repo, row.id, limits),
        budgets_from=budgets_from,
        units=units,
        eta_s=sum(etas) if etas else None,
        store=mask_url(repo.store.url),
    )
