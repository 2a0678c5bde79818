"""Publishing an attempt: every artifact first (atomically, the status document last), then its row.

A sink takes each finished attempt (`PublicationSink`): `StoreSink` publishes it to the cycle's own stores
(`publish_episode`) and charges its spend; on Kubernetes `mass_ops.runtime.handoff.HandoffSink` hands it to the
pod's publisher container, which runs the same `publish_episode`. Publishing is idempotent (artifacts of a unit
attempt have fixed keys; a row another process recorded first wins), and an abort stops it before the row
(`PublishAborted`), so a cancelled attempt records nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol, cast

from mass_ops.context import CycleContext
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeStatus
from mass_ops.runtime.publication import EpisodePublication
from mass_ops.store.artifacts import ArtifactInfo, ArtifactStore
from mass_ops.store.budgets import CYCLE_SCOPE, BudgetLimits, charge_episode, task_scope

logger = logging.getLogger(__name__)

# Publishing order of an attempt's artifacts: the status document last, so a reader that finds it finds the rest.
PUBLISH_ORDER = ("workspace", "prompt", "stream", "stderr", "api_log", "settings", "status")


class PublishAborted(Exception):
    """The attempt was cancelled while its artifacts were being published: the row must not be written."""


class PublicationSink(Protocol):
    """Where a finished attempt goes: published at once (`StoreSink`), or handed to a publisher container
    (`mass_ops.runtime.handoff.HandoffSink`). Returns the attempt's recorded outcome."""

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome: ...


class StoreSink:
    """Publishes each attempt to the cycle's own stores (the local backend, and whoever holds the credentials)."""

    def __init__(self, ctx: CycleContext) -> None:
        self.ctx = ctx
        self.limits = BudgetLimits.from_mapping(ctx.config.budgets.model_dump())

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome:
        outcome = publish_episode(self.ctx, publication, abort)
        task = publication.unit.task_id
        if not self.limits.limited((task_scope(task), CYCLE_SCOPE)):
            # The attempt's proxy recorded nothing in the ledger (it reads the store only for limited scopes): charge
            # the whole attempt now, so the cycle's spend counts every episode, as a pod's publisher does.
            record = publication.record
            charge_episode(self.ctx.repo, self.ctx.cycle_id, task, charge_key=f"episode:{outcome.episode_id}",
                           tokens=record.prompt_tokens + record.completion_tokens,
                           requests=record.requests)  # fmt: skip
        return outcome


def publish_episode(
    ctx: CycleContext, publication: EpisodePublication, abort: threading.Event | None = None
) -> EpisodeOutcome:
    """Publish every artifact of the attempt (atomically, the status document last), then record its row.

    Idempotent: artifacts of a unit attempt have fixed keys, and recording an attempt that another process already
    recorded returns that row (see `record_publication`). `abort` stops between artifacts, before the row.
    """
    artifacts = publish_artifacts(ctx.artifacts, publication, abort)
    if abort is not None and abort.is_set():
        raise PublishAborted
    return record_publication(ctx, publication, artifacts)


def publish_artifacts(
    store: ArtifactStore, publication: EpisodePublication, abort: threading.Event | None = None
) -> dict[str, ArtifactInfo]:
    """Every artifact of the attempt, each published atomically, in `PUBLISH_ORDER`; returns name → what was
    published (URI and SHA-256, both recorded in the episode's row)."""
    files, unit = publication.files, publication.unit

    def put_workspace(key: str) -> ArtifactInfo:
        if files.workspace_archived:
            return store.put_file(key, files.workspace)
        return store.put_dir(key, files.workspace, skip_escaping_links=True)

    puts: dict[str, Callable[[str], ArtifactInfo]] = {
        "workspace": put_workspace,
        "prompt": lambda key: store.put_file(key, files.prompt),
        "stream": lambda key: store.put_file(key, files.stream),
        "stderr": lambda key: store.put_file(key, files.stderr),
        "api_log": lambda key: store.put_file(key, files.api_log),
        "settings": lambda key: store.put_file(key, files.settings),
        "status": lambda key: store.put_json(key, publication.status),
    }
    published = {}
    for name in PUBLISH_ORDER:
        if abort is not None and abort.is_set():
            raise PublishAborted
        published[name] = puts[name](unit.artifact_key(name))
    return published


def record_publication(
    ctx: CycleContext, publication: EpisodePublication, published: Mapping[str, ArtifactInfo]
) -> EpisodeOutcome:
    """Commit the attempt's row (after its artifacts are durable) and return the recorded outcome."""
    request, unit, record = publication.request, publication.unit, publication.record
    row = ctx.repo.record_episode(
        ctx.cycle_id,
        task_id=unit.task_id,
        kind=unit.kind,
        seed=unit.seed,
        status=record.status,
        attempt=unit.attempt,
        version=unit.version,
        candidate=unit.candidate,
        generation=request.generation,
        condition=request.condition,
        model=record.model,
        exit_code=record.exit_code,
        failure=record.failure,
        prompt_sha256=request.prompt_sha256,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        requests=record.requests,
        max_prompt_tokens=record.max_prompt_tokens,
        started_at=record.started_at,
        finished_at=record.finished_at,
        duration_s=(record.finished_at - record.started_at).total_seconds(),
        artifacts={name: info.uri for name, info in published.items()},
        artifact_sha256={name: info.sha256 for name, info in published.items()},
        qwen_code_version=record.qwen_code_version,
        retry_of_id=publication.retry_of_id,
        cached_prompt_tokens=record.cached_prompt_tokens,
    )
    status = publication.status
    recorded_at = row.started_at or record.started_at
    if row.status != record.status or abs((recorded_at - record.started_at).total_seconds()) > 0.001:
        # Another process recorded this attempt first (same key): its row is the truth, report that one.
        logger.warning("episode %s was recorded by another run (%s); using that record", unit.key, row.status)
        status = ctx.artifacts.get_json(unit.artifact_key("status"))
    logger.info(
        "episode %s: %s (requests=%d prompt_tokens=%d completion_tokens=%d)",
        unit.key,
        row.status,
        record.requests,
        record.prompt_tokens,
        record.completion_tokens,
        extra={"episode": {"key": unit.key, "status": row.status, "episode_id": row.id}},
    )
    return EpisodeOutcome(
        request=request,
        episode_id=row.id,
        attempt=row.attempt,
        status=cast(EpisodeStatus, row.status),  # the row was written from an EpisodeStatus
        status_record=status,
        artifacts=dict(row.artifacts or {}),
    )
