"""How many torch threads the streaming export passes compute with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def export_threads(lanes: int = 1) -> Iterator[int]:
    """For the block, cap torch's intra-op threads per computing thread at (CPUs this process may use − 1) / ``lanes``,
    but at least one; restore the caller's setting after. Yields the cap.

    Why: every chunk's arithmetic is a few passes over a few MiB, each ending in an OpenMP barrier where all workers
    wait for the slowest. With a worker on every CPU, one the scheduler lends to the kernel's page-cache copies
    (``pread``/``pwrite``, writeback) or to another process stalls all the others; on a small shared machine that
    made the passes several times slower than a single thread.
    """
    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, min(before, (cpus - 1) // lanes))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
