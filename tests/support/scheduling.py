"""The order in which the suite's test modules run: the most expensive first.

`scripts/test.sh` runs pytest-xdist with `--dist loadfile --no-loadscope-reorder`: whole modules are handed, in
collection order, to whichever worker is free. Handing out the longest modules first (longest-processing-time
first) keeps a whole-cycle module from starting near the end while the other worker has nothing left to do.

A test's cost is the `seconds=` of its `slow` mark (about that many seconds on 2 cores, its module fixtures
included; a `slow` mark without it counts `UNHINTED_SLOW_S`, a test without one 0); a module's cost is the sum
over its tests. Modules are stably sorted by cost, so equal-cost modules keep their collection order, and the order
of tests inside a module never changes. A wrong hint only makes the suite slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

UNHINTED_SLOW_S = 3.0


class _Mark(Protocol):
    kwargs: dict[str, object]


class _Item(Protocol):
    nodeid: str

    def get_closest_marker(self, name: str) -> _Mark | None: ...


ItemT = TypeVar("ItemT", bound=_Item)


def expected_seconds(item: _Item) -> float:
    """The expected seconds of `item` from its closest `slow` mark (0 without one)."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return 0.0
    seconds = mark.kwargs.get("seconds", UNHINTED_SLOW_S)
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
        raise ValueError(f"{item.nodeid}: slow(seconds=...) must be a number of seconds >= 0, not {seconds!r}")
    return float(seconds)


def module_of(item: _Item) -> str:
    """The module part of a node id: what `--dist loadfile` hands to one worker."""
    return item.nodeid.split("::", 1)[0]


def heaviest_modules_first(items: Sequence[ItemT]) -> list[ItemT]:
    """`items` regrouped by module, modules by descending total cost (stable), each module's tests in their order."""
    modules: dict[str, list[ItemT]] = {}
    for item in items:
        modules.setdefault(module_of(item), []).append(item)
    cost = {name: sum(expected_seconds(item) for item in group) for name, group in modules.items()}
    ordered = sorted(modules, key=lambda name: -cost[name])
    return [item for name in ordered for item in modules[name]]
