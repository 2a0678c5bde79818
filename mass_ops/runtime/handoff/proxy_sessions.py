"""The publisher's proxy sessions on the pod's `SessionProxy`: only the publisher opens, closes and counts them.

The proxy's control socket and logs lie in a volume the sandbox does not mount (`PodProxy`). `PublisherSessions`
answers the runner's asks in sessions/: one session per announced unit's next attempt, towards the upstream derived
here, after a preflight through the proxy, with the episode's token budget. A session is closed when the runner asks
or at the latest when its attempt is handed over; the published log and counts are the proxy's (docs/handoff.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.compute.kubernetes import EpisodeServer, proxy_upstream
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.handoff.documents import HandoffUnit, Ledger, SessionClosed, SessionGrant
from mass_ops.runtime.handoff.folder import SESSIONS_DIR, Handoff, HandoffError
from mass_ops.runtime.handoff.spend import charge_unrecorded_session
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.proxy import ProxySessionError
from mass_ops.runtime.runner import EndpointUnreachableError, EpisodePreflightError, EpisodeRecord, check_endpoint
from mass_ops.runtime.runner import _read_proxy_log as read_proxy_log  # the one reader of a proxy log's records
from mass_ops.runtime.session_proxy import ClosedSession, ProxySession, close_proxy_session, open_proxy_session

logger = logging.getLogger(__name__)

# What the runner may ask of the publisher in sessions/ (id: <unit slug>-a<attempt>-t<try of that attempt>).
_SESSION_ASK = re.compile(
    r"(?P<id>(?P<slug>[A-Za-z0-9._-]+)-a(?P<attempt>[1-9][0-9]{0,8})-t[0-9]{1,9})\.(?P<ask>open|close)"
)


@dataclass(frozen=True)
class PodProxy:
    """The pod's `SessionProxy` as the publisher reaches it: its control socket and its session-log folder (both in
    a volume the sandbox does not mount)."""

    control_socket: Path
    sessions_dir: Path


@dataclass
class _AttemptProxySession:
    """A session the publisher opened for one attempt, and what the proxy answered when it was closed."""

    session: ProxySession
    closed: ClosedSession | None = None


class PublisherSessions:
    """The sessions the publisher opened on `proxy` for the pod's attempts, by (unit slug, attempt).

    `scrubbed` removes the publisher's credentials from a message that goes where the agent can read."""

    def __init__(
        self,
        proxy: PodProxy,
        handoff: Handoff,
        config: CycleConfig,
        *,
        server: EpisodeServer | None,
        scrubbed: Callable[[str], str],
    ) -> None:
        self.proxy = proxy
        self.handoff = handoff
        self.config = config
        self.server = server
        self.scrubbed = scrubbed
        self._sessions: dict[tuple[str, int], _AttemptProxySession] = {}
        self._handled_asks: set[str] = set()

    def answer_asks(self, ledger: Ledger, units: dict[str, HandoffUnit], expected: dict[str, int]) -> None:
        """Answer what the runner asked in sessions/ since the last look: opens first, then closes."""
        folder = self.handoff.path(SESSIONS_DIR)
        if not folder.is_dir() or folder.is_symlink():
            return
        asks = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name in self._handled_asks:
                    continue
                self._handled_asks.add(entry.name)  # answers and strays too: each name is looked at once
                match = _SESSION_ASK.fullmatch(entry.name)
                if match is not None:
                    asks.append(match)
        for match in sorted(asks, key=lambda m: (m["ask"] != "open", m["id"])):
            slug, attempt, name = match["slug"], int(match["attempt"]), match["id"]
            if match["ask"] == "open":
                grant = self._grant(ledger, units, expected, slug, attempt)
                self.handoff.write(folder / f"{name}.session.json", grant)
            else:
                self.handoff.write(folder / f"{name}.closed.json", self._close_for_runner(slug, attempt, name))

    def attempt_log(self, unit: EpisodeUnit, into: Path) -> tuple[ClosedSession, Path]:
        """The attempt's session, closed, and its log gzipped into the publisher's own folder `into` (what is
        published); `HandoffError` when the attempt had no session."""
        entry = self._sessions.get((unit.slug, unit.attempt))
        if entry is None:
            raise HandoffError(f"attempt {unit.attempt} of {unit.slug} had no proxy session: no record vouches for it")
        closed = self._closed(entry)
        target = into / f"{unit.slug}-a{unit.attempt}.api_requests.jsonl.gz"
        # A session that logged nothing has no file: an empty log, as the runner's own gzip makes of it.
        with (
            gzip.open(target, "wb", compresslevel=6) as out,
            contextlib.suppress(FileNotFoundError),
            entry.session.log_path.open("rb") as source,
        ):
            shutil.copyfileobj(source, out, 1 << 20)
        return closed, target

    def close_unrecorded(self, ctx: CycleContext, cycle: str, units: dict[str, HandoffUnit]) -> None:
        """Close every session and charge those whose attempt has no row (never handed over, or its publishing
        failed) to its task and the cycle, keyed by the session (`charge_unrecorded_session`)."""
        for (slug, attempt), entry in self._sessions.items():
            closed = self._closed(entry)
            unit = units[slug].unit(cycle, attempt)
            charge_unrecorded_session(ctx, unit, entry.session, closed, self.scrubbed)

    def _grant(
        self, ledger: Ledger, units: dict[str, HandoffUnit], expected: dict[str, int], slug: str, attempt: int
    ) -> SessionGrant:
        """Open the proxy session of `slug`'s attempt `attempt` when it is an announced unit's next attempt and has
        had none yet, towards the upstream derived here, after checking the endpoint through the proxy."""
        if slug not in units:
            return SessionGrant(error=f"proxy session: {slug} is not a unit this pod announced")
        if attempt != expected[slug]:
            return SessionGrant(error=f"proxy session: attempt {attempt} is not the next attempt of {slug}")
        if (slug, attempt) in self._sessions:
            return SessionGrant(error=f"proxy session: attempt {attempt} of {slug} already has its session")
        config = self._attempt_config(ledger, units[slug])
        try:
            session = asyncio.run(self._open_checked(config))
        except (EndpointUnreachableError, ProxySessionError) as exc:
            return SessionGrant(error=self.scrubbed(str(exc)), transient=True)
        except EpisodePreflightError as exc:
            return SessionGrant(error=self.scrubbed(str(exc)))
        self._sessions[(slug, attempt)] = _AttemptProxySession(session)
        logger.info("episode %s attempt %d: proxy session %s opened", slug, attempt, session.name)
        return SessionGrant(proxy_url=session.proxy_url, token=session.token)

    def _attempt_config(self, ledger: Ledger, announced: HandoffUnit) -> CycleConfig:
        """The config an attempt of `announced` runs under: on the rollout's server from the ledger, the benchmark's
        server this publisher was given, else the cycle's endpoint."""
        from mass_ops.serving import GenerationServer, serving_config

        if ledger.serving is not None:
            return serving_config(self.config, GenerationServer(**ledger.serving.model_dump()))
        if self.server is not None:
            server = GenerationServer(str(announced.generation), self.server.endpoint, self.server.served_name)
            return serving_config(self.config, server)
        return self.config

    async def _open_checked(self, config: CycleConfig) -> ProxySession:
        """The preflight (GET /models through a throwaway session), then the attempt's budgeted session."""
        proxy, upstream = self.proxy, proxy_upstream(config)
        check = await open_proxy_session(proxy.control_socket, proxy.sessions_dir, upstream=upstream)
        try:
            await check_endpoint(config, check.token, via=check.proxy_url)
        finally:
            with contextlib.suppress(ProxySessionError):
                await close_proxy_session(proxy.control_socket, check, discard=True)
        return await open_proxy_session(
            proxy.control_socket,
            proxy.sessions_dir,
            upstream=upstream,
            episode_tokens=config.budgets.episode_tokens,
            default_max_tokens=config.inference.episode_max_output_tokens,
        )

    def _close_for_runner(self, slug: str, attempt: int, name: str) -> SessionClosed:
        """Close the attempt's session and put a copy of its log beside the answer (the runner classifies from it)."""
        entry = self._sessions.get((slug, attempt))
        if entry is None:
            return SessionClosed(error=f"attempt {attempt} of {slug} has no proxy session")
        closed = self._closed(entry)
        self.handoff.write_chunks(self.handoff.path(SESSIONS_DIR) / f"{name}.log", _file_chunks(entry.session.log_path))
        return SessionClosed(records=closed.records, usage=closed.usage.as_dict())

    def _closed(self, entry: _AttemptProxySession) -> ClosedSession:
        """Close `entry`'s session once (its token stops working, its exchanges are settled) and return the proxy's
        counts; a proxy that cannot answer any more leaves its log, which the proxy alone wrote: counted from it."""
        if entry.closed is None:
            try:
                entry.closed = asyncio.run(close_proxy_session(self.proxy.control_socket, entry.session))
            except ProxySessionError as exc:
                logger.warning("proxy session %s: %s; counting its log instead", entry.session.name, exc)
                records = read_proxy_log(entry.session.log_path)
                entry.closed = ClosedSession(len(records), UsageTotals.from_records(records))
        return entry.closed


def with_proxy_counts(
    record: EpisodeRecord, status: dict[str, Any], closed: ClosedSession
) -> tuple[EpisodeRecord, dict[str, Any]]:
    """The row's fields and the status document with the proxy's counts in place of what the sandbox said."""
    usage = closed.usage
    counts = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "requests": usage.requests,
        "max_prompt_tokens": usage.max_prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
    }
    status = {**status, "usage": usage.as_dict()}
    if isinstance(status.get("hiw"), dict):
        status["hiw"] = {**status["hiw"], "api_requests": closed.records}
    return record.model_copy(update=counts), status


def _file_chunks(path: Path) -> Iterator[bytes]:
    """The bytes of `path` (a file of the publisher's side) in pieces; nothing when it does not exist."""
    with contextlib.suppress(FileNotFoundError), path.open("rb") as source:
        while chunk := source.read(1 << 20):
            yield chunk
