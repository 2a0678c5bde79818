"""Fixtures of the episode-runtime tests: the policy stand-in on a background loop, the real pinned qwen-code, and the
light and hostile stand-in agents (defined in `tests.support.runtime_fixtures`; helpers in `tests.support.runtime`)."""

from __future__ import annotations

from tests.support.runtime_fixtures import hostile_install, policy_host, qwen_install, stand_in_install

__all__ = ["hostile_install", "policy_host", "qwen_install", "stand_in_install"]
