"""What a pod's attempts spent, charged by the publisher to the task's and the cycle's budget scopes.

The pod's proxy reaches no store, so the publisher charges: each recorded attempt keyed by its row
(`charge_attempt`), and a proxy session whose attempt has no row keyed by the session
(`charge_unrecorded_session`). The charge's marker commits with the increments, so every ingest may charge and the
spend is added once. A failed charge is logged, never fatal: the row is durable and a rerun of the ingest charges it.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable
from pathlib import Path

from mass_ops.context import CycleContext
from mass_ops.errors import first_line
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.proxy import usage_cost
from mass_ops.runtime.runner import EpisodePublication
from mass_ops.runtime.runner import _read_proxy_log as read_proxy_log  # the one reader of a proxy log's records
from mass_ops.runtime.session_proxy import ClosedSession, ProxySession
from mass_ops.store.budgets import charge_episode
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

logger = logging.getLogger(__name__)


def api_log_cost(path: Path) -> float:
    """The server-reported cost in USD summed over an attempt's proxy records (gzip JSON lines; 0 without costs):
    what the local proxy would have charged, response by response."""
    total = 0.0
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = loads_untrusted(line, what=str(path), max_bytes=len(line), max_depth=None)
            except UntrustedInputError:
                continue  # a record cut short is not spend anyone can prove
            response = record.get("response") if isinstance(record, dict) else None
            total += usage_cost(response.get("usage") if isinstance(response, dict) else None)
    return total


def charge_attempt(
    ctx: CycleContext, publication: EpisodePublication, episode_id: int, scrubbed: Callable[[str], str]
) -> None:
    """Charge the recorded attempt's tokens and cost (from its published log) to its task and the cycle, keyed by
    its row `episode_id`; a failure is logged with `scrubbed` applied (a ledger that misses spend must not lose the
    episode)."""
    record = publication.record
    tokens = record.prompt_tokens + record.completion_tokens
    try:
        cost = api_log_cost(publication.files.api_log)
        charge_episode(
            ctx.repo,
            ctx.cycle_id,
            publication.unit.task_id,
            charge_key=f"episode:{episode_id}",
            tokens=tokens,
            cost_usd=cost,
            requests=record.requests,
        )
    except Exception as exc:
        message = scrubbed(first_line(exc))
        logger.error(
            "episode %s (id %s): could not charge %d tokens to the budget ledger: %s: %s",
            publication.unit.key,
            episode_id,
            tokens,
            type(exc).__name__,
            message,
        )


def charge_unrecorded_session(
    ctx: CycleContext,
    unit: EpisodeUnit,
    session: ProxySession,
    closed: ClosedSession,
    scrubbed: Callable[[str], str],
) -> None:
    """Charge what the closed proxy `session` of `unit`'s attempt spent, keyed by the session, unless that attempt
    has a row (then its row's charge counts it: `charge_attempt`, on this ingest or a retried one). An agent that
    stops its runner before the hand-over must not spend off the ledger. A failure is logged, never fatal."""
    slug, attempt = unit.slug, unit.attempt
    usage, tokens = closed.usage, closed.usage.prompt_tokens + closed.usage.completion_tokens
    try:
        rows = ctx.repo.episode_attempts(ctx.cycle_id, **unit.identity())
        if any(row.attempt == attempt for row in rows):
            return
        logger.warning(
            "episode %s attempt %d: its proxy session %s ended unrecorded (%d requests, %d tokens): charged",
            slug,
            attempt,
            session.name,
            usage.requests,
            tokens,
        )
        records = read_proxy_log(session.log_path)
        cost = sum(usage_cost((record["response"] or {}).get("usage")) for record in records)
        charge_episode(
            ctx.repo,
            ctx.cycle_id,
            unit.task_id,
            charge_key=f"proxy-session:{session.name}",
            tokens=tokens,
            cost_usd=cost,
            requests=usage.requests,
        )
    except Exception as exc:
        message = scrubbed(first_line(exc))
        logger.error("episode %s attempt %d: could not charge its session: %s", slug, attempt, message)
