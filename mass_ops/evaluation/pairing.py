"""Pairing two rollout sets by (task, replicate) for external pairwise judging (MASS_SPEC §10 pair_rollouts).

Both sets must cover the same non-empty (task, replicate) set without duplicates. Pairs are sorted by
(task, replicate); side A is the first set (by convention the newer generation), side B the second. A pair's
document is ``{task, replicate, a, b}`` where a/b name the episodes as ``<cycle>/<episode unit key>`` — stable across
artifact stores — and its id is the SHA-256 of ``json.dumps(document, sort_keys=True)``, as in the reference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.errors import InputError
from mass_ops.evaluation.rollouts import RolloutEntry, RolloutSet


class PairingError(InputError):
    """Two rollout sets cannot be paired, or a pairs document is malformed."""


@dataclass(frozen=True)
class RolloutPair:
    """One judged unit of the report: the same (task, replicate) rolled out by two generations."""

    task: int
    replicate: int
    a: str
    b: str
    episode_a_id: int
    episode_b_id: int
    workspace_a: str
    workspace_b: str
    generation_a: str
    generation_b: str

    def document(self) -> dict[str, Any]:
        """What identifies the pair (hashed into `pair_id`)."""
        return {"task": self.task, "replicate": self.replicate, "a": self.a, "b": self.b}

    @property
    def pair_id(self) -> str:
        return pair_id(self.document())

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.document(),
            "pair_id": self.pair_id,
            "episode_a_id": self.episode_a_id,
            "episode_b_id": self.episode_b_id,
            "workspace_a": self.workspace_a,
            "workspace_b": self.workspace_b,
            "generation_a": self.generation_a,
            "generation_b": self.generation_b,
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RolloutPair:
        try:
            pair = cls(
                task=int(row["task"]),
                replicate=int(row["replicate"]),
                a=str(row["a"]),
                b=str(row["b"]),
                episode_a_id=int(row["episode_a_id"]),
                episode_b_id=int(row["episode_b_id"]),
                workspace_a=str(row["workspace_a"]),
                workspace_b=str(row["workspace_b"]),
                generation_a=str(row["generation_a"]),
                generation_b=str(row["generation_b"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PairingError(f"pairs document: row {row!r} is not a rollout pair ({exc})") from None
        if "pair_id" in row and row["pair_id"] != pair.pair_id:
            raise PairingError(f"pairs document: pair_id {row['pair_id']} does not match the pair {pair.document()}")
        return pair


def pair_id(document: dict[str, Any]) -> str:
    """SHA-256 of ``json.dumps(document, sort_keys=True)``."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode("utf-8")).hexdigest()


def _index(rollouts: RolloutSet, side: str) -> dict[tuple[int, int], RolloutEntry]:
    index: dict[tuple[int, int], RolloutEntry] = {}
    for entry in rollouts.entries:
        key = (entry.task, entry.replicate)
        if key in index:
            raise PairingError(f"pairing: set {side} ({rollouts.label}) lists task {key[0]} replicate {key[1]} twice")
        index[key] = entry
    if not index:
        raise PairingError(f"pairing: set {side} ({rollouts.label}) is empty")
    return index


def _describe(keys: Iterable[tuple[int, int]]) -> str:
    shown = sorted(keys)
    text = ", ".join(f"t{task}/r{replicate}" for task, replicate in shown[:6])
    return text + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")


def pair_rollouts(set_a: RolloutSet, set_b: RolloutSet) -> list[RolloutPair]:
    """Pairs of `set_a` (side A) and `set_b` (side B) by (task, replicate), sorted by (task, replicate)."""
    if set_a.cycle == set_b.cycle and set_a.label == set_b.label:
        raise PairingError(f"pairing: a rollout set cannot be paired with itself ({set_a.label})")
    left, right = _index(set_a, "A"), _index(set_b, "B")
    if set(left) != set(right):
        only_a, only_b = set(left) - set(right), set(right) - set(left)
        parts = []
        if only_a:
            parts.append(f"only in A ({set_a.label}): {_describe(only_a)}")
        if only_b:
            parts.append(f"only in B ({set_b.label}): {_describe(only_b)}")
        raise PairingError("pairing: the sets must cover the same (task, replicate) entries; " + "; ".join(parts))
    pairs = []
    for key in sorted(left):
        a, b = left[key], right[key]
        missing = [side for side, entry in (("A", a), ("B", b)) if not entry.workspace]
        if missing:
            raise PairingError(f"pairing: t{key[0]}/r{key[1]} has no workspace artifact on side(s) {missing}")
        pairs.append(
            RolloutPair(
                task=key[0],
                replicate=key[1],
                a=f"{set_a.cycle}/{a.unit_key}",
                b=f"{set_b.cycle}/{b.unit_key}",
                episode_a_id=a.episode_id,
                episode_b_id=b.episode_id,
                workspace_a=str(a.workspace),
                workspace_b=str(b.workspace),
                generation_a=set_a.generation,
                generation_b=set_b.generation,
            )
        )
    return pairs


def pairs_document(pairs: Sequence[RolloutPair]) -> list[dict[str, Any]]:
    """The pairs as a JSON-ready list (the compatibility form of the reference's pairs.json)."""
    return [pair.as_dict() for pair in pairs]


def pairs_from_document(rows: Any) -> list[RolloutPair]:
    """Pairs read back from `pairs_document` output; duplicates are an error."""
    if not isinstance(rows, list) or not rows:
        raise PairingError("pairs document: must be a non-empty JSON list")
    pairs = [RolloutPair.from_dict(row) if isinstance(row, dict) else _bad_row(row) for row in rows]
    ids = [pair.pair_id for pair in pairs]
    if len(set(ids)) != len(ids):
        raise PairingError("pairs document: lists the same pair more than once")
    return pairs


def _bad_row(row: Any) -> RolloutPair:
    raise PairingError(f"pairs document: row {row!r} is not an object")
