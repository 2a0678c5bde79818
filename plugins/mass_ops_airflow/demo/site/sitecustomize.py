"""Interpreter hook of the demo UI's Airflow processes (this folder is first on their PYTHONPATH): Airflow's log
servers bind to 127.0.0.1 (`mass_ops_airflow.demo.loopback`). A failure is printed, never silent."""

import sys

try:
    from mass_ops_airflow.demo.loopback import install

    install()
except Exception as exc:  # pragma: no cover - reported, never expected
    print(f"mass-ops demo: log servers not kept on 127.0.0.1: {type(exc).__name__}: {exc}", file=sys.stderr)
