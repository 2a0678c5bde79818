"""Fixtures of the episode-runtime tests that other folders use too (tests/runtime, tests/cost), built from
`tests.support.runtime`. A folder's conftest imports the ones it wants; test modules never import fixtures.

- `policy_host` (module): policy stand-in servers on one background event loop.
- `qwen_install` (session): the real pinned qwen-code; skips where npm and a cached runtime are both missing.
- `stand_in_install`, `hostile_install` (session): the light and the hostile stand-in agents, launched as qwen-code.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mass_ops.runtime.qwen_install import QwenInstall, default_runtime_dir, ensure_qwen_code
from tests.policy_server import EventLoopThread
from tests.support.runtime import HOSTILE_AGENT, STAND_IN_AGENT, PolicyHost


@pytest.fixture(scope="module")
def policy_host() -> Iterator[PolicyHost]:
    with EventLoopThread() as loop:
        yield PolicyHost(loop)


@pytest.fixture(scope="session")
def qwen_install() -> QwenInstall:
    """The real pinned qwen-code (installed once into the shared runtime folder)."""
    if shutil.which("npm") is None and not (default_runtime_dir() / "qwen").exists():
        pytest.skip("npm is not installed and no qwen-code runtime is cached")
    return ensure_qwen_code()


@pytest.fixture(scope="session")
def stand_in_install() -> QwenInstall:
    """The light stand-in agent, launched the way qwen-code is."""
    return QwenInstall(node_bin=Path(sys.executable), qwen_entry=STAND_IN_AGENT, version="stand-in")


@pytest.fixture(scope="session")
def hostile_install() -> QwenInstall:
    """The hostile stand-in agent (`hostile_agent.py`: runs the attack in its prompt), launched the way qwen-code is."""
    return QwenInstall(node_bin=Path(sys.executable), qwen_entry=HOSTILE_AGENT, version="hostile")
