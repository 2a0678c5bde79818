"""Point Airflow at a throw-away home before anything imports it (shared by tests/plugins and tests/dags).

Airflow reads AIRFLOW_HOME and its config once, at first import; the conftest files import this module at
collection time, so every test of these packages sees a temporary home with a SQLite database path, the repository's
DAG folder and no example DAGs. Nothing here migrates the database: the tests that need one do it once per session.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DAGS_FOLDER = REPO_ROOT / "dags"

if "airflow" not in sys.modules:
    _home = Path(tempfile.mkdtemp(prefix="mass-ops-airflow-"))
    os.environ["AIRFLOW_HOME"] = str(_home)
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_home / 'airflow.db'}"
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS_FOLDER)
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"

# Variables through which this machine's cluster settings or storage could leak into the operators' defaults;
# the conftest files clear them for each test (and only for these tests).
HOST_VARIABLES = ("MASS_SETTINGS_DIR", "MASS_METADATA_URL", "MASS_ARTIFACT_URL", "MASS_DEFAULT_PRESET")
