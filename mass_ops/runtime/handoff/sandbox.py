"""The sandbox's end of a pod's hand-off (`mass-ops episode run --handoff DIR`): no store, no credentials.

`SandboxHandoff` announces the units (request.json), waits for the publisher's ledger and returns the context the
pool runs in; on exit it writes complete.json with the run's exit status. `HandoffSink` hands each finished attempt
over and returns the outcome the publisher recorded; `HandoffProxySessions` asks the publisher for each attempt's
proxy session. Every wait ends when the publisher gives up or its heartbeat goes stale. Protocol: docs/handoff.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, load_task_catalogue
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.runtime.handoff.documents import (
    Ack,
    AttemptHandoff,
    Completion,
    HandoffRequest,
    HandoffUnit,
    Ledger,
    PublisherFailure,
    SessionClosed,
    SessionGrant,
)
from mass_ops.runtime.handoff.folder import (
    ATTEMPT_FILES,
    COMPLETE_FILE,
    DEFAULT_STALE_AFTER_S,
    DEFAULT_START_TIMEOUT_S,
    LEDGER_FILE,
    POLL_S,
    PROMPT_FILE,
    PUBLICATION_FILE,
    PUBLISHER_ALIVE,
    PUBLISHER_FAILED_FILE,
    REQUEST_FILE,
    SANDBOX_ALIVE,
    SESSIONS_DIR,
    Handoff,
    HandoffError,
    Heartbeat,
    wait_for,
)
from mass_ops.runtime.handoff.sandbox_stores import LedgerArtifacts, LedgerRepository
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.runner import (
    AttemptSession,
    EndpointUnreachableError,
    EpisodePreflightError,
    EpisodePublication,
    PublishAborted,
)
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import write_tarball

_Model = TypeVar("_Model", bound=BaseModel)


class SandboxHandoff:
    """The sandbox's end: announce the units, wait for the ledger, hand attempts over, and mark the end.

    Use as a context manager around the whole run: it keeps the heartbeat and, on exit, writes complete.json with
    the run's exit status (an exception's `exit_code`, as `typer.Exit` carries it, else 1; 0 without exception).
    """

    def __init__(
        self,
        root: Path,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        ack_timeout_s: float | None = None,
    ) -> None:
        self.handoff = Handoff(Path(root))
        self.start_timeout_s = start_timeout_s
        self.stale_after_s = stale_after_s
        self.ack_timeout_s = ack_timeout_s
        self.ledger: Ledger | None = None  # the publisher's answer to the announcement (`open`)
        self._heartbeat: Heartbeat | None = None

    def __enter__(self) -> SandboxHandoff:
        handoff = self.handoff
        used = [name for name in (REQUEST_FILE, COMPLETE_FILE) if handoff.path(name).exists()]
        if used:
            raise HandoffError(f"hand-off {handoff.root}: already used by another run ({used[0]} exists)")
        self._heartbeat = Heartbeat(handoff.path(SANDBOX_ALIVE)).__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        code = 0 if exc is None else getattr(exc, "exit_code", 1)
        # An exit with a status has said why already; anything else leaves its first line for the publisher's log.
        error = None if exc is None or hasattr(exc, "exit_code") else (str(exc).splitlines() or [repr(exc)])[0]
        try:
            self.handoff.write(self.handoff.path(COMPLETE_FILE), Completion(exit_code=code, error=error))
        finally:
            if self._heartbeat is not None:
                self._heartbeat.__exit__(None, None, None)

    def publisher_problem(self) -> str | None:
        """Why the publisher will not answer, or None while it may."""
        failed = self.handoff.path(PUBLISHER_FAILED_FILE)
        if failed.exists():
            with contextlib.suppress(HandoffError):
                return f"the publisher gave up: {self.handoff.read(failed, PublisherFailure).error}"
            return "the publisher gave up"
        age = self.handoff.age_s(PUBLISHER_ALIVE)
        if age is not None and age > self.stale_after_s:
            return f"the publisher stopped (no heartbeat for {age:.0f} s)"
        return None

    def await_prompt(self, path: Path) -> None:
        """Wait until the publisher has written `path` when it is the hand-off's prompt file (a prompt file elsewhere
        is the caller's own); HandoffError when the publisher gives up or stops first, or after the start timeout."""
        if Path(path).absolute() != self.handoff.path(PROMPT_FILE).absolute():
            return
        wait_for(
            lambda: True if path.is_file() else None,
            self.publisher_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {self.handoff.root}: waiting for the publisher's {PROMPT_FILE}",
        )

    def open(self, config: CycleConfig, requests: Sequence[EpisodeRequest]) -> CycleContext:
        """Announce `requests`, wait for the publisher's ledger, and return the context the pool runs in."""
        handoff = self.handoff
        announced = HandoffRequest(
            cycle=config.cycle_name,
            config_hash=config.config_hash(),
            units=[HandoffUnit.of_request(request) for request in requests],
        )
        handoff.write(handoff.path(REQUEST_FILE), announced)
        ledger_path = handoff.path(LEDGER_FILE)
        ledger = wait_for(
            lambda: handoff.read(ledger_path, Ledger) if ledger_path.exists() else None,
            self.publisher_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {handoff.root}: waiting for the publisher's ledger",
        )
        self.ledger = ledger
        if ledger.serving is not None:
            # A rollout runs on the server of the generation it evaluates; only the publisher can look it up.
            from mass_ops.serving import GenerationServer, serving_config

            config = serving_config(config, GenerationServer(**ledger.serving.model_dump()))
        statuses = {}
        for request in requests:
            for recorded in ledger.attempts.get(request.unit.slug, []):
                if recorded.status_record is not None:
                    unit = dataclasses.replace(request.unit, attempt=recorded.attempt)
                    statuses[unit.artifact_key("status")] = recorded.status_record
        return CycleContext(
            config=config,
            catalogue=load_task_catalogue(config),
            repo=cast(Any, LedgerRepository(config.cycle_name, ledger)),
            artifacts=cast(
                Any,
                LedgerArtifacts(
                    open_artifact_store(ledger.artifact_url), statuses, cycle=config.cycle_name, handoff=handoff
                ),
            ),
            cycle_id=ledger.cycle_id,
        )

    @property
    def sink(self) -> HandoffSink:
        return HandoffSink(self)

    @property
    def proxy_sessions(self) -> HandoffProxySessions | None:
        """Where the runner gets each attempt's proxy session when the publisher opens them (its ledger says so)."""
        if self.ledger is None or not self.ledger.proxy_sessions:
            return None
        return HandoffProxySessions(self)


class HandoffProxySessions:
    """The runner's proxy sessions in a pod (`runner.ProxySessions`): asked of the publisher in sessions/, never of
    the proxy, whose control socket this container cannot reach."""

    def __init__(self, session: SandboxHandoff, *, answer_timeout_s: float | None = None) -> None:
        self.session = session
        self.answer_timeout_s = answer_timeout_s
        self._tries = itertools.count(1)

    async def open(self, unit: EpisodeUnit) -> AttemptSession:
        """The session of attempt `unit.attempt`: `EndpointUnreachableError` when the publisher's preflight found the
        endpoint (or the proxy) not answering, `EpisodePreflightError` when it refused for good."""
        name = f"{unit.slug}-a{unit.attempt}-t{next(self._tries)}"
        grant = await self._ask(name, "open", f"{name}.session.json", SessionGrant)
        if grant.error is not None or not grant.proxy_url or not grant.token:
            error = grant.error or "the session answer is empty"
            raise (EndpointUnreachableError if grant.transient else EpisodePreflightError)(error)
        return AttemptSession(name=name, proxy_url=grant.proxy_url, token=grant.token)

    async def close(self, session: AttemptSession, api_log: Path) -> UsageTotals:
        """Have the publisher close `session`; its log (as the proxy wrote it) lands at `api_log`; returns the
        proxy's counts."""
        handoff = self.session.handoff
        closed = await self._ask(session.name, "close", f"{session.name}.closed.json", SessionClosed)
        if closed.error is not None:
            raise HandoffError(f"proxy session {session.name}: {closed.error}")
        copy = handoff.path(SESSIONS_DIR) / f"{session.name}.log"
        await asyncio.to_thread(_move_file, copy, api_log)
        return UsageTotals.from_mapping(closed.usage)

    async def _ask(self, name: str, ask: str, answer_name: str, model: type[_Model]) -> _Model:
        handoff = self.session.handoff
        answer = handoff.path(SESSIONS_DIR) / answer_name
        answer.unlink(missing_ok=True)  # an answer planted before the question is not the publisher's
        handoff.write_bytes(handoff.path(SESSIONS_DIR) / f"{name}.{ask}", b"")
        # As for an ack: the publisher may be busy publishing another unit's attempt; its heartbeat says it lives.
        limit = self.answer_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while not answer.exists():
            problem = self.session.publisher_problem()
            if problem is not None:
                raise HandoffError(f"proxy session {name}: {problem}")
            if deadline is not None and time.monotonic() >= deadline:
                raise HandoffError(f"proxy session {name}: no answer from the publisher after {limit:g} s")
            await asyncio.sleep(POLL_S)
        return handoff.read(answer, model)


def _move_file(source: Path, target: Path) -> None:
    """Copy `source` to `target` and remove `source` (they lie on different volumes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as inp, target.open("wb") as out:
        shutil.copyfileobj(inp, out, 1 << 20)
    source.unlink(missing_ok=True)


class HandoffSink:
    """A `PublicationSink` that hands each attempt to the publisher and returns the outcome it recorded."""

    def __init__(self, session: SandboxHandoff) -> None:
        self.session = session

    def deliver(self, publication: EpisodePublication, abort: threading.Event) -> EpisodeOutcome:
        handoff = self.session.handoff
        unit = publication.unit
        folder = handoff.attempt_dir(unit.slug, unit.attempt)
        if folder.exists():
            raise HandoffError(f"episode {unit.key}: attempt already handed over in {handoff.root}")
        staging = folder.with_name(f".{folder.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            self._write_files(publication, staging, abort)
            handoff.write(
                staging / PUBLICATION_FILE,
                AttemptHandoff(
                    unit=unit.slug, attempt=unit.attempt, record=publication.record, status=publication.status
                ),
            )
            os.rename(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # From here the attempt belongs to the publisher: it is published even if this run is cancelled now.
        ack_path = handoff.ack_path(unit.slug, unit.attempt)

        def problem() -> str | None:
            if abort.is_set():
                raise PublishAborted
            return self.session.publisher_problem()

        ack = wait_for(
            lambda: handoff.read(ack_path, Ack) if ack_path.exists() else None,
            problem,
            timeout_s=self.session.ack_timeout_s or float("inf"),
            what=f"episode {unit.key}: waiting for the publisher",
        )
        if ack.error is not None or ack.episode_id is None or ack.status is None:
            raise HandoffError(f"episode {unit.key}: the publisher could not publish it: {ack.error}")
        return EpisodeOutcome(
            request=publication.request,
            episode_id=ack.episode_id,
            attempt=ack.attempt,
            status=ack.status,
            status_record=ack.status_record or publication.status,
            artifacts=dict(ack.artifacts),
        )

    @staticmethod
    def _write_files(publication: EpisodePublication, folder: Path, abort: threading.Event) -> None:
        """The attempt's files in stored form: the workspace as the same deterministic tarball `put_dir` stores."""
        files = publication.files
        for name in ATTEMPT_FILES:
            if abort.is_set():
                raise PublishAborted
            target = folder / EPISODE_FILES[name]
            if name == "workspace" and not files.workspace_archived:
                with target.open("wb") as out:
                    write_tarball(files.workspace, out, skip_escaping_links=True)
            else:
                shutil.copyfile(getattr(files, name), target)
