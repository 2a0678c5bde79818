"""The mass-ops Airflow plugin, found by Airflow's plugins manager through this package's `airflow.plugins` entry
point (plugins/pyproject.toml); nothing goes into the deployment's plugins folder.

- `fastapi_apps`: the cycle reports under `/mass-ops` (`mass_ops_airflow.report_app`, authenticated). Built on
  first access and only the API server reads it, so the workers and the DAG processor, which load plugins too,
  never import FastAPI or Airflow's API security because of it.
- `operator_extra_links`: the 'Cycle report' link, registered as Airflow's docs ask. It is declared on
  `ReportOperator` and computed on the worker (stored in XCom, shown by the UI from there). `ReportLink.operators`
  stays empty on purpose: a plugin link bound to an operator class replaces the stored one when the API server
  loads the DAG, and its `get_link` would then run there, where the task's XCom is not read the way a worker reads it.
"""

from __future__ import annotations

import functools
from typing import Any

from airflow.sdk.plugins_manager import AirflowPlugin

from mass_ops_airflow.operators.report import ReportLink
from mass_ops_airflow.reports import URL_PREFIX


@functools.cache
def reports_app() -> dict[str, Any]:
    """The reports app as Airflow mounts it: `{"app", "url_prefix", "name"}` (built once per process)."""
    from mass_ops_airflow.report_app import create_app

    return {"app": create_app(), "url_prefix": URL_PREFIX, "name": "mass-ops reports"}


class MassOpsPlugin(AirflowPlugin):
    """Serves the cycle reports and links them from the report tasks."""

    name = "mass_ops"
    operator_extra_links = [ReportLink()]  # noqa: RUF012  (AirflowPlugin's own attributes are plain lists)

    @property
    def fastapi_apps(self) -> list[Any]:  # type: ignore[override]
        return [reports_app()]
