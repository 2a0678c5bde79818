"""Teacher collection under each task's retained workflow (MASS_SPEC §1 collect).

Teacher prompt = the retained version's prompt (right-stripped) + a blank line + the teacher directive exactly as
its file reads (final newline kept), frozen in the artifact store (a later run with a different prompt is
refused). N candidates per eligible task run with the reference seeds (``seed_base + 100·q + i``), all tasks in one
executor batch so the endpoint's capacity is shared.

A task whose retained workflow never beat the reference is skipped, as in the reference release, unless
`collection.require_beats_reference` is false (demo preset): then the last evaluated version stands in, and the
decision is recorded next to the teacher prompt so the report can say so.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.errors import InfrastructureError, InputError
from mass_ops.layout import (
    EpisodeUnit,
    cycle_prefix,
    teacher_condition,
    teacher_prompt_inputs_key,
    teacher_prompt_key,
    workflow_version_key,
)
from mass_ops.prompts.capture import inputs_of
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome, EpisodeRequest
from mass_ops.seeds import collection_seed
from mass_ops.tasks.catalogue import TaskCatalogue
from mass_ops.tasks.importer import DIRECTIVE_FILE

logger = logging.getLogger(__name__)

Decision = Literal["collect", "skip", "let_through"]


class CollectionError(InputError):
    """Collection cannot run for a task: not a training task, search unfinished, or a changed teacher prompt."""


class CollectionIncompleteError(InfrastructureError):
    """Some of a task's teacher candidates ended in infrastructure failures: the task is not ranked yet."""


class CollectionSkipped(CollectionError):
    """The task's teacher trajectories are not collected (`decision` says why): its candidates have no episode."""

    def __init__(self, decision: Eligibility) -> None:
        super().__init__(f"task {decision.task_id}: {decision.reason}")
        self.decision = decision


def eligibility_key(cycle: str, task_id: int) -> str:
    """Artifact key of a task's collection decision (read by the report)."""
    return f"{cycle_prefix(cycle)}/collection/task{task_id}/eligibility.json"


@dataclass(frozen=True)
class Eligibility:
    """Whether a task's teacher trajectories are collected, with which workflow version, and why."""

    task_id: int
    retained_version: int | None
    beats_reference: bool
    last_evaluated_version: int
    decision: Decision
    version_used: int | None
    reason: str

    @property
    def collects(self) -> bool:
        return self.decision != "skip"


def collection_task_ids(config: CycleConfig, task_ids: Sequence[int] | None) -> list[int]:
    """The tasks to collect for: given ids (each in `tasks.train`), else `tasks.train`."""
    chosen = list(task_ids) if task_ids else list(config.tasks.train)
    outside = sorted({t for t in chosen if t not in config.tasks.train})
    if outside:
        raise CollectionError(f"collect: tasks {outside} are not training tasks of this cycle (tasks.train)")
    return list(dict.fromkeys(chosen))


def eligibility(ctx: CycleContext, task_id: int) -> Eligibility:
    """The collection decision of a task from its retained workflow and `collection.require_beats_reference`."""
    retained = {row.task_id: row for row in ctx.repo.retained_workflows(ctx.cycle_id)}.get(str(task_id))
    if retained is None:
        raise CollectionError(f"task {task_id}: no retained workflow yet; finish its search first")

    def decide(decision: Decision, version_used: int | None, reason: str) -> Eligibility:
        return Eligibility(
            task_id=task_id,
            retained_version=retained.version,
            beats_reference=retained.beats_reference,
            last_evaluated_version=retained.last_evaluated_version,
            decision=decision,
            version_used=version_used,
            reason=reason,
        )

    if retained.beats_reference and retained.version is not None:
        return decide("collect", retained.version, f"retained workflow v{retained.version} beats the reference")
    if ctx.config.collection.require_beats_reference:
        return decide(
            "skip", None, "no workflow version beat the reference; task skipped (collection.require_beats_reference)"
        )
    last = retained.last_evaluated_version
    return decide(
        "let_through",
        last,
        f"no workflow version beat the reference; collected with the last evaluated version v{last} because "
        "collection.require_beats_reference is false",
    )


def eligible_tasks(ctx: CycleContext, task_ids: Sequence[int] | None = None) -> list[Eligibility]:
    """Decisions of the given training tasks (default `tasks.train`), in order."""
    return [eligibility(ctx, task_id) for task_id in collection_task_ids(ctx.config, task_ids)]


def version_prompt(ctx: CycleContext, task_id: int, version: int) -> str:
    """Full prompt of a task's workflow version as the search stored it (v0: the catalogue's initial prompt)."""
    if version == 0:
        return ctx.catalogue.task(task_id).initial_prompt
    key = workflow_version_key(ctx.cycle_name, task_id, version)
    if not ctx.artifacts.exists(key):
        raise CollectionError(f"task {task_id}: prompt of workflow version v{version} is missing at {key}")
    return ctx.artifacts.get_bytes(key).decode("utf-8")


def directive_as_read(catalogue: TaskCatalogue) -> str:
    """The catalogue's teacher directive exactly as its file reads (final newline kept, MASS_SPEC §1 collect),
    checked against the SHA-256 recorded when the catalogue was loaded; a catalogue built in memory has no file and
    gives its directive as held."""
    recorded = catalogue.file_sha256.get(DIRECTIVE_FILE)
    if catalogue.source is None or recorded is None:
        return catalogue.teacher_directive
    path = catalogue.source / DIRECTIVE_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CollectionError(f"{path}: cannot read the teacher directive ({exc.strerror or exc})") from None
    if hashlib.sha256(data).hexdigest() != recorded:
        raise CollectionError(f"{path}: the teacher directive changed since the task catalogue was loaded")
    return data.decode("utf-8")


def teacher_prompt(ctx: CycleContext, retained_prompt: str) -> str:
    """The teacher prompt (template ``teacher_prompt.j2``): the retained workflow prompt, right-stripped, and the
    teacher directive as read."""
    directive = directive_as_read(ctx.catalogue)
    retained = retained_prompt.rstrip()
    return ctx.prompts.render("teacher_prompt.j2", retained_prompt=retained, teacher_directive=directive)


def freeze_teacher_prompt(ctx: CycleContext, task_id: int, version: int) -> str:
    """The teacher prompt of a task, stored on first use; a different stored prompt is refused."""
    prompt = teacher_prompt(ctx, version_prompt(ctx, task_id, version))
    key = teacher_prompt_key(ctx.cycle_name, task_id)
    if ctx.artifacts.exists(key):
        stored = ctx.artifacts.get_bytes(key).decode("utf-8")
        if stored != prompt:
            raise CollectionError(
                f"task {task_id}: the stored teacher prompt {ctx.artifacts.uri(key)} differs from the one built from "
                f"workflow v{version}; a cycle's teacher prompt never changes (use a new cycle)"
            )
    else:
        inputs = inputs_of(prompt)
        if inputs is not None:  # before the prompt: a stored prompt always has its inputs beside it
            ctx.artifacts.put_json(teacher_prompt_inputs_key(ctx.cycle_name, task_id), inputs)
        ctx.artifacts.put_bytes(key, prompt.encode("utf-8"))
    return prompt


def collection_requests(ctx: CycleContext, task_id: int, prompt: str) -> list[EpisodeRequest]:
    """The N teacher episodes of a task (candidate i with seed seed_base + 100·q + i)."""
    config = ctx.config
    condition = teacher_condition(task_id, config.generation)
    requests = []
    for candidate in range(config.collection.candidates):
        seed = collection_seed(config.collection.seed_base, task_id, candidate)
        unit = EpisodeUnit(cycle=ctx.cycle_name, task_id=task_id, kind="collection", seed=seed, candidate=candidate)
        requests.append(EpisodeRequest(unit=unit, condition=condition, prompt=prompt))
    return requests


def candidate_request(ctx: CycleContext, task_id: int, candidate: int) -> EpisodeRequest:
    """Teacher candidate i of task q (one unit of the collection stage), its teacher prompt frozen on first use.

    CollectionSkipped when the task is not collected; CollectionError for a candidate outside the budget or a task
    whose search has not finished.
    """
    decision = eligibility(ctx, task_id)
    if not decision.collects or decision.version_used is None:
        raise CollectionSkipped(decision)
    count = ctx.config.collection.candidates
    if not 0 <= candidate < count:
        raise CollectionError(
            f"task {task_id}: candidate {candidate} is outside 0..{count - 1} (collection.candidates)"
        )
    prompt = freeze_teacher_prompt(ctx, task_id, decision.version_used)
    return collection_requests(ctx, task_id, prompt)[candidate]


@dataclass(frozen=True)
class CollectionResult:
    """What collection did for one task."""

    task_id: int
    decision: Decision
    version_used: int | None
    reason: str
    candidates: int = 0
    succeeded: int = 0
    model_failures: int = 0
    infra_failures: int = 0
    budget_exhausted: int = 0  # attempts a budget stopped (not final: raise the budget and rerun)

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def collect_batch(
    ctx: CycleContext, executor: EpisodeExecutor, task_ids: Sequence[int] | None = None
) -> list[CollectionResult]:
    """Run the teacher candidates of every eligible task in one executor batch (done episodes are reused)."""
    decisions = eligible_tasks(ctx, task_ids)
    batch: list[EpisodeRequest] = []
    for decision in decisions:
        ctx.artifacts.put_json(eligibility_key(ctx.cycle_name, decision.task_id), asdict(decision))
        if not decision.collects:
            logger.warning("task %s: %s", decision.task_id, decision.reason)
            continue
        if decision.decision == "let_through":
            logger.warning("task %s: %s", decision.task_id, decision.reason)
        if decision.version_used is None:  # unreachable: collecting decisions always name a version
            raise CollectionError(f"task {decision.task_id}: no workflow version to collect with")
        prompt = freeze_teacher_prompt(ctx, decision.task_id, decision.version_used)
        batch += collection_requests(ctx, decision.task_id, prompt)
    outcomes = executor.run(batch) if batch else []
    by_task: dict[int, list[EpisodeOutcome]] = {}
    for outcome in outcomes:
        by_task.setdefault(outcome.request.unit.task_id, []).append(outcome)
    results = []
    for decision in decisions:
        done = by_task.get(decision.task_id, [])
        results.append(
            CollectionResult(
                task_id=decision.task_id,
                decision=decision.decision,
                version_used=decision.version_used,
                reason=decision.reason,
                candidates=len(done),
                succeeded=sum(o.status == "succeeded" for o in done),
                model_failures=sum(o.status == "model_failure" for o in done),
                infra_failures=sum(o.status == "infra_failure" for o in done),
                budget_exhausted=sum(o.status == "budget_exhausted" for o in done),
            )
        )
    return results


def collect_task(ctx: CycleContext, executor: EpisodeExecutor, task_id: int) -> CollectionResult:
    """Every teacher candidate of one training task (the per-task collection unit of the pipelined order): runs the
    candidates that are not final yet, reuses the finished ones.

    Raises `CollectionIncompleteError` when some candidates failed on infrastructure after every attempt: a ranking
    is final once recorded, so the task is ranked only when every candidate is final; a rerun runs only those.
    """
    (result,) = collect_batch(ctx, executor, [task_id])
    if result.infra_failures:
        raise CollectionIncompleteError(
            f"task {task_id}: {result.infra_failures} of {result.candidates} teacher candidates failed on "
            "infrastructure after every attempt; not ranked — rerun to repair (finished units are reused)"
        )
    return result


def run_collect(
    config: CycleConfig, tasks: Sequence[int] | None = None, *, executor: EpisodeExecutor
) -> list[dict[str, Any]]:
    """The `collect` command: teacher candidates for the training tasks; one summary row per task."""
    return [result.as_row() for result in collect_batch(attach_cycle(config), executor, tasks)]
