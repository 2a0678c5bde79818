"""Pairing two rollout sets by (task, replicate) (MASS_SPEC §10 pair_rollouts)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from mass_ops.evaluation.pairing import PairingError, pair_rollouts, pairs_document, pairs_from_document
from mass_ops.evaluation.rollouts import RolloutEntry, RolloutSet


def rollout_set(label: str, generation: str, keys: list[tuple[int, int]], *, cycle: str = "c") -> RolloutSet:
    entries = tuple(
        RolloutEntry(
            task=task,
            replicate=replicate,
            seed=910000 + 100 * task + replicate,
            episode_id=1000 * (generation == "L1") + 10 * task + replicate,
            unit_key=f"rollout-t{task}-c{replicate}-s{910000 + 100 * task + replicate}-g{generation}/a1",
            status="succeeded",
            workspace=f"file:///w/{generation}/{task}/{replicate}.tar.gz",
        )
        for task, replicate in keys
    )
    tasks = tuple(sorted({t for t, _ in keys}))
    return RolloutSet(cycle, label, generation, tasks, 2, entries)


def test_pairs_by_task_and_replicate_sorted_with_reference_pair_ids():
    keys = [(60, 1), (51, 0), (60, 0), (51, 1)]
    new, old = rollout_set("new", "L1", keys), rollout_set("old", "L0", list(reversed(keys)))
    pairs = pair_rollouts(new, old)
    assert [(p.task, p.replicate) for p in pairs] == [(51, 0), (51, 1), (60, 0), (60, 1)]
    first = pairs[0]
    assert first.a == "c/rollout-t51-c0-s915100-gL1/a1" and first.b == "c/rollout-t51-c0-s915100-gL0/a1"
    assert (first.generation_a, first.generation_b) == ("L1", "L0")
    assert first.workspace_a.endswith("/L1/51/0.tar.gz") and first.episode_b_id == 510
    document = {"task": 51, "replicate": 0, "a": first.a, "b": first.b}
    assert first.document() == document
    assert first.pair_id == hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
    assert len({p.pair_id for p in pairs}) == 4
    assert pairs_from_document(json.loads(json.dumps(pairs_document(pairs)))) == pairs


def test_sets_must_cover_the_same_entries():
    new = rollout_set("new", "L1", [(51, 0), (51, 1), (60, 0)])
    old = rollout_set("old", "L0", [(51, 0), (60, 0), (60, 1)])
    with pytest.raises(PairingError, match=r"only in A \(new\): t51/r1; only in B \(old\): t60/r1"):
        pair_rollouts(new, old)
    with pytest.raises(PairingError, match="cannot be paired with itself"):
        pair_rollouts(new, new)
    empty = rollout_set("none", "L0", [])
    with pytest.raises(PairingError, match="is empty"):
        pair_rollouts(new, empty)
    doubled = dataclasses.replace(new, entries=new.entries + new.entries[:1])
    with pytest.raises(PairingError, match="twice"):
        pair_rollouts(doubled, old)


def test_entries_need_workspaces_and_documents_are_checked():
    new = rollout_set("new", "L1", [(51, 0)])
    old = rollout_set("old", "L0", [(51, 0)])
    broken = dataclasses.replace(old, entries=(dataclasses.replace(old.entries[0], workspace=None),))
    with pytest.raises(PairingError, match=r"no workspace artifact on side\(s\) \['B'\]"):
        pair_rollouts(new, broken)
    document = pairs_document(pair_rollouts(new, old))
    with pytest.raises(PairingError, match="more than once"):
        pairs_from_document(document + document)
    tampered = [dict(document[0], replicate=5)]
    with pytest.raises(PairingError, match="does not match"):
        pairs_from_document(tampered)
    with pytest.raises(PairingError, match="non-empty JSON list"):
        pairs_from_document([])
