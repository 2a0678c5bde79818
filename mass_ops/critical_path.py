"""Critical-path priority: which work of a cycle goes first when the episode pool or the model server is full.

A task's chain is its search (reference and v0 side by side, then each version after the last), then its collection,
then its ranking; the cycle's wall-clock is its longest chain. So work with more of its chain still ahead goes
first: an early search version before a later one, any search before collection, collection before ranking, and
the rest (evaluation rollouts, benchmarks, external judges) last (ISSUE #17.2). Two schedulers use this one order:

- the episode pool grants a freed slot to the waiting episode with the highest `chain_priority`;
- the model server, when it runs vLLM's priority scheduling (`inference.server.scheduling_policy: priority`), serves
  waiting requests by `server_priority` (lower first, as vLLM orders them; there collection and ranking share one
  level). In-loop calls (judges, optimizer) carry it in their request; the episode proxy stamps it on every model
  request of its episode, over whatever the agent sent, so the untrusted agent cannot move its own work up the
  queue. The server's queue matters where it holds more than its `--max-num-seqs`: in the DAG every task's
  collection instance runs its own episode pool beside the search steps.
"""

from __future__ import annotations

from typing import Literal

from mass_ops.config import CycleConfig

Phase = Literal["search", "collection", "ranking", "other"]

# The phase of each episode kind: a reference episode is the first step of its task's search.
_EPISODE_PHASES: dict[str, Phase] = {"reference": "search", "search": "search", "collection": "collection"}


def episode_phase(kind: str) -> Phase:
    """The chain phase an episode of `kind` (a `layout.EpisodeKind`) belongs to."""
    return _EPISODE_PHASES.get(kind, "other")


def chain_priority(phase: Phase, version: int | None, iterations: int) -> int:
    """How many phases of its task's chain are left once this work is done (higher = more urgent): search work at
    version k leaves the later versions, collection and ranking; collection leaves ranking; ranking and the rest
    leave nothing. `version` counts for search only (None: the start of the search, like v0)."""
    if phase == "search":
        return 2 + max(0, iterations - (version or 0))
    return 1 if phase == "collection" else 0


def server_priority(config: CycleConfig, phase: Phase, version: int | None = None) -> int | None:
    """The `priority` a request of this work carries to a vLLM server that schedules by priority (0 = the start of
    a search, the most urgent; collection and ranking one level after the last version; the rest last), or None
    when the configured server does not (the field is then not sent at all: vLLM refuses it under its default
    first-come-first-served policy)."""
    if config.inference.server.scheduling_policy != "priority":
        return None
    iterations = config.search.iterations
    # Ranking shares collection's place in the server's queue: both are the many parallel units at the end of a
    # chain, and holding one task's ranking behind other tasks' collection only moves its work to the end of the
    # cycle (cycle_sim, a work-bound draw: wall/bound 1.18 with ranking last, 1.11 with both on one level). The search
    # versions are the chain's serial part, where every wait adds to the chain.
    if phase == "ranking":
        phase = "collection"
    return chain_priority("search", 0, iterations) - chain_priority(phase, version, iterations)


def episode_server_priority(config: CycleConfig, kind: str, version: int | None) -> int | None:
    """`server_priority` of an episode of `kind` (a `layout.EpisodeKind`) at `version`: what its proxy stamps."""
    return server_priority(config, episode_phase(kind), version)
