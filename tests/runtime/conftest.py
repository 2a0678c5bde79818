"""Fixtures of the episode-runtime tests: the policy stand-in on a background loop, the real pinned qwen-code, and the
light and hostile stand-in agents. Their helpers live in `tests.support.runtime`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mass_ops.runtime.qwen_install import QwenInstall, default_runtime_dir, ensure_qwen_code
from tests.policy_server import EventLoopThread
from tests.support.runtime import HOSTILE_AGENT, STAND_IN_AGENT, PolicyHost

# tests/cost and tests/llm still import these from here; they move to `tests.support.runtime` with those folders.
from tests.support.runtime import MODEL as MODEL
from tests.support.runtime import TASK as TASK
from tests.support.runtime import open_episode_cycle as open_episode_cycle
from tests.support.runtime import request as request
from tests.support.runtime import runner_environ as runner_environ


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
