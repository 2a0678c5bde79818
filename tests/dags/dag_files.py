"""Load the repository's DAG files the way tests need them (as modules, and through Airflow's DagBag)."""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType

from tests.plugins.airflow_env import DAGS_FOLDER

KNOWN_POOLS = {"default_pool", "mass_inference", "mass_gpu"}


def fresh_dag_module(name: str) -> ModuleType:
    """Execute `dags/<name>.py` anew (a test may change its tasks without touching other tests' DAG)."""
    spec = importlib.util.spec_from_file_location(f"dag_under_test_{name}", DAGS_FOLDER / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def dag_module(name: str) -> ModuleType:
    """`dags/<name>.py` executed once per session and shared (read-only use)."""
    return fresh_dag_module(name)
