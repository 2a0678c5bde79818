"""The endpoint's concurrency limit: at most `inference.max_concurrent_requests` units use the server at once.

One limiter for every place that runs units against the inference endpoint side by side: the local episode pool
(whose fair scheduler decides *who* gets a freed slot), the ranking stage's concurrent judge calls, and the
collection operator's episode pods. Contract: `try_acquire` takes a slot without waiting (False when all are in
use), `release` gives one back, `workers(n)` is how many threads n units need; thread-safe; `peak` is the most
slots ever held at once.
"""

from __future__ import annotations

import threading

from mass_ops.config import CycleConfig


class EndpointSlots:
    """`capacity` slots of the inference endpoint (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"episode pool capacity must be ≥ 1 (got {capacity})")
        self.capacity = capacity
        self.peak = 0
        self._in_use = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, config: CycleConfig) -> EndpointSlots:
        """The slots of the cycle's endpoint (`inference.max_concurrent_requests`)."""
        return cls(config.inference.max_concurrent_requests)

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def free(self) -> int:
        return self.capacity - self._in_use

    def try_acquire(self) -> bool:
        """Take a slot when one is free; never waits."""
        with self._lock:
            if self._in_use >= self.capacity:
                return False
            self._in_use += 1
            self.peak = max(self.peak, self._in_use)
            return True

    def release(self) -> None:
        """Give a slot back (ValueError when none is held: a release without its acquire is a bug)."""
        with self._lock:
            if self._in_use == 0:
                raise ValueError("released a slot that was never acquired")
            self._in_use -= 1

    def workers(self, units: int) -> int:
        """How many threads run `units` units within the limit (at least one)."""
        return max(1, min(units, self.capacity))
