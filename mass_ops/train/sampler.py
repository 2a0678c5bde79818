"""The `task_role` window sampler (MASS_SPEC §8): with replacement, one seeded draw per (rank, micro-step).

Each draw builds its own RNG from the string "{seed}-{rank}-{draw}" with draw = step·grad_accum + micro, so a draw
never depends on earlier draws: resuming at any step reproduces the uninterrupted run's windows exactly, and the
sampler carries no state beyond the exposure counts it reports.

A draw: a task uniformly among the tasks present (ascending ids); if the task has both orchestrator windows and
worker/auxiliary windows, the orchestrator group with probability p_orch, else the group it has; then a window
uniformly within the group.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ORCH = "orch"
NONMAIN = "nonmain"


@dataclass(frozen=True)
class WindowTag:
    """What the sampler needs to know about one training window."""

    index: int
    task: int
    role: str
    episode: str = ""
    n_loss_tokens: int = 0

    @property
    def group(self) -> str:
        return ORCH if self.role == "orchestrator" else NONMAIN


@dataclass(frozen=True)
class Draw:
    """One sampled window for one rank's micro-step."""

    step: int
    rank: int
    micro: int
    draw: int
    window: int
    task: int
    role: str
    group: str


def draw_index(step: int, micro: int, grad_accum: int) -> int:
    """The draw counter of the reference: step·grad_accum + micro."""
    return step * grad_accum + micro


class TaskRoleSampler:
    """Seeded task → group → window sampling over a fixed window set."""

    def __init__(self, windows: Sequence[WindowTag], *, seed: int, p_orch: float) -> None:
        if not windows:
            raise ValueError("task_role sampler: no training windows to sample from")
        if not 0.0 <= p_orch <= 1.0:
            raise ValueError(f"task_role sampler: p_orch must lie in [0, 1] (got {p_orch})")
        self.seed = seed
        self.p_orch = p_orch
        self._windows = list(windows)
        groups: dict[int, dict[str, list[int]]] = {}
        for position, tag in enumerate(self._windows):
            groups.setdefault(tag.task, {ORCH: [], NONMAIN: []})[tag.group].append(position)
        self._tasks = sorted(groups)
        self._groups = groups

    @property
    def tasks(self) -> list[int]:
        return list(self._tasks)

    def group_sizes(self) -> dict[int, dict[str, int]]:
        return {task: {g: len(ix) for g, ix in self._groups[task].items()} for task in self._tasks}

    def draw(self, *, step: int, rank: int, micro: int, grad_accum: int) -> Draw:
        n = draw_index(step, micro, grad_accum)
        rng = random.Random(f"{self.seed}-{rank}-{n}")
        task = self._tasks[rng.randrange(len(self._tasks))]
        by_group = self._groups[task]
        if by_group[ORCH] and by_group[NONMAIN]:
            group = ORCH if rng.random() < self.p_orch else NONMAIN
        else:
            group = ORCH if by_group[ORCH] else NONMAIN
        members = by_group[group]
        tag = self._windows[members[rng.randrange(len(members))]]
        return Draw(
            step=step, rank=rank, micro=micro, draw=n, window=tag.index, task=tag.task, role=tag.role, group=group
        )

    def draws_for_step(self, *, step: int, rank: int, grad_accum: int) -> list[Draw]:
        return [self.draw(step=step, rank=rank, micro=m, grad_accum=grad_accum) for m in range(grad_accum)]


@dataclass
class Exposure:
    """How often each task:role pair and each window was drawn; saved with every checkpoint."""

    by_task_role: Counter[str] = field(default_factory=Counter)
    windows: Counter[int] = field(default_factory=Counter)
    draws: int = 0

    def add(self, draws: Iterable[Draw]) -> None:
        for d in draws:
            self.by_task_role[f"{d.task}:{d.role}"] += 1
            self.windows[d.window] += 1
            self.draws += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "by_task_role": dict(sorted(self.by_task_role.items())),
            "windows": {str(k): v for k, v in sorted(self.windows.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Exposure:
        return cls(
            by_task_role=Counter({str(k): int(v) for k, v in data.get("by_task_role", {}).items()}),
            windows=Counter({int(k): int(v) for k, v in data.get("windows", {}).items()}),
            draws=int(data.get("draws", 0)),
        )
