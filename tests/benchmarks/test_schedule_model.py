"""The ideal list schedule of `benchmarks/schedule_model.py`, on cases small enough to work out by hand."""

from __future__ import annotations

import pytest

from benchmarks.schedule_model import Calls, schedule

NO_CALLS = Calls(judge=0.0, optimizer=0.0, matches=0)


def test_one_chain_on_one_slot_takes_the_sum_of_its_parts():
    # reference 1, v0 2, proposal 0.5; v1 3 + two judge calls 0.25 each, proposal 0.5; v2 4 + two judge calls
    search = [1.0, 2.0, 3.0, 4.0]
    run = schedule({7: (search, [])}, Calls(judge=0.25, optimizer=0.5, matches=0), 1, lambda *_: 0.0)
    assert run.wall == pytest.approx(1 + 2 + 0.5 + 3 + 0.5 + 0.5 + 4 + 0.5)
    assert run.work == pytest.approx(run.wall)
    assert run.utilisation == pytest.approx(1.0)


def test_the_reference_and_v0_run_side_by_side_given_two_slots():
    run = schedule({7: ([1.0, 2.0, 3.0], [])}, NO_CALLS, 2, lambda *_: 0.0)
    assert run.wall == pytest.approx(2 + 3)
    assert run.utilisation == pytest.approx(6 / (2 * 5))


def test_starting_the_long_candidate_last_leaves_it_alone_at_the_end():
    # 16 candidates of 1 s and one of 10 s on 4 slots after a 1 s search; 16 s of short work fills 4 slots for 4 s
    search = [0.5, 0.5, 0.0]  # reference ∥ v0 (0.5 s), then v1 of 0 s: the search ends at 0.5 s
    candidates = [1.0] * 16 + [10.0]
    first = schedule({1: (search, candidates)}, NO_CALLS, 4, lambda _task, _index, seconds: -seconds)
    last = schedule({1: (search, candidates)}, NO_CALLS, 4, lambda _task, _index, seconds: seconds)
    assert first.wall == pytest.approx(0.5 + 10)  # the short ones fit beside it on the other three slots
    assert last.wall == pytest.approx(0.5 + 4 + 10)
    assert first.utilisation > last.utilisation


def test_search_work_goes_before_waiting_candidates_and_ranking_follows_the_last_candidate():
    ends: dict[tuple[int, str], float] = {}
    fast, slow = [0.5, 0.5, 0.0], [0.5, 0.5, 3.0]
    calls = Calls(judge=1.0, optimizer=0.0, matches=2)
    schedule(
        {1: (fast, [5.0, 5.0]), 2: (slow, [1.0])},
        calls,
        2,
        lambda *_: 0.0,
        on_phase=lambda task, phase, at: ends.setdefault((task, phase), at),
    )
    # 0–0.5 task 1's reference ∥ v0; 0.5–1 task 2's (an earlier version than task 1's v1: more urgent); task 1's
    # v1 (0 s) and its two judge calls end at 3; task 2's v1 runs 1–4, then its judge calls 4–6 go before task 1's
    # second candidate, which waits from 3 to 6
    assert ends[(1, "search")] == pytest.approx(3.0)
    assert ends[(2, "search")] == pytest.approx(6.0)
    assert ends[(1, "collection")] == pytest.approx(6 + 5)
    assert ends[(1, "ranking")] == pytest.approx(ends[(1, "collection")] + 1)  # two matches side by side


def test_a_search_without_iterations_goes_from_v0_to_collection_and_a_ranking_without_matches_ends_at_once():
    ends: dict[tuple[int, str], float] = {}
    schedule(
        {1: ([1.0, 2.0], [3.0])},
        NO_CALLS,
        2,
        lambda *_: 0.0,
        on_phase=lambda task, phase, at: ends.setdefault((task, phase), at),
    )
    assert ends == {(1, "search"): 2.0, (1, "collection"): 5.0, (1, "ranking"): 5.0}


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        schedule({1: ([1.0, 1.0, 1.0], [])}, NO_CALLS, 0, lambda *_: 0.0)
