"""Airflow's DagBag imports every DAG file with zero errors, and DAG files stay light to parse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dags.dag_files import KNOWN_POOLS
from tests.plugins.airflow_env import DAGS_FOLDER, REPO_ROOT


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    # known_pools makes the DagBag reject any task whose pool a deployment would not have.
    return DagBag(dag_folder=str(DAGS_FOLDER), known_pools=KNOWN_POOLS)


def test_every_dag_file_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == {"mass_cycle", "mass_nightly_eval", "mass_benchmarks"}
    assert dagbag.size() == 3


def test_every_task_has_an_owner_timeout_and_a_known_pool(dagbag):
    for dag in dagbag.dags.values():
        assert dag.tags and dag.doc_md
        for task in dag.tasks:
            assert task.owner == "mass-ops", task.task_id
            assert task.execution_timeout is not None, task.task_id
            assert task.pool in KNOWN_POOLS, task.task_id


PARSE_PROBE = """
import importlib.util, json, sys
import airflow.sdk
before = set(sys.modules)
for i, path in enumerate(sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"probe{i}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
print(json.dumps(sorted(set(sys.modules) - before)))
"""
HEAVY = ("kubernetes", "mass_ops.stages", "mass_ops.config", "torch", "transformers", "sqlalchemy.orm",
         "airflow.providers.cncf.kubernetes.operators", "airflow.models.dagrun")  # fmt: skip


def test_dag_files_import_nothing_heavy_at_parse_time():
    files = sorted(str(p) for p in DAGS_FOLDER.glob("*.py"))
    result = subprocess.run(
        [sys.executable, "-c", PARSE_PROBE, *files], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    heavy = sorted({m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)})
    assert heavy == [], f"DAG files import at parse time: {heavy}"
    assert "mass_ops_airflow.operators" in loaded, "the probe did parse the DAG files"
