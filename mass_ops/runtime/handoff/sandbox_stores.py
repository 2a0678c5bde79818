"""The stores as the sandbox's `EpisodePool` sees them in a pod: answered from the publisher's ledger.

The sandbox container reaches no database and no artifact store. `LedgerRepository` answers the pool's one read of
the metadata store (`episode_attempts`) and its budget reads from the ledger, and does nothing for leases and marks
(the operator and the publisher own them). `LedgerArtifacts` names objects by URI, serves final attempts' status
documents from the ledger and the delivered workspace seed from the folder; anything else is not found.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from mass_ops.layout import EpisodeKind, EpisodeUnit
from mass_ops.runtime.episode import workspace_seed_key
from mass_ops.runtime.handoff.documents import Ledger, RecordedAttempt, ScopeSpend
from mass_ops.runtime.handoff.folder import SEED_FILE, Handoff
from mass_ops.store.artifacts import ArtifactNotFoundError, ArtifactStore, file_sha256


class LedgerRepository:
    """The one read of the metadata store the sandbox's `EpisodePool` makes (`episode_attempts`), answered from
    the ledger. Any other call fails: the sandbox has no database."""

    def __init__(self, cycle: str, ledger: Ledger) -> None:
        self._cycle = cycle
        self._attempts = ledger.attempts
        self._spend = ledger.budget_spend

    def budget_spend(self, cycle_id: int, scopes: Sequence[str] | None = None) -> dict[str, ScopeSpend]:
        """The budget scopes' spend as of the pod's start (what `BudgetLedger.exhausted` reads)."""
        del cycle_id
        return {scope: spend for scope, spend in self._spend.items() if scopes is None or scope in scopes}

    def note_budget_refusal(self, cycle_id: int, scope: str, need: int) -> None:
        """Nothing to note: a pod's proxy holds only the episode budget, whose refusals stay in its records."""
        del cycle_id, scope, need

    def mark_budget_once(self, cycle_id: int, key: str) -> bool:
        """Never marks: the sandbox has no store, so budget alerts are raised where the spend is recorded (the
        publisher's ingestion, the operator's admission check)."""
        del cycle_id, key
        return False

    def start_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to lease: the operator leased the pod's unit when it created the pod."""
        del cycle_id, unit

    def renew_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to renew: a pod's lease is the operator's (it lapses by age, not by renewals)."""
        del cycle_id, unit

    def end_episode_lease(self, cycle_id: int, **unit: Any) -> None:
        """Nothing to end here: the publisher ends the lease when it ingests the attempt."""
        del cycle_id, unit

    def episode_attempts(
        self,
        cycle_id: int,
        *,
        task_id: int,
        kind: str,
        seed: int,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
    ) -> list[RecordedAttempt]:
        del cycle_id
        unit = EpisodeUnit(self._cycle, task_id, cast(EpisodeKind, kind), seed, version, candidate, 1, generation)
        return list(self._attempts.get(unit.slug, []))


class LedgerArtifacts:
    """The publisher's artifact store as the sandbox sees it: URIs (no credentials needed to name an object), and
    the status documents of final attempts, which the ledger carries. Nothing is read from or written to the store."""

    def __init__(
        self,
        store: ArtifactStore,
        statuses: dict[str, dict[str, Any]],
        *,
        cycle: str | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self._store = store
        self._statuses = statuses
        self._cycle = cycle
        self._handoff = handoff

    @property
    def url(self) -> str:
        return self._store.url

    def uri(self, key: str) -> str:
        return self._store.uri(key)

    def key_of(self, uri: str) -> str:
        return self._store.key_of(uri)

    def get_file(self, key: str, dest: str | os.PathLike[str], *, sha256: str | None = None) -> None:
        """The workspace seed the publisher delivered (`SEED_FILE`), copied to `dest` when `key` is the cycle's
        seed key of its SHA-256 (and `sha256`, when given, is that hash); `ArtifactNotFoundError` otherwise — the
        sandbox reaches no store."""
        delivered = None if self._handoff is None else self._handoff.path(SEED_FILE)
        if delivered is not None and self._cycle is not None and delivered.is_file() and not delivered.is_symlink():
            actual, _size = file_sha256(delivered)
            if key == workspace_seed_key(self._cycle, actual) and sha256 in (None, actual):
                target = Path(dest)
                temp = target.with_name(f".{target.name}.partial")
                shutil.copyfile(delivered, temp)
                os.replace(temp, target)
                return
        raise ArtifactNotFoundError(f"artifact {self.uri(key)} is not in the hand-off")

    def get_json(self, key: str) -> Any:
        if key not in self._statuses:
            raise ArtifactNotFoundError(f"artifact {self.uri(key)} is not in the hand-off ledger")
        return self._statuses[key]
