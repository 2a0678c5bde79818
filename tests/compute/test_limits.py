"""The endpoint's concurrency limit shared by the episode pool, ranking and the collection operator."""

from __future__ import annotations

import threading

import pytest

from mass_ops.compute.limits import EndpointSlots
from mass_ops.config import load_config


def test_slots_are_taken_up_to_the_capacity_and_given_back():
    slots = EndpointSlots(2)
    assert slots.try_acquire() and slots.try_acquire()
    assert not slots.try_acquire() and slots.in_use == 2 and slots.free == 0
    slots.release()
    assert slots.free == 1 and slots.try_acquire()
    assert slots.peak == 2
    slots.release()
    slots.release()
    with pytest.raises(ValueError, match="never acquired"):
        slots.release()


def test_capacity_comes_from_the_config_and_must_be_positive():
    config = load_config("demo", ["inference.max_concurrent_requests=3"])
    assert EndpointSlots.of(config).capacity == 3
    with pytest.raises(ValueError, match="≥ 1"):
        EndpointSlots(0)


def test_workers_are_bounded_by_the_capacity():
    slots = EndpointSlots(4)
    assert [slots.workers(n) for n in (0, 1, 3, 4, 9)] == [1, 1, 3, 4, 4]


def test_concurrent_acquires_never_exceed_the_capacity():
    slots = EndpointSlots(3)
    granted: list[bool] = []
    lock = threading.Lock()

    def take() -> None:
        got = slots.try_acquire()
        with lock:
            granted.append(got)

    threads = [threading.Thread(target=take) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == 3 and slots.peak == 3
