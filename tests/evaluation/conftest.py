"""Fixtures of the evaluation tests (the stand-ins live in tests/evaluation/fakes.py)."""

from tests.evaluation.fakes import eval_env_fixture  # noqa: F401
