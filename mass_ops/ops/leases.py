"""Episode leases: which agent episodes are running now, for `status` (the rows come only when an attempt ends).

Writers: the local runner (`runtime.runner`) leases each attempt as its agent starts and ends the lease once the row
is recorded or the attempt died; on Kubernetes the operator that creates an episode pod leases the unit's next
attempt (`lease_episode_pod`) and the pod's publisher ends it when it ingests the attempt (`runtime.handoff`).

A crashed process, a deleted pod or a lost node leave their lease behind. A lease is fresh — its unit in flight — only
while it is younger than its attempt could possibly run (`lease_horizon_s`): the episode wall-clock limit plus
`LEASE_MARGIN_S` for setup and publishing, plus the pod start timeout on Kubernetes. Without a wall-clock limit
(`runtime.episode_wall_clock_s: null`) an episode may run for any time, so a lease stays fresh until its unit is
recorded or leased again; its age is shown with it. A local runner also renews its lease every `LEASE_RENEW_S`
while the attempt lives: a renewed lease not renewed for `LEASE_LAPSE_S` names a runner that died, with or without a
time limit. (A pod's lease is the operator's: nothing in the pod can renew it, so it lapses by age alone, and its
operator ends it when the pod fails, never starts or is killed.)
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from mass_ops.compute.backend import backend_for
from mass_ops.config import CycleConfig
from mass_ops.errors import first_line
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import LEASE_LAPSE_S, EpisodeLease

logger = logging.getLogger(__name__)

# Beyond the agent's wall clock: preflight, the attempt folder and workspace seed, stopping the agent (kill grace),
# gzipping and publishing the artifacts before the row.
LEASE_MARGIN_S = 1800.0
FINAL_STATUSES = ("succeeded", "model_failure")


def lease_horizon_s(config: CycleConfig) -> float | None:
    """How old a lease may be and still name a running attempt; None when an attempt has no time limit."""
    wall_clock = config.runtime.episode_wall_clock_s
    if wall_clock is None:
        return None
    # A pod is leased at its creation, before it is scheduled: the backend says how long that may take.
    return float(wall_clock + LEASE_MARGIN_S + backend_for(config).launch_delay_s(config))


def lease_is_fresh(lease: EpisodeLease, horizon_s: float | None, now: datetime) -> bool:
    """Whether `lease` can still name a running attempt at `now` (see the module docstring)."""
    if lease.renewed_at is not None and (now - lease.renewed_at).total_seconds() > LEASE_LAPSE_S:
        return False  # a local runner renews its lease while the attempt lives: this one died
    return horizon_s is None or (now - lease.started_at).total_seconds() <= horizon_s


def describe_lease(lease: EpisodeLease, now: datetime) -> str:
    """`attempt 2 started 3m ago on node-a pid 4711`: a running unit's detail in `status`."""
    seconds = max(0, int((now - lease.started_at).total_seconds()))
    if seconds < 60:
        age = f"{seconds}s"
    elif seconds < 3600:
        age = f"{seconds // 60}m"
    else:
        age = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    where = f" on {lease.host}" if lease.host else ""
    return f"attempt {lease.attempt} started {age} ago{where}"


def lease_episode_pod(config: CycleConfig, episode: Any, pod: str) -> dict[str, Any] | None:
    """Lease the next attempt of a bound episode pod's unit (`compute.kubernetes.EpisodeSpec`) on pod `pod`, as its
    operator creates the pod: the attempt the pod's pool will run (one after the latest recorded). None when the unit
    is final already (the pod reuses it) or the store refused the write: a lease only feeds `status`, so its failure
    is logged and the pod starts anyway."""
    if episode.seed is None:
        raise ValueError(f"episode {episode.slug}: only a bound spec names its unit (no seed)")
    identity = {
        "task_id": episode.task_id,
        "kind": episode.kind,
        "seed": episode.seed,
        "version": episode.version,
        "candidate": episode.unit_candidate,
        "generation": episode.generation,
    }
    # The store only, not `attach_cycle`: a lease needs no catalogue or prompt check (the pod's binding did them).
    repo = MetadataRepository.from_url(config.storage.metadata_url)
    try:
        cycle = repo.get_cycle(config.cycle_name)
        if cycle is None:
            logger.warning("episode %s: cycle %s is not in the store: no lease", episode.slug, config.cycle_name)
            return None
        attempts = repo.episode_attempts(cycle.id, **identity)
        if any(row.status in FINAL_STATUSES for row in attempts):
            return None
        attempt = max((row.attempt for row in attempts), default=0) + 1
        lease = repo.start_episode_lease(cycle.id, attempt=attempt, host=pod, **identity)
    except sa.exc.SQLAlchemyError as exc:
        why = first_line(exc)
        logger.warning(
            "episode %s: could not lease it on pod %s (status will not show it running): %s", episode.slug, pod, why
        )
        return None
    finally:
        repo.store.dispose()
    return {"unit": lease.unit_key, "attempt": lease.attempt, "where": pod}


def end_episode_pod_lease(config: CycleConfig, episode: Any) -> bool:
    """The pod of a bound episode is gone without its publisher ending the lease (it failed, could not start, or was
    deleted on a kill): end the unit's lease, so `status` stops counting it in flight. Whether a lease was removed;
    a store failure is only logged (a lease only feeds `status`)."""
    if episode.seed is None:
        raise ValueError(f"episode {episode.slug}: only a bound spec names its unit (no seed)")
    repo = MetadataRepository.from_url(config.storage.metadata_url)
    try:
        cycle = repo.get_cycle(config.cycle_name)
        if cycle is None:
            return False
        return repo.end_episode_lease(
            cycle.id,
            task_id=episode.task_id,
            kind=episode.kind,
            seed=episode.seed,
            version=episode.version,
            candidate=episode.unit_candidate,
            generation=episode.generation,
        )
    except sa.exc.SQLAlchemyError as exc:
        logger.warning("episode %s: could not end its lease: %s", episode.slug, first_line(exc))
        return False
    finally:
        repo.store.dispose()
