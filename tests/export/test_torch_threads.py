"""The export passes' torch thread cap: one CPU left for the kernel's page-cache copies, the caller's setting kept."""

from __future__ import annotations

import os

import pytest
import torch

from mass_ops.export.torch_threads import export_threads


def test_threads_are_capped_inside_and_restored_after_even_on_error():
    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(3)
        with pytest.raises(RuntimeError, match="boom"), export_threads() as used:
            assert used == torch.get_num_threads() == max(1, min(3, cpus - 1))
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 3
        with export_threads(lanes=2) as used:  # two computing threads share the CPUs
            assert used == torch.get_num_threads() == max(1, min(3, (cpus - 1) // 2))
        torch.set_num_threads(1)  # a caller that asked for one thread keeps one
        with export_threads() as used:
            assert used == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
