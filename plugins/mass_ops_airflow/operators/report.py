"""The report step of a DAG: write a cycle report, and link it from the task ("Cycle report").

`ReportOperator` calls a report stage of `mass_ops.stages.api` in-process (`report`: the run's cycle;
`nightly_report`: the cycle the nightly results are recorded under) and returns the stage's URIs to XCom with the
name of the reported cycle. `ReportLink` turns that name into the URL where the plugin's web app serves the page
(`mass_ops_airflow.reports`).

How Airflow 3 shows the link: when the task instance finishes, the task runner calls `get_link` on the worker and
stores the URL in XCom under the link's key; the UI reads it back from there. So `get_link` reads this task
instance's own return value, and a task that failed before returning has no link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink

from mass_ops_airflow.cycle import cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

RETURN_KEY = "return_value"


class ReportLink(BaseOperatorLink):
    """'Cycle report': the reported cycle's page on the Airflow API server (from the task's XCom `cycle`)."""

    name = "Cycle report"

    def get_link(self, operator: Any, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        from mass_ops_airflow.reports import ReportNameError, report_url

        result = XCom.get_value(ti_key=ti_key, key=RETURN_KEY)
        cycle = result.get("cycle") if isinstance(result, dict) else None
        if not isinstance(cycle, str):
            return ""
        try:
            return report_url(cycle)
        except ReportNameError:
            return ""  # a cycle name the web app would refuse: no link rather than a broken one


class ReportOperator(BaseOperator):
    """Write a cycle report through a `mass_ops.stages.api` report stage; the task carries the 'Cycle report' link.

    :param stage: `report` (the run's own cycle) or `nightly_report`; a stage that reports on a cycle other than
        the run's names it under `cycle` in its result.

    XCom: the stage's result (Markdown and HTML URIs, figure count) with `cycle`, the reported cycle's name.
    """

    operator_extra_links = (ReportLink(),)
    ui_color = "#eef3f7"

    def __init__(self, *, stage: str = "report", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops_airflow.cycle import StageResultError, call_stage

        config = cycle_config(context["params"])
        result = call_stage(self.stage, config)
        if not isinstance(result, dict):
            raise StageResultError(f"stage {self.stage} returned {type(result).__name__}, not the report's URIs")
        cycle = str(result.get("cycle") or config.cycle_name)
        self.log.info("Report of cycle %s: %s", cycle, result.get("html"))
        return {**result, "cycle": cycle}
