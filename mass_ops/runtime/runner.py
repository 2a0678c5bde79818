"""One attempt of one episode: preflight, attempt folder, logging proxy, qwen-code under limits, then the row.

`EpisodeRunner.run_attempt(request, attempt)` is the unit of work below the pool (MASS_SPEC §4). It orchestrates the
steps, each of which lives in its own module: `preflight` (key and endpoint), `attempt_folder` and `workspace_seed`
(the private folder and its seeded workspace), the episode's logging proxy (`proxy.LoggingProxy` in this process, or
an `attempt_session` of a pod's proxy), `agent_environment` and `agent_process` (the agent, its limits and the end
of all it started), `redaction` and `publication` (what the attempt publishes) and `publishing` (the sink: artifacts
first, the row last). From the agent's start until its row is recorded the attempt holds its unit's lease. A
cancelled attempt stops the agent and the proxy, publishes and records nothing, and removes its folder.

The step-by-step contract is in docs/runtime.md. The names the steps' modules define are re-exported here, for the
importers that know them as `mass_ops.runtime.runner.X`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from mass_ops.compute.egress import EGRESS_SOCKET_NAME, EgressProxy
from mass_ops.compute.sandbox import (
    bwrap_support,
    create_socket_dir,
    proxy_socket_dir,
    proxy_url_in_sandbox,
    remove_socket_dir,
)
from mass_ops.context import CycleContext
from mass_ops.critical_path import episode_server_priority
from mass_ops.errors import first_line
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.agent_environment import (
    LOCAL_HOSTS,
    OPENMM_THREADS_VAR,
    SANDBOX_ENV,
    SCOPE_ENV,
    THREAD_LIMIT_VARS,
    agent_environment,
    environment_policy,
)
from mass_ops.runtime.agent_process import AgentRun, agent_argv, kill_scope, run_agent
from mass_ops.runtime.attempt_folder import (
    AttemptPaths,
    EpisodeBusyError,
    fresh_attempt_folder,
    lock_attempt,
    remove_tree,
)
from mass_ops.runtime.attempt_session import AttemptSession, ProxySessions
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, WorkspaceSeed
from mass_ops.runtime.outcome import EXECUTION_MODE, UsageCounter
from mass_ops.runtime.preflight import (
    MODEL_LIST_MAX_BYTES,
    PREFLIGHT_TIMEOUT_S,
    EndpointUnreachableError,
    EpisodePreflightError,
    ModelNotListedError,
    check_endpoint,
    discovery_model_id,
    resolve_api_key,
    split_endpoint,
)
from mass_ops.runtime.proxy import DEFAULT_KEY_VALUE, EpisodeBudget, LoggingProxy, new_agent_token
from mass_ops.runtime.publication import (
    AttemptFiles,
    EpisodePublication,
    EpisodeRecord,
    FinishedAttempt,
    assemble_publication,
    redact_attempt,
)

# Looked up here at each attempt (tests inject records through `runner._read_proxy_log`); the hand-off imports it too.
from mass_ops.runtime.publication import read_proxy_log as _read_proxy_log
from mass_ops.runtime.publishing import (
    PUBLISH_ORDER,
    PublicationSink,
    PublishAborted,
    StoreSink,
    publish_artifacts,
    publish_episode,
    record_publication,
)
from mass_ops.runtime.qwen_install import QwenInstall, ensure_qwen_code
from mass_ops.runtime.redaction import SecretRedactor
from mass_ops.runtime.settings import qwen_settings, write_settings
from mass_ops.runtime.workspace_seed import WorkspaceSeedError, extract_workspace_seed, fetch_workspace_seed
from mass_ops.store.budgets import CYCLE_SCOPE, BudgetLedger, BudgetLimits, task_scope
from mass_ops.store.schema import LEASE_RENEW_S

__all__ = [
    "LOCAL_HOSTS",
    "MODEL_LIST_MAX_BYTES",
    "OPENMM_THREADS_VAR",
    "PREFLIGHT_TIMEOUT_S",
    "PUBLISH_ORDER",
    "SANDBOX_ENV",
    "SCOPE_ENV",
    "SCRATCH_ENV",
    "THREAD_LIMIT_VARS",
    "AgentRun",
    "AttemptFiles",
    "AttemptPaths",
    "AttemptSession",
    "EndpointUnreachableError",
    "EpisodeBusyError",
    "EpisodePreflightError",
    "EpisodePublication",
    "EpisodeRecord",
    "EpisodeRunner",
    "ModelNotListedError",
    "ProxySessions",
    "PublicationSink",
    "PublishAborted",
    "SecretRedactor",
    "StoreSink",
    "WorkspaceSeedError",
    "_read_proxy_log",
    "agent_environment",
    "check_endpoint",
    "discovery_model_id",
    "environment_policy",
    "extract_workspace_seed",
    "fetch_workspace_seed",
    "kill_scope",
    "lease_host",
    "publish_artifacts",
    "publish_episode",
    "record_publication",
    "resolve_api_key",
]

logger = logging.getLogger(__name__)

SCRATCH_ENV = "MASS_EPISODE_SCRATCH_DIR"


def lease_host() -> str:
    """Where a local attempt runs, as its lease names it (`status`: "started 3m ago on <host> pid <pid>")."""
    return f"{socket.gethostname()} pid {os.getpid()}"


class EpisodeRunner:
    """Runs single attempts of episode units of one cycle (docs/runtime.md). Safe to share between tasks."""

    def __init__(
        self,
        ctx: CycleContext,
        *,
        install: QwenInstall | None = None,
        scratch_dir: Path | str | None = None,
        environ: Mapping[str, str] | None = None,
        keep_scratch: bool = False,
        kill_grace_s: float = 5.0,
        execution_mode: str = EXECUTION_MODE,
        sink: PublicationSink | None = None,
        lease_renew_s: float = LEASE_RENEW_S,
        proxy_sessions: ProxySessions | None = None,
    ) -> None:
        self.ctx = ctx
        self.lease_renew_s = lease_renew_s  # how often a running attempt renews its lease (`status`: alive)
        self.sink: PublicationSink = sink or StoreSink(ctx)
        self.config = ctx.config
        self._install = install  # resolved on first use: a pool that only reuses finished units needs no agent
        configured = scratch_dir or os.environ.get(SCRATCH_ENV)
        self.scratch_dir = Path(configured) if configured else Path(tempfile.gettempdir()) / "mass-episodes"
        self.environ = dict(os.environ if environ is None else environ)
        self.keep_scratch = keep_scratch
        self.kill_grace_s = kill_grace_s
        self.execution_mode = execution_mode
        self._install_lock = threading.Lock()
        self._warned_unsandboxed = False
        # In a Kubernetes episode pod the proxy (and the key) live in another container, and only the publisher
        # reaches its control: it opens each attempt's session (`mass_ops.runtime.handoff`).
        self.proxy_sessions = proxy_sessions
        # One ledger for every attempt of this runner: requests in flight in this process count against the budgets.
        self.budgets = BudgetLedger(ctx.repo, ctx.cycle_id, BudgetLimits.from_mapping(self.config.budgets.model_dump()))

    def budget_scopes(self, unit: EpisodeUnit) -> tuple[str, ...]:
        """The shared budget scopes an episode of `unit` spends from: its task's and the cycle's."""
        return (task_scope(unit.task_id), CYCLE_SCOPE)

    def _episode_budget(self, unit: EpisodeUnit) -> EpisodeBudget | None:
        """What the attempt's proxy enforces (None when no budget applies: the proxy then checks nothing)."""
        episode_tokens = self.config.budgets.episode_tokens
        if episode_tokens is None and not self.budgets.limits.limited(self.budget_scopes(unit)):
            return None
        return EpisodeBudget(
            episode_tokens=episode_tokens,
            default_max_tokens=self.config.inference.episode_max_output_tokens,
            ledger=self.budgets,
            scopes=self.budget_scopes(unit),
        )

    @property
    def install(self) -> QwenInstall:
        """The agent runtime: the given one, else the pinned qwen-code (installed on first use)."""
        with self._install_lock:
            if self._install is None:
                self._install = ensure_qwen_code()
            return self._install

    @property
    def agent_sandbox(self) -> str:
        """How the agent is contained: "pod" (a Kubernetes episode pod: the pod is the sandbox), "bwrap" (the local
        bubblewrap sandbox, `mass_ops.compute.sandbox`) or "none" (`runtime.sandbox` none, or bwrap unavailable)."""
        if self.proxy_sessions is not None:
            return "pod"
        if self.config.runtime.sandbox == "bwrap" and bwrap_support().available:
            return "bwrap"
        return "none"

    def _refuse_unsandboxed(self, api_key: str) -> None:
        """A local agent without a sandbox can read this process's environment and reach every local service: with
        a real key that needs `runtime.allow_unsandboxed_agent` (the placeholder key of a keyless local server, as in
        the demo, does not). Raises `EpisodePreflightError` (one line)."""
        runtime = self.config.runtime
        if self.agent_sandbox != "none":
            return
        why = "runtime.sandbox is none" if runtime.sandbox == "none" else bwrap_support().reason
        if api_key != DEFAULT_KEY_VALUE and not runtime.allow_unsandboxed_agent:
            raise EpisodePreflightError(
                f"episode preflight: the agent would run without a sandbox ({why}) while "
                f"{self.config.inference.api_key_env} holds a real API key; install bubblewrap, or set "
                "runtime.allow_unsandboxed_agent=true to run it unsandboxed"
            )
        if not self._warned_unsandboxed:
            self._warned_unsandboxed = True
            logger.warning("episode agents run without a sandbox (%s)", why)

    # -- preflight --

    async def preflight(self) -> str | None:
        """Check key and endpoint; returns the key value, or None in a pod, where the proxy holds the key and the
        publisher checks the endpoint when it opens each attempt's session (raises `EpisodePreflightError`)."""
        if self.proxy_sessions is None:
            api_key = resolve_api_key(self.config, self.environ)
            await asyncio.to_thread(bwrap_support)  # probes once per process: off the loop
            self._refuse_unsandboxed(api_key)
            await check_endpoint(self.config, api_key)
            return api_key
        return None

    @contextlib.asynccontextmanager
    async def _episode_proxy(
        self,
        paths: AttemptPaths,
        upstream: str,
        api_key: str | None,
        unit: EpisodeUnit,
        counted: list[UsageCounter],
        egress: dict[str, int],
    ) -> AsyncIterator[Any]:
        """The attempt's proxy: yields (base URL, agent token); when it ends, `paths.api_log` holds its whole log and
        `counted` the proxy's own counter of the attempt's usage. A sandboxed attempt with `runtime.sandbox_egress:
        public` also gets its egress proxy, whose counts land in `egress` when it has stopped."""
        if self.proxy_sessions is None:
            token = new_agent_token()
            proxy = LoggingProxy(
                upstream,
                paths.api_log,
                agent_token=token,
                upstream_api_key=api_key,
                budget=self._episode_budget(unit),
                request_priority=episode_server_priority(self.config, unit.kind, unit.version),
                client_path=split_endpoint(self.config.inference.endpoint)[1],
                max_request_bytes=self.config.runtime.proxy_max_request_bytes,
            )
            counted.append(proxy.usage)  # complete once the proxy has stopped
            if self.agent_sandbox == "bwrap":
                # The sandboxed agent has its own network: it reaches this proxy only through the Unix socket in a
                # folder its sandbox mounts, bridged inside to the URL it is given (nothing listens on host TCP).
                socket_dir = proxy_socket_dir(paths.root)
                socket_path = await asyncio.to_thread(create_socket_dir, socket_dir)
                outbound = None
                if self.config.runtime.sandbox_egress == "public":
                    outbound = EgressProxy(ports=self.config.runtime.sandbox_egress_ports)
                try:
                    await proxy.start(unix_socket=socket_path)
                    try:
                        if outbound is not None:
                            await outbound.start(socket_dir / EGRESS_SOCKET_NAME)
                        yield proxy_url_in_sandbox(), token
                    finally:
                        if outbound is not None:
                            await outbound.stop()
                            egress.update(outbound.counts.as_dict())
                        await proxy.stop()
                finally:
                    await asyncio.to_thread(remove_socket_dir, socket_dir)
                return
            await proxy.start()
            try:
                yield proxy.url, token
            finally:
                await proxy.stop()
            return
        # The publisher derives the upstream and the budget itself: nothing this container says chooses them.
        session = await self.proxy_sessions.open(unit)
        try:
            yield session.proxy_url, session.token
        finally:
            counted.append(UsageCounter(await self.proxy_sessions.close(session, paths.api_log)))

    # -- one attempt --

    async def run_attempt(
        self,
        request: EpisodeRequest,
        attempt: int,
        *,
        retry_of_id: int | None = None,
        on_agent_exit: Callable[[], None] | None = None,
    ) -> EpisodeOutcome:
        """Run attempt `attempt` of `request`'s unit and record it; docs/runtime.md lists the steps.

        `on_agent_exit` is called once the agent and its proxy have stopped, before publishing: from then on the
        attempt no longer loads the endpoint (the pool frees its capacity slot there).
        """
        unit = dataclasses.replace(request.unit, attempt=attempt)
        api_key = await self.preflight()
        install = await asyncio.to_thread(lambda: self.install)  # may run npm the first time: off the loop
        started_at = datetime.now(UTC)
        await asyncio.to_thread(self._lease, "start", unit, started_at)
        renewing = asyncio.create_task(self._renew_lease(unit))
        try:
            return await self._attempt(request, unit, install, api_key, started_at, retry_of_id, on_agent_exit)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            # The row is recorded (or the attempt died without one): the unit is no longer in flight.
            await asyncio.to_thread(self._lease, "end", unit, None)

    async def _renew_lease(self, unit: EpisodeUnit) -> None:
        """Renew the attempt's lease every `lease_renew_s` while it lives: a runner that dies stops renewing, and its
        lease lapses (`LEASE_LAPSE_S`) even when the attempt has no time limit."""
        while True:
            await asyncio.sleep(self.lease_renew_s)
            await asyncio.to_thread(self._lease, "renew", unit, None)

    def _lease(self, action: str, unit: EpisodeUnit, started_at: datetime | None) -> None:
        """Start or end the attempt's lease (what `status` shows as running; `mass_ops.stages.leases`). In a pod the
        repository is the hand-off's stand-in, which does nothing: the operator and the publisher hold the lease.
        A store failure is logged: a lease only feeds `status`, and an episode never fails for it."""
        identity = unit.identity()
        try:
            if action == "start":
                self.ctx.repo.start_episode_lease(
                    self.ctx.cycle_id,
                    attempt=unit.attempt,
                    host=lease_host(),
                    started_at=started_at,
                    renewed=True,
                    **identity,
                )
            elif action == "renew":
                self.ctx.repo.renew_episode_lease(self.ctx.cycle_id, attempt=unit.attempt, **identity)
            else:
                self.ctx.repo.end_episode_lease(self.ctx.cycle_id, attempt=unit.attempt, **identity)
        except SQLAlchemyError as exc:
            logger.warning("episode %s: could not %s its lease: %s", unit.key, action, first_line(exc))

    async def _attempt(
        self,
        request: EpisodeRequest,
        unit: EpisodeUnit,
        install: QwenInstall,
        api_key: str | None,
        started_at: datetime,
        retry_of_id: int | None,
        on_agent_exit: Callable[[], None] | None,
    ) -> EpisodeOutcome:
        """The leased part of `run_attempt`: the attempt folder, the proxy, the agent, then publishing."""
        attempt = unit.attempt
        clock = time.monotonic()
        async with self._attempt_folder(unit, request.prompt) as paths:
            if request.workspace_seed is not None:
                await asyncio.to_thread(self._seed_workspace, request.workspace_seed, paths)
            upstream, client_path = split_endpoint(self.config.inference.endpoint)
            counted: list[UsageCounter] = []
            egress: dict[str, int] = {}
            async with self._episode_proxy(paths, upstream, api_key, unit, counted, egress) as (proxy_url, agent_token):
                client_endpoint = f"{proxy_url}{client_path}"
                settings = qwen_settings(self.config, client_base_url=client_endpoint, seed=unit.seed)
                write_settings(paths.settings, settings)
                write_settings(paths.settings_record, settings)
                scope = f"{unit.slug}-a{attempt}-{secrets.token_hex(6)}"
                env = agent_environment(
                    self.config,
                    paths,
                    agent_token=agent_token,
                    scope=scope,
                    path_value=self.environ.get("PATH", os.defpath),
                    sandbox=self.agent_sandbox,
                )
                setup_s = time.monotonic() - clock
                logger.info("episode %s attempt %d: agent starting in %s", unit.slug, attempt, paths.workspace)
                agent = await self._run_agent(install, paths, env, scope)
            if on_agent_exit is not None:
                on_agent_exit()
            finished = FinishedAttempt(
                request=request,
                unit=unit,
                paths=paths,
                agent=agent,
                started_at=started_at,
                finished_at=datetime.now(UTC),
                client_endpoint=client_endpoint,
                env_policy=environment_policy(env, self.config.inference.api_key_env),
                durations={"setup_s": setup_s, "agent_s": agent.duration_s},
                usage=counted[0].totals(),
                egress=egress,
                retry_of_id=retry_of_id,
            )
            abort = threading.Event()
            work = asyncio.ensure_future(asyncio.to_thread(self._finish, finished, api_key, abort))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # The publishing thread cannot be interrupted: tell it to stop before the row, wait for it (it reads
                # the folder we are about to delete), then let the cancellation through.
                abort.set()
                with contextlib.suppress(BaseException):
                    await work
                raise

    def _seed_workspace(self, seed: WorkspaceSeed, paths: AttemptPaths) -> None:
        """Fetch the request's seed through the context's store and extract it into the fresh workspace."""
        archive = paths.root / "workspace-seed.tar.gz"
        try:
            fetch_workspace_seed(self.ctx.artifacts, seed, archive)
            count = extract_workspace_seed(archive, paths.workspace, seed)
        finally:
            archive.unlink(missing_ok=True)
        logger.info("episode workspace seeded from %s (%d entries, sha256 %s…)", seed.uri, count, seed.sha256[:12])

    @contextlib.asynccontextmanager
    async def _attempt_folder(self, unit: EpisodeUnit, prompt: str) -> AsyncIterator[AttemptPaths]:
        """The attempt's folder, locked against a second run of the same attempt, removed at the end.

        Filesystem work runs on worker threads: removing a workspace with thousands of files must not stall the
        event loop that relays every other episode's stream.
        """
        root = self.scratch_dir / unit.cycle / f"{unit.slug}-a{unit.attempt}"
        lock = await asyncio.to_thread(lock_attempt, root, unit.key)
        try:
            paths = AttemptPaths(root)
            await asyncio.to_thread(fresh_attempt_folder, paths, prompt)
            try:
                yield paths
            finally:
                if not self.keep_scratch:
                    await asyncio.to_thread(remove_tree, root)
        finally:
            lock.release()

    async def _run_agent(self, install: QwenInstall, paths: AttemptPaths, env: dict[str, str], scope: str) -> AgentRun:
        """The agent of the attempt, in its sandbox when it has one, under the episode's limits."""
        bwrap = bwrap_support().bwrap if self.agent_sandbox == "bwrap" else None
        runtime = self.config.runtime
        argv = agent_argv(
            install, self.config.models.served_name, paths, bwrap=bwrap, egress=runtime.sandbox_egress == "public"
        )
        return await run_agent(
            argv, paths, env, scope, wall_clock_s=runtime.episode_wall_clock_s, kill_grace_s=self.kill_grace_s
        )

    # -- after the agent: classify, then hand the publication to the sink (blocking I/O, on a worker thread) --

    def _finish(self, finished: FinishedAttempt, api_key: str | None, abort: threading.Event) -> EpisodeOutcome:
        publication = self._publication(finished, api_key)
        try:
            return self.sink.deliver(publication, abort)
        except PublishAborted:
            raise asyncio.CancelledError from None

    def _publication(self, finished: FinishedAttempt, api_key: str | None) -> EpisodePublication:
        """Redact the key, read the proxy log (for classification only: the row's counts are the proxy's own), then
        assemble what the attempt publishes."""
        redact_attempt(finished.paths, api_key, finished.unit.key)
        records = _read_proxy_log(finished.paths.api_log)
        return assemble_publication(
            finished,
            records,
            config=self.config,
            store=self.ctx.artifacts,
            qwen_code_version=self.install.version,
            execution_mode=self.execution_mode,
        )
