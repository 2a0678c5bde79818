"""EpisodePool: the local `EpisodeExecutor` — many episodes at once within the endpoint's capacity, fair across tasks.

Contract: a unit's final attempt (`succeeded`, `model_failure`) is reused, never rerun (a different prompt is
`EpisodePromptConflictError`); otherwise its next attempt runs, infrastructure failures retried with backoff up to
`runtime.max_infra_attempts`. At most `inference.max_concurrent_requests` attempts use the endpoint at once, a freed
slot going to the longest remaining chain, then the task with the fewest running. Exhausted task or cycle budgets stop
new units and `run()` raises `BudgetStopError` after every started attempt is recorded. An interrupt of `run()` (or
`cancel()`) stops its attempts without writing rows. Capacity, budgets and cancellation in depth: docs/runtime.md
(`mass_ops.runtime.pool`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from mass_ops.compute.limits import EndpointSlots
from mass_ops.context import CycleContext
from mass_ops.critical_path import chain_priority, episode_phase
from mass_ops.errors import InfrastructureError, InputError
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, EpisodeStatus
from mass_ops.runtime.runner import EndpointUnreachableError, EpisodeRunner
from mass_ops.store.artifacts import ArtifactNotFoundError
from mass_ops.store.budgets import CYCLE_SCOPE, EPISODE_SCOPE, BudgetExhaustedError, Refusal
from mass_ops.store.schema import Episode

logger = logging.getLogger(__name__)

FINAL_STATUSES = frozenset({"succeeded", "model_failure"})
CANCEL_WAIT_S = 120.0


class EpisodePromptConflictError(InputError):
    """A unit already recorded with another prompt was requested again (a unit's prompt may never change)."""


class EpisodeBatchError(InfrastructureError):
    """Some requests of a `run()` raised instead of producing an outcome; `errors` maps unit keys to exceptions."""

    def __init__(self, errors: dict[str, BaseException], outcomes: list[EpisodeOutcome | None]) -> None:
        self.errors = errors
        self.outcomes = outcomes
        first_key, first = next(iter(errors.items()))
        super().__init__(
            f"{len(errors)} of {len(outcomes)} episode(s) could not run; first: {first_key}: {type(first).__name__}: "
            f"{first}"
        )


class BudgetStopError(BudgetExhaustedError):
    """A `run()` stopped because a budget is exhausted: `stopped` attempts ended `budget_exhausted`, `not_started`
    units were not run; `outcomes` are those that finished (None for the others, in request order)."""

    def __init__(
        self,
        refusal: Refusal,
        *,
        stopped: Sequence[str],
        not_started: Sequence[str],
        outcomes: list[EpisodeOutcome | None],
    ) -> None:
        self.stopped = list(stopped)
        self.not_started = list(not_started)
        self.outcomes = outcomes
        finished = sum(o is not None and o.status != "budget_exhausted" for o in outcomes)
        super().__init__(
            refusal,
            f"{len(self.stopped)} episode(s) stopped by their proxy, {len(self.not_started)} not started, "
            f"{finished} finished",
        )


class AttemptRunner(Protocol):
    """What the pool needs from a runner (`EpisodeRunner`; tests substitute light ones)."""

    async def preflight(self) -> Any: ...

    async def run_attempt(
        self,
        request: EpisodeRequest,
        attempt: int,
        *,
        retry_of_id: int | None = None,
        on_agent_exit: Callable[[], None] | None = None,
    ) -> EpisodeOutcome: ...


# queued → (started → finished [→ retrying])+ → done, per unit; or reused for a unit that was already final.
PoolEventKind = Literal["queued", "reused", "started", "finished", "retrying", "done"]


@dataclass(frozen=True)
class PoolEvent:
    """Progress of one unit, for displays and logs (callbacks run on the pool's loop thread: keep them quick)."""

    kind: PoolEventKind
    unit: EpisodeUnit
    attempt: int
    status: str | None = None
    duration_s: float | None = None


class FairScheduler:
    """`capacity` slots of the endpoint (`compute.limits.EndpointSlots`); waiting episodes are granted highest
    priority first, then per task, fewest running first, then fewest started."""

    def __init__(self, capacity: int) -> None:
        self.slots = EndpointSlots(capacity)
        self.running: collections.Counter[int] = collections.Counter()
        self.started: collections.Counter[int] = collections.Counter()
        self._waiting: dict[tuple[int, int], collections.deque[asyncio.Future[None]]] = {}  # (task, priority)
        self._arrival: dict[tuple[int, int], int] = {}

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def peak(self) -> int:
        return self.slots.peak

    @property
    def in_use(self) -> int:
        return self.slots.in_use

    async def acquire(self, task_id: int, priority: int = 0) -> None:
        """Wait for a slot for an episode of `task_id` with `priority` (`critical_path.chain_priority`; cancellable)."""
        if not any(self._waiting.values()) and self.slots.try_acquire():
            self._grant(task_id)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue_key = (task_id, priority)
        self._waiting.setdefault(queue_key, collections.deque()).append(future)
        self._arrival.setdefault(queue_key, len(self._arrival))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(task_id)  # granted just before the cancellation landed: give the slot back
            else:
                self._waiting[queue_key].remove(future)
            raise

    def release(self, task_id: int) -> None:
        self.running[task_id] -= 1
        self.slots.release()
        self._dispatch()

    def _grant(self, task_id: int) -> None:
        """Account a slot already taken from `slots` to `task_id`."""
        self.running[task_id] += 1
        self.started[task_id] += 1

    def _dispatch(self) -> None:
        while self.slots.free > 0:
            ready = [key for key, queue in self._waiting.items() if queue]
            if not ready:
                return
            task, priority = min(ready, key=lambda k: (-k[1], self.running[k[0]], self.started[k[0]], self._arrival[k]))
            future = self._waiting[(task, priority)].popleft()
            self.slots.try_acquire()
            self._grant(task)
            future.set_result(None)


@dataclass
class _Plan:
    """What to do for one request, decided from its recorded attempts."""

    request: EpisodeRequest
    reuse: Episode | None
    next_attempt: int
    previous_id: int | None


class EpisodePool:
    """Runs `EpisodeRequest`s through an `AttemptRunner` (default `EpisodeRunner`); see the module docstring.

    Use as a context manager or call `close()`; the loop thread starts with the first `run()`.
    """

    def __init__(
        self,
        ctx: CycleContext,
        *,
        runner: AttemptRunner | None = None,
        capacity: int | None = None,
        max_attempts: int | None = None,
        retry_backoff_s: float = 5.0,
        preflight_waits: int = 3,
        on_event: Callable[[PoolEvent], None] | None = None,
        **runner_options: Any,
    ) -> None:
        self.ctx = ctx
        self.runner: AttemptRunner = runner or EpisodeRunner(ctx, **runner_options)
        self.capacity = capacity or ctx.config.inference.max_concurrent_requests
        self.max_attempts = max_attempts or ctx.config.runtime.max_infra_attempts
        self.retry_backoff_s = retry_backoff_s
        self.preflight_waits = preflight_waits
        self.on_event = on_event
        self._scheduler: FairScheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._batches: set[asyncio.Task[Any]] = set()
        self._exhausted: dict[str, Refusal] = {}  # scope → why, as seen by this pool (task and cycle scopes)

    # -- lifecycle --

    def __enter__(self) -> EpisodePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel anything in flight and stop the loop thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        self._cancel_on(loop)

        async def drain() -> None:
            # As asyncio.run() does on exit: cancel what is left (e.g. server handlers of stopped proxies) and let
            # it unwind on a running loop, then stop the executor threads.
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await loop.shutdown_asyncgens()
            await loop.shutdown_default_executor()

        if loop.is_running():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=CANCEL_WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=CANCEL_WAIT_S)
        if not thread.is_alive():
            loop.close()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                # Publishing (tarballs, uploads), DB writes and the proxies' record writers share this executor.
                loop.set_default_executor(
                    concurrent.futures.ThreadPoolExecutor(max_workers=2 * self.capacity + 4, thread_name_prefix="ep")
                )
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name="episode-pool", daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
                self._scheduler = FairScheduler(self.capacity)
            return self._loop

    @property
    def peak_concurrency(self) -> int:
        """Most attempts that ever ran at once (for tests and benchmarks)."""
        return self._scheduler.peak if self._scheduler else 0

    # -- EpisodeExecutor --

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        """Run (or reuse) every request; outcomes in request order. See the module docstring for the rules."""
        requests = list(requests)
        if not requests:
            return []
        _check_distinct(requests)
        loop = self._ensure_loop()
        result: concurrent.futures.Future[list[EpisodeOutcome]] = concurrent.futures.Future()
        finished = threading.Event()
        started: list[asyncio.Task[list[EpisodeOutcome]]] = []

        def start() -> None:
            task = loop.create_task(self._batch(requests))
            self._batches.add(task)
            started.append(task)

            def done(task: asyncio.Task[list[EpisodeOutcome]]) -> None:
                self._batches.discard(task)
                if task.cancelled():
                    result.cancel()
                elif (error := task.exception()) is not None:
                    result.set_exception(error)
                else:
                    result.set_result(task.result())
                finished.set()  # also when cancelled before it ever ran

            task.add_done_callback(done)

        loop.call_soon_threadsafe(start)
        try:
            return result.result()
        except BaseException:
            if not finished.is_set():
                # Interrupted in this thread (Ctrl-C, SIGTERM handler, task kill): cancel our attempts and wait
                # until they have stopped their agents and cleaned up before letting the interruption through.
                # (Callbacks run in order, so `start` has run before this cancellation does.)
                loop.call_soon_threadsafe(lambda: started[0].cancel())
                finished.wait(timeout=CANCEL_WAIT_S)
            raise

    def cancel(self) -> None:
        """Cancel every `run()` in flight (thread-safe); they raise `concurrent.futures.CancelledError`."""
        with self._lock:
            loop = self._loop
        if loop is not None:
            self._cancel_on(loop)

    def _cancel_on(self, loop: asyncio.AbstractEventLoop) -> None:
        done = threading.Event()

        def cancel_all() -> None:
            batches = list(self._batches)
            for batch in batches:
                batch.cancel()

            async def settle() -> None:
                await asyncio.gather(*batches, return_exceptions=True)
                done.set()

            loop.create_task(settle())

        if loop.is_running():
            loop.call_soon_threadsafe(cancel_all)
            done.wait(timeout=CANCEL_WAIT_S)

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        """Extract the outcome's workspace tarball into `dest` (absent or empty) within the platform's archive
        limits (`store.untrusted.ARCHIVE_LIMITS`: `UnsafeArchiveError` beyond them, nothing extracted); returns
        `dest`."""
        unit = dataclasses.replace(outcome.request.unit, attempt=outcome.attempt)
        key = unit.artifact_key("workspace")
        recorded = outcome.artifacts.get("workspace")
        if recorded is not None and recorded != self.ctx.artifacts.uri(key):
            raise ValueError(
                f"episode {unit.key}: workspace {recorded} is not in the configured store {self.ctx.artifacts.url}"
            )
        self.ctx.artifacts.get_dir(key, dest)
        return dest

    # -- on the loop --

    async def _batch(self, requests: list[EpisodeRequest]) -> list[EpisodeOutcome]:
        plans = await asyncio.to_thread(self._plan, requests)
        if any(plan.reuse is None for plan in plans):
            await self._wait_for_endpoint()
        units = [asyncio.ensure_future(self._unit(plan)) for plan in plans]
        try:
            results = await asyncio.gather(*units, return_exceptions=True)
        except asyncio.CancelledError:
            for unit_task in units:
                unit_task.cancel()
            await asyncio.gather(*units, return_exceptions=True)
            raise
        errors = {
            plan.request.unit.key: result
            for plan, result in zip(plans, results, strict=True)
            if isinstance(result, BaseException)
        }
        outcomes = [None if isinstance(r, BaseException) else r for r in results]
        stopped = [o.request.unit.key for o in outcomes if o is not None and o.status == "budget_exhausted"]
        skipped = {key: error for key, error in errors.items() if isinstance(error, BudgetExhaustedError)}
        if stopped or skipped:
            if len(skipped) < len(errors):
                other = {key: error for key, error in errors.items() if key not in skipped}
                logger.error("episodes that failed besides the budget stop: %s", EpisodeBatchError(other, outcomes))
            raise BudgetStopError(
                self._first_refusal(outcomes, skipped), stopped=stopped, not_started=list(skipped), outcomes=outcomes
            )
        if errors:
            raise EpisodeBatchError(errors, outcomes)
        return [outcome for outcome in outcomes if outcome is not None]

    def _plan(self, requests: list[EpisodeRequest]) -> list[_Plan]:
        """Decide reuse / next attempt for every request from the database; refuse changed prompts up front."""
        plans = []
        conflicts = []
        for request in requests:
            unit = request.unit
            attempts = self.ctx.repo.episode_attempts(self.ctx.cycle_id, **unit.identity())
            stored = {a.prompt_sha256 for a in attempts if a.prompt_sha256}
            if stored and stored != {request.prompt_sha256}:
                conflicts.append(
                    f"episode {unit.cycle}/{unit.slug}: recorded with prompt sha256 {sorted(stored)[0][:12]}…, "
                    f"requested with {request.prompt_sha256[:12]}… (a unit's prompt may not change; use a new cycle)"
                )
                continue
            final = next((a for a in reversed(attempts) if a.status in FINAL_STATUSES), None)
            last = attempts[-1] if attempts else None
            plans.append(
                _Plan(
                    request=request,
                    reuse=final,
                    next_attempt=(last.attempt + 1) if last else 1,
                    previous_id=last.id if last else None,
                )
            )
        if conflicts:
            raise EpisodePromptConflictError("; ".join(conflicts))
        return plans

    async def _wait_for_endpoint(self) -> None:
        """One preflight per batch: a missing model or key fails fast; an unreachable endpoint is waited for."""
        for wait in range(self.preflight_waits + 1):
            try:
                await self.runner.preflight()
                return
            except EndpointUnreachableError as exc:
                if wait == self.preflight_waits:
                    raise
                delay = self.retry_backoff_s * 2**wait
                logger.warning("%s; waiting %.1f s for the endpoint", exc, delay)
                await asyncio.sleep(delay)

    async def _unit(self, plan: _Plan) -> EpisodeOutcome:
        request = plan.request
        if plan.reuse is not None:
            reused = await asyncio.to_thread(self._reused, request, plan.reuse)
            self._emit(PoolEvent("reused", request.unit, reused.attempt, reused.status))
            return reused
        assert self._scheduler is not None
        attempt, previous = plan.next_attempt, plan.previous_id
        self._emit(PoolEvent("queued", request.unit, attempt))
        outcome: EpisodeOutcome | None = None
        for tries in range(self.max_attempts):
            outcome = await self._attempt(request, attempt, previous)
            if outcome.status != "infra_failure":
                break
            previous, attempt = outcome.episode_id, attempt + 1
            if tries + 1 < self.max_attempts:
                delay = self.retry_backoff_s * 2**tries
                logger.warning(
                    "episode %s attempt %d: infrastructure failure (%s); retrying as attempt %d in %.1f s",
                    request.unit.slug,
                    outcome.attempt,
                    (outcome.status_record.get("failure") or {}).get("message"),
                    attempt,
                    delay,
                )
                self._emit(PoolEvent("retrying", request.unit, attempt, outcome.status))
                await asyncio.sleep(delay)
        assert outcome is not None
        self._emit(PoolEvent("done", request.unit, outcome.attempt, outcome.status))
        return outcome

    async def _attempt(self, request: EpisodeRequest, attempt: int, previous: int | None) -> EpisodeOutcome:
        """One attempt inside a capacity slot; an endpoint that vanished before the agent started is waited for
        (nothing was created, so no attempt number is used up). A unit whose task or cycle budget is exhausted is
        not started (`BudgetExhaustedError`)."""
        assert self._scheduler is not None
        unit = request.unit
        task_id = unit.task_id
        scheduler = self._scheduler
        priority = chain_priority(episode_phase(unit.kind), unit.version, self.ctx.config.search.iterations)
        for wait in range(self.preflight_waits + 1):
            await scheduler.acquire(task_id, priority)
            release = _releaser(scheduler, task_id)
            started = time.monotonic()
            try:
                refused = await self._budget_refusal(request.unit)
                if refused is not None:
                    self._emit(PoolEvent("done", request.unit, attempt, "budget_exhausted"))
                    raise BudgetExhaustedError(refused, f"episode {request.unit.slug} not started")
                self._emit(PoolEvent("started", request.unit, attempt))
                # Under a task or cycle budget the slot is kept until the outcome is noted, publishing included: an
                # attempt its budget stopped must be known before the next admission check, or a unit of the spent
                # scope could start in the gap between the agent's exit and the noted outcome.
                early_release = None if self._budgeted(request.unit) else release
                outcome = await self.runner.run_attempt(
                    request, attempt, retry_of_id=previous, on_agent_exit=early_release
                )
                self._note_budget(outcome)
            except EndpointUnreachableError as exc:
                if wait == self.preflight_waits:
                    raise
                logger.warning("episode %s: %s; waiting for the endpoint", request.unit.slug, exc)
            else:
                self._emit(
                    PoolEvent("finished", request.unit, outcome.attempt, outcome.status, time.monotonic() - started)
                )
                return outcome
            finally:
                release()
            await asyncio.sleep(self.retry_backoff_s * 2**wait)
        raise AssertionError("unreachable")

    def _budgeted(self, unit: EpisodeUnit) -> bool:
        """Whether a task or cycle budget limits `unit` (one an attempt of it could exhaust)."""
        scopes_of = getattr(self.runner, "budget_scopes", None)
        ledger = getattr(self.runner, "budgets", None)
        return scopes_of is not None and ledger is not None and bool(ledger.limits.limited(scopes_of(unit)))

    async def _budget_refusal(self, unit: EpisodeUnit) -> Refusal | None:
        """Why `unit` may not start: its task's or the cycle's budget is exhausted (seen here, or in the ledger)."""
        scopes_of = getattr(self.runner, "budget_scopes", None)
        ledger = getattr(self.runner, "budgets", None)
        if scopes_of is None:
            return None
        scopes = scopes_of(unit)
        for scope in scopes:
            if scope in self._exhausted:
                return self._exhausted[scope]
        if ledger is None or not ledger.limits.limited(scopes):
            return None
        refused: Refusal | None = await asyncio.to_thread(ledger.exhausted, scopes)
        if refused is not None:
            self._exhausted[refused.scope] = refused
        return refused

    def _note_budget(self, outcome: EpisodeOutcome) -> None:
        """Remember a task or cycle budget that stopped an attempt: that scope's other units will not start."""
        if outcome.status != "budget_exhausted":
            return
        refused = _refusal_of(outcome)
        if refused is not None and refused.scope != EPISODE_SCOPE:
            self._exhausted.setdefault(refused.scope, refused)
            if refused.scope == CYCLE_SCOPE:
                logger.warning("cycle budget exhausted: no further episode starts (%s)", refused.message)

    def _first_refusal(
        self, outcomes: Sequence[EpisodeOutcome | None], skipped: Mapping[str, BaseException]
    ) -> Refusal:
        for error in skipped.values():
            if isinstance(error, BudgetExhaustedError):
                return error.refusal
        for outcome in outcomes:
            if outcome is not None and (refused := _refusal_of(outcome)) is not None:
                return refused
        raise AssertionError("a budget stop without a refusal")

    def _reused(self, request: EpisodeRequest, row: Episode) -> EpisodeOutcome:
        unit = dataclasses.replace(request.unit, attempt=row.attempt)
        try:
            status = self.ctx.artifacts.get_json(unit.artifact_key("status"))
        except ArtifactNotFoundError:
            raise ArtifactNotFoundError(
                f"episode {unit.key} is recorded as {row.status} but its status artifact "
                f"{self.ctx.artifacts.uri(unit.artifact_key('status'))} is missing"
            ) from None
        return EpisodeOutcome(
            request=request,
            episode_id=row.id,
            attempt=row.attempt,
            status=cast(EpisodeStatus, row.status),  # one of FINAL_STATUSES
            status_record=status,
            artifacts=dict(row.artifacts or {}),
            reused=True,
        )

    def _emit(self, event: PoolEvent) -> None:
        logger.info(
            "episode %s attempt %d %s%s",
            event.unit.slug,
            event.attempt,
            event.kind,
            f" {event.status}" if event.status else "",
            extra={"episode_event": dataclasses.asdict(event) | {"unit": event.unit.key}},
        )
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a broken display must not break episodes
                logger.exception("episode pool event callback failed")


def _refusal_of(outcome: EpisodeOutcome) -> Refusal | None:
    """The budget that stopped a `budget_exhausted` attempt, from its failure document."""
    budget = (outcome.status_record.get("failure") or {}).get("budget")
    if not isinstance(budget, dict):
        return None
    try:
        return Refusal(**{name: budget[name] for name in Refusal.__dataclass_fields__})
    except (KeyError, TypeError):
        return None


def _releaser(scheduler: FairScheduler, task_id: int) -> Callable[[], None]:
    """Release of one granted slot that may be called more than once (agent exit, then the attempt's end)."""
    held = True

    def release() -> None:
        nonlocal held
        if held:
            held = False
            scheduler.release(task_id)

    return release


def _check_distinct(requests: Sequence[EpisodeRequest]) -> None:
    seen: dict[tuple[Any, ...], EpisodeRequest] = {}
    for request in requests:
        unit = request.unit
        identity = (unit.cycle, unit.task_id, unit.kind, unit.seed, unit.version, unit.candidate, request.generation)
        if identity in seen:
            raise ValueError(f"episode {unit.cycle}/{unit.slug} is requested twice in one run()")
        seen[identity] = request
