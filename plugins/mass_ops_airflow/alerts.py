"""Deadline alerts of the nightly re-evaluation (Airflow 3.1+ `DeadlineAlert` on the DAG).

A nightly run must finish within `MASS_NIGHTLY_DEADLINE_HOURS` (default 6) of being queued; when it has not, Airflow's
scheduler marks the deadline missed and the triggerer awaits `nightly_deadline_missed`, which logs one error line
naming the run, its deadline and where to look. The interval is read when the DAG file is parsed (a deployment
setting, like the pools); ``0`` turns the alert off. Counting from the queue time, not the logical date, keeps a
backfill of past nights from missing its deadline the moment it is created. Airflow 3.3.2's `dag.test()` (and so
`airflow dags test`) fails as a run with a deadline succeeds; set the variable to 0 for it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Mapping
from typing import Any

NIGHTLY_DEADLINE_ENV = "MASS_NIGHTLY_DEADLINE_HOURS"
DEFAULT_NIGHTLY_DEADLINE_HOURS = 6.0
CALLBACK_PATH = "mass_ops_airflow.alerts.nightly_deadline_missed"

logger = logging.getLogger(__name__)


def nightly_deadline_interval(environ: Mapping[str, str] | None = None) -> dt.timedelta | None:
    """How long after being queued a nightly run must be done (None: no deadline); ValueError in one line for a
    value that is not a non-negative number of hours."""
    raw = (os.environ if environ is None else environ).get(NIGHTLY_DEADLINE_ENV, "").strip()
    if not raw:
        return dt.timedelta(hours=DEFAULT_NIGHTLY_DEADLINE_HOURS)
    try:
        hours = float(raw)
    except ValueError:
        hours = -1.0
    if not hours >= 0 or hours == float("inf"):
        raise ValueError(f"{NIGHTLY_DEADLINE_ENV}={raw!r}: must be a number of hours >= 0 (0 = no deadline alert)")
    return dt.timedelta(hours=hours) if hours else None


def nightly_deadline(environ: Mapping[str, str] | None = None) -> Any:
    """The nightly DAG's `deadline=`: a `DeadlineAlert` from the queue time, or None when turned off."""
    interval = nightly_deadline_interval(environ)
    if interval is None:
        return None
    from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=interval,
        callback=AsyncCallback(CALLBACK_PATH),
        name="nightly evaluation finished",
    )


def deadline_message(context: Mapping[str, Any]) -> str:
    """The line a missed deadline logs: which run, its deadline and queue time, what to look at."""
    run = context.get("dag_run") or {}
    deadline = (context.get("deadline") or {}).get("deadline_time")
    return (
        f"deadline missed: {run.get('dag_id', 'mass_nightly_eval')} run {run.get('dag_run_id', '?')} "
        f"(queued {run.get('queued_at') or '?'}) was not finished by {deadline or '?'}; "
        "its unfinished tasks are in the Airflow UI (a long evaluation, a stuck model server or a full pool)"
    )


async def nightly_deadline_missed(context: Mapping[str, Any] | None = None, **_: Any) -> str:
    """The deadline's callback (run by the triggerer): log the miss as an error; returns the line."""
    message = deadline_message(context or {})
    logger.error(message)
    return message
