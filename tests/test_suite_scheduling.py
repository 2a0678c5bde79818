"""The suite hands its costliest modules out first (tests/support/scheduling.py, wired in tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.support.scheduling import UNHINTED_SLOW_S, expected_seconds, heaviest_modules_first, module_of


@dataclass
class _Mark:
    kwargs: dict[str, object] = field(default_factory=dict)


@dataclass
class _Item:
    nodeid: str
    slow: _Mark | None = None

    def get_closest_marker(self, name: str) -> _Mark | None:
        return self.slow if name == "slow" else None


def _ids(items: list[_Item]) -> list[str]:
    return [item.nodeid for item in items]


def test_costlier_modules_come_first_and_each_keeps_its_own_order() -> None:
    items = [
        _Item("tests/a.py::test_1"),
        _Item("tests/b.py::test_1", _Mark({"seconds": 10})),
        _Item("tests/a.py::test_2", _Mark({"seconds": 30})),
        _Item("tests/c.py::test_1", _Mark({"seconds": 20})),
        _Item("tests/b.py::test_2", _Mark({"seconds": 15})),
        _Item("tests/d.py::test_1"),
    ]
    assert _ids(heaviest_modules_first(items)) == [
        "tests/a.py::test_1",  # a: 30 s, its tests in their order
        "tests/a.py::test_2",
        "tests/b.py::test_1",  # b: 10 + 15 = 25 s, gathered although collected apart
        "tests/b.py::test_2",
        "tests/c.py::test_1",  # c: 20 s
        "tests/d.py::test_1",  # d: nothing slow
    ]


def test_equal_costs_keep_the_collection_order_and_an_unhinted_slow_mark_counts_a_little() -> None:
    items = [
        _Item("tests/x.py::test_1"),
        _Item("tests/y.py::test_1"),
        _Item("tests/z.py::test_1", _Mark()),
    ]
    assert expected_seconds(items[2]) == UNHINTED_SLOW_S > 0
    assert _ids(heaviest_modules_first(items)) == ["tests/z.py::test_1", "tests/x.py::test_1", "tests/y.py::test_1"]
    assert module_of(_Item("tests/x.py::Class::test[a::b]")) == "tests/x.py"


@pytest.mark.parametrize("bad", [-1, "60", True, None])
def test_a_hint_that_is_not_a_number_of_seconds_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match=r"tests/x.py::test_1: slow\(seconds=\.\.\.\) must be a number"):
        expected_seconds(_Item("tests/x.py::test_1", _Mark({"seconds": bad})))


def test_this_session_runs_its_modules_costliest_first(request: pytest.FixtureRequest) -> None:
    """The hook is wired: sorting this session's items again changes nothing (collected in file order, the cheap
    tests/benchmarks modules would come before the whole cycles). Under xdist each worker collects the whole suite."""
    items = request.session.items
    assert [item.nodeid for item in heaviest_modules_first(items)] == [item.nodeid for item in items]
