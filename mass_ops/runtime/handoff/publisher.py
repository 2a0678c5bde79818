"""The publisher's end of a pod's hand-off (`mass-ops episode publish --handoff DIR`): it holds the store credentials.

`HandoffPublisher.run()` delivers the seed and the prompt, captures the sandbox's request, answers with the ledger,
then publishes each handed-over attempt with the runner's own `publish_episode` (artifacts first, the row last),
acknowledges it, ends its lease and charges its spend, until complete.json is there and nothing is left. Identity,
keys and the prompt's hash come from the request as read before any agent ran; every attempt file is opened once,
below the folder, following no link. Everything it writes to the folder is scrubbed of its credentials. Protocol and
trust model: docs/handoff.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from mass_ops.compute.kubernetes import EpisodeServer
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import first_line
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, WorkspaceSeed
from mass_ops.runtime.handoff.delivery import PromptDelivery, deliver_prompt, deliver_seed
from mass_ops.runtime.handoff.documents import (
    Ack,
    AttemptHandoff,
    HandoffRequest,
    HandoffUnit,
    Ledger,
    PublisherFailure,
    RecordedAttempt,
    ScopeSpend,
    ServingTarget,
)
from mass_ops.runtime.handoff.folder import (
    ATTEMPT_FILES,
    COMPLETE_FILE,
    DEFAULT_STALE_AFTER_S,
    DEFAULT_START_TIMEOUT_S,
    LEDGER_FILE,
    POLL_S,
    PROMPT_FILE,
    PROMPT_MAX_BYTES,
    PUBLICATION_FILE,
    PUBLISHER_ALIVE,
    PUBLISHER_FAILED_FILE,
    REQUEST_FILE,
    SANDBOX_ALIVE,
    Handoff,
    HandoffError,
    Heartbeat,
    IncompleteHandoffError,
    wait_for,
)
from mass_ops.runtime.handoff.proxy_sessions import PodProxy, PublisherSessions, with_proxy_counts
from mass_ops.runtime.handoff.spend import charge_attempt
from mass_ops.runtime.runner import AttemptFiles, EpisodePublication, publish_episode
from mass_ops.store.budgets import episode_scopes
from mass_ops.store.untrusted import UntrustedInputError, open_beneath

logger = logging.getLogger(__name__)

# The publisher's credentials: never in what it writes to the folder, which the agent's container can read.
CREDENTIAL_ENV = ("MASS_METADATA_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
MIN_SCRUBBED = 4  # shorter values would also hit ordinary words


class HandoffPublisher:
    """The publisher's end: capture the request, answer with the ledger, open and close each attempt's session on the
    pod's proxy (given `proxy`), publish each attempt, acknowledge it.

    `run()` returns 0 when every handed-over attempt was published, 1 when any could not be (each error is in its
    ack and the log); it raises `IncompleteHandoffError` for a hand-off that ended without its marker or holds
    something invalid, and `HandoffError` when the cycle cannot be reached. Either way publisher-failed.json tells
    a sandbox that still waits.
    """

    def __init__(
        self,
        config: CycleConfig,
        root: Path,
        *,
        attach: Callable[[CycleConfig], CycleContext] | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        on_outcome: Callable[[EpisodeOutcome], None] | None = None,
        environ: Mapping[str, str] | None = None,
        prompt: PromptDelivery | None = None,
        workspace_seed: WorkspaceSeed | None = None,
        proxy: PodProxy | None = None,
        server: EpisodeServer | None = None,
    ) -> None:
        self.config = config
        self.handoff = Handoff(Path(root))
        self.prompt = prompt
        self.workspace_seed = workspace_seed
        self.proxy = proxy
        self.server = server  # a benchmark episode's server (`--endpoint --served-name`), as the pod spec names it
        self._private: Path | None = None  # the publisher's own scratch (not in the hand-off): logs it publishes
        self.attach = attach
        self.start_timeout_s = start_timeout_s
        self.stale_after_s = stale_after_s
        self.on_outcome = on_outcome
        self.failures = 0
        env = os.environ if environ is None else environ
        values = [env.get(name, "") for name in CREDENTIAL_ENV] + [config.storage.metadata_url]
        values += [urlsplit(value).password or "" for value in values if "://" in value]
        # Longest first, so a URL goes whole before its password would cut it.
        self._secrets = sorted({v for v in values if len(v) >= MIN_SCRUBBED}, key=len, reverse=True)
        # the attempts' sessions on the pod's proxy, opened only by this side (`PublisherSessions`)
        self.sessions = (
            None
            if proxy is None
            else PublisherSessions(proxy, self.handoff, config, server=server, scrubbed=self.scrubbed)
        )

    def scrubbed(self, message: str) -> str:
        """`message` without any of the publisher's credentials (it goes where the agent can read)."""
        for secret in self._secrets:
            message = message.replace(secret, "[REDACTED]")
        return message

    def run(self) -> int:
        handoff = self.handoff
        handoff.root.mkdir(parents=True, exist_ok=True)
        try:
            with Heartbeat(handoff.path(PUBLISHER_ALIVE)), self._scratch():
                ctx = None
                if self.workspace_seed is not None:
                    # Before the prompt: the sandbox starts once prompt.txt is there, and finds its seed beside it.
                    ctx = self._attach()
                    deliver_seed(ctx, handoff, self.workspace_seed)
                if self.prompt is not None:
                    ctx = ctx or self._attach()
                    deliver_prompt(ctx, handoff, self.prompt)
                request = self._await_request()
                if request is None:
                    logger.info("hand-off %s: the episode container ended before announcing a unit", handoff.root)
                    return 0
                ctx = ctx or self._attach()
                ledger = self._ledger(ctx, request)
                handoff.write(handoff.path(LEDGER_FILE), ledger)
                self._serve(ctx, request, ledger)
        except HandoffError as exc:
            handoff.write(handoff.path(PUBLISHER_FAILED_FILE), PublisherFailure(error=self.scrubbed(str(exc))))
            raise
        except BaseException as exc:
            message = self.scrubbed(first_line(exc))
            handoff.write(
                handoff.path(PUBLISHER_FAILED_FILE), PublisherFailure(error=f"{type(exc).__name__}: {message}")
            )
            raise
        return 1 if self.failures else 0

    @contextlib.contextmanager
    def _scratch(self) -> Any:
        """The publisher's private folder for the run (under its own TMPDIR), removed at the end."""
        self._private = Path(tempfile.mkdtemp(prefix="mass-publisher-"))
        try:
            yield
        finally:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    # -- steps --

    def _sandbox_problem(self) -> str | None:
        age = self.handoff.age_s(SANDBOX_ALIVE)
        if age is not None and age > self.stale_after_s:
            return f"the episode container stopped (no heartbeat for {age:.0f} s)"
        return None

    def _await_request(self) -> HandoffRequest | None:
        """The announced units; None when the run ended without announcing any (it refused its input)."""
        path, complete = self.handoff.path(REQUEST_FILE), self.handoff.path(COMPLETE_FILE)

        def found() -> HandoffRequest | Literal[False] | None:
            if path.exists():
                return self.handoff.read(path, HandoffRequest)
            return False if complete.exists() else None

        request: HandoffRequest | Literal[False] = wait_for(
            found,
            self._sandbox_problem,
            timeout_s=self.start_timeout_s,
            what=f"hand-off {self.handoff.root}: waiting for the episode container's request",
        )
        if request is False:
            return None
        if request.cycle != self.config.cycle_name or request.config_hash != self.config.config_hash():
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: the episode container runs cycle {request.cycle!r} with config "
                f"{request.config_hash[:12]}…, this publisher has cycle {self.config.cycle_name!r} with config "
                f"{self.config.config_hash()[:12]}… (both must read the same config)"
            )
        slugs = [unit.unit(request.cycle).slug for unit in request.units]
        if len(set(slugs)) != len(slugs):
            raise IncompleteHandoffError(f"hand-off {self.handoff.root}: request.json names a unit twice")
        delivered = None if self.workspace_seed is None else self.workspace_seed.sha256
        for unit, slug in zip(request.units, slugs, strict=True):
            if unit.workspace_seed_sha256 != delivered:
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root}: request.json announces {slug} with workspace seed "
                    f"{(unit.workspace_seed_sha256 or 'none')[:12]}, not the seed this publisher delivered "
                    f"({(delivered or 'none')[:12]})"
                )
        if self.prompt is not None:
            for unit, slug in zip(request.units, slugs, strict=True):
                if unit.prompt_sha256 != self.prompt.sha256:
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root}: request.json announces {slug} with prompt "
                        f"{unit.prompt_sha256[:12]}…, not the prompt {self.prompt.sha256[:12]}… this publisher "
                        f"delivered in {PROMPT_FILE}"
                    )
        return request

    def _attach(self) -> CycleContext:
        if self.attach is not None:
            return self.attach(self.config)
        from mass_ops.context import attach_cycle

        return attach_cycle(self.config)

    def _ledger(self, ctx: CycleContext, request: HandoffRequest) -> Ledger:
        attempts: dict[str, list[RecordedAttempt]] = {}
        for announced in request.units:
            unit = announced.unit(request.cycle)
            rows = ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity())
            final = next((row for row in reversed(rows) if row.status in ("succeeded", "model_failure")), None)
            status_record = None
            if final is not None:
                key = dataclasses.replace(unit, attempt=final.attempt).artifact_key("status")
                status_record = ctx.artifacts.get_json(key)
            attempts[unit.slug] = [
                RecordedAttempt(
                    id=row.id,
                    attempt=row.attempt,
                    status=row.status,
                    prompt_sha256=row.prompt_sha256,
                    artifacts=dict(row.artifacts or {}),
                    status_record=status_record if row is final else None,
                )
                for row in rows
            ]
        scopes = {scope for announced in request.units for scope in episode_scopes(announced.task_id)}
        spend = ctx.repo.budget_spend(ctx.cycle_id, sorted(scopes))
        return Ledger(
            cycle_id=ctx.cycle_id,
            artifact_url=ctx.artifacts.url,
            serving=self._serving(ctx, request),
            proxy_sessions=self.proxy is not None,
            attempts=attempts,
            budget_spend={
                scope: ScopeSpend(
                    tokens=row.tokens, cost_usd=row.cost_usd, requests=row.requests, refused_need=row.refused_need
                )
                for scope, row in spend.items()
            },
        )

    @staticmethod
    def _serving(ctx: CycleContext, request: HandoffRequest) -> ServingTarget | None:
        generations = {unit.generation for unit in request.units if unit.kind == "rollout" and unit.generation}
        if not generations:
            return None
        if len(generations) > 1:
            raise IncompleteHandoffError(f"request.json: rollouts of several generations {sorted(generations)}")
        from mass_ops.serving import evaluation_scope, generation_server

        server = generation_server(ctx, generations.pop(), evaluation_scope(ctx.config))
        return ServingTarget(**server.as_dict())

    def _serve(self, ctx: CycleContext, request: HandoffRequest, ledger: Ledger) -> None:
        """Publish attempts as they come until the marker is there and nothing is left, or the sandbox stopped."""
        units = {announced.unit(request.cycle).slug: announced for announced in request.units}
        expected = {slug: (ledger.attempts[slug][-1].attempt + 1 if ledger.attempts[slug] else 1) for slug in units}
        try:
            self._serve_until_complete(ctx, request, ledger, units, expected)
        finally:
            # The sandbox has ended: no attempt of its units runs any more, whether it was handed over or not.
            if self.sessions is not None:
                self.sessions.close_unrecorded(ctx, request.cycle, units)
            for slug, announced in units.items():
                self._end_lease(ctx, announced.unit(request.cycle, expected[slug]))

    def _serve_until_complete(
        self,
        ctx: CycleContext,
        request: HandoffRequest,
        ledger: Ledger,
        units: dict[str, HandoffUnit],
        expected: dict[str, int],
    ) -> None:
        complete = self.handoff.path(COMPLETE_FILE)
        while True:
            finished = complete.exists()  # read before the scan: what came before the marker is on disk now
            if self.sessions is not None:
                self.sessions.answer_asks(ledger, units, expected)
            for slug, announced in units.items():
                while self.handoff.attempt_dir(slug, expected[slug]).exists():
                    self._publish(ctx, request.cycle, announced, expected[slug])
                    expected[slug] += 1
            if finished:
                self._check_leftovers(units, expected)
                return
            stopped = self._sandbox_problem()
            if stopped is not None:
                self._check_leftovers(units, expected)
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root} is incomplete: {stopped} before writing {COMPLETE_FILE}; "
                    "what it handed over is published, nothing else"
                )
            time.sleep(POLL_S)

    def _check_leftovers(self, units: dict[str, HandoffUnit], expected: dict[str, int]) -> None:
        """Refuse what lies in attempts/ but was never completed, or does not belong to an announced unit."""
        attempts_root = self.handoff.root / "attempts"
        if not attempts_root.is_dir():
            return
        for unit_dir in sorted(attempts_root.iterdir()):
            slug = unit_dir.name
            for entry in sorted(unit_dir.iterdir()) if unit_dir.is_dir() else [unit_dir]:
                name = entry.name
                if slug in units and name.startswith(".") and name.endswith(".partial"):
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root} is incomplete: attempt {name[1:].removesuffix('.partial')} "
                        f"of {slug} was never finished (no {PUBLICATION_FILE}); nothing of it was published"
                    )
                known = slug in units and name.startswith("a") and name[1:].isdigit() and int(name[1:]) < expected[slug]
                if not known:
                    raise IncompleteHandoffError(
                        f"hand-off {self.handoff.root}: attempts/{slug}/{name} is not an attempt the episode "
                        "container announced in order; it was not published"
                    )

    def _publish(self, ctx: CycleContext, cycle: str, announced: HandoffUnit, attempt: int) -> None:
        unit = announced.unit(cycle, attempt)
        ack_path = self.handoff.ack_path(unit.slug, attempt)
        # Every file of the attempt stays open from its check until it is uploaded and charged (no check-then-use).
        with contextlib.ExitStack() as held:
            try:
                publication = self._publication(ctx, announced, unit, held)
                outcome = publish_episode(ctx, publication)
            except IncompleteHandoffError:
                raise
            except Exception as exc:
                self._end_lease(ctx, unit)  # the attempt has ended, recorded or not
                self.failures += 1
                message = self.scrubbed(first_line(exc))
                error = f"{type(exc).__name__}: {message}"
                logger.error("episode %s: publishing failed: %s", unit.key, error)
                self.handoff.write(ack_path, Ack(unit=unit.slug, attempt=attempt, error=error))
                return
            self.handoff.write(
                ack_path,
                Ack(
                    unit=unit.slug,
                    attempt=attempt,
                    episode_id=outcome.episode_id,
                    status=outcome.status,
                    artifacts=outcome.artifacts,
                    status_record=outcome.status_record,
                ),
            )
            self._end_lease(ctx, unit)  # its row is recorded: the operator's lease of the pod's attempt ends
            # once per attempt, whichever ingest gets here first
            charge_attempt(ctx, publication, outcome.episode_id, self.scrubbed)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _end_lease(self, ctx: CycleContext, unit: EpisodeUnit) -> None:
        """End the unit's lease of attempt `unit.attempt` or earlier (`status` stops showing it running); a failure
        is logged, never fatal: a lease left behind goes stale on its own."""
        try:
            ctx.repo.end_episode_lease(ctx.cycle_id, attempt=unit.attempt, **unit.identity())
        except Exception as exc:
            message = self.scrubbed(first_line(exc))
            logger.warning("episode %s: could not end its lease: %s: %s", unit.key, type(exc).__name__, message)

    def _publication(
        self, ctx: CycleContext, announced: HandoffUnit, unit: EpisodeUnit, held: contextlib.ExitStack
    ) -> EpisodePublication:
        """The attempt as the runner built it, with identity and keys from the request, files from the folder (each
        opened once and held in `held`), and — with a pod proxy — the proxy's own log and counts."""
        folder = self.handoff.attempt_dir(unit.slug, unit.attempt)
        document = self.handoff.read(folder / PUBLICATION_FILE, AttemptHandoff)
        if (document.unit, document.attempt) != (unit.slug, unit.attempt):
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: {folder.name} of {unit.slug} describes {document.unit} attempt "
                f"{document.attempt}"
            )
        paths: dict[str, Path] = {}
        descriptors: dict[str, int] = {}
        for name in ATTEMPT_FILES:
            relative = folder.relative_to(self.handoff.root) / EPISODE_FILES[name]
            try:
                descriptors[name] = held.enter_context(open_beneath(self.handoff.root, relative))
            except (FileNotFoundError, UntrustedInputError):
                raise IncompleteHandoffError(
                    f"hand-off {self.handoff.root}: {unit.slug}/a{unit.attempt}/{relative.name} is missing or not a "
                    "regular file of its own (a link, or a file with other hard links)"
                ) from None
            # The store reads the checked descriptor's file through its /proc name: that opens the very file held
            # here, whatever the folder's name points at by then.
            paths[name] = Path(f"/proc/self/fd/{descriptors[name]}")
        prompt = _read_descriptor(descriptors["prompt"], PROMPT_MAX_BYTES)
        if prompt is None or hashlib.sha256(prompt).hexdigest() != announced.prompt_sha256:
            raise IncompleteHandoffError(
                f"hand-off {self.handoff.root}: the prompt of {unit.slug}/a{unit.attempt} differs from the one "
                "announced before the episode started"
            )
        record, status = document.record, document.status
        if self.sessions is not None:
            assert self._private is not None  # set for the run (`_scratch`)
            closed, log = self.sessions.attempt_log(unit, self._private)
            paths["api_log"] = log
            record, status = with_proxy_counts(record, status, closed)
        request = EpisodeRequest(unit=announced.unit(unit.cycle), condition=announced.condition, prompt=prompt.decode())
        previous = [
            row for row in ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity()) if row.attempt == unit.attempt - 1
        ]
        return EpisodePublication(
            request=request,
            unit=unit,
            files=AttemptFiles(workspace_archived=True, **paths),
            status=status,
            record=record,
            retry_of_id=previous[0].id if previous else None,
        )


def _read_descriptor(fd: int, max_bytes: int) -> bytes | None:
    """The whole file behind `fd` from its start (None when over `max_bytes`), leaving its offset alone."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.pread(fd, 1 << 20, total):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            return None
    return b"".join(chunks)
