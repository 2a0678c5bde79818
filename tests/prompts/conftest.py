"""Prompt tests install prompt sets process-wide (as `open_cycle` does); each test leaves the shipped set in place."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mass_ops.prompts import use_prompts


@pytest.fixture(autouse=True)
def shipped_prompts_afterwards() -> Iterator[None]:
    yield
    use_prompts(None)
