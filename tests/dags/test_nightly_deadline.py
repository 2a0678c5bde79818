"""The nightly re-evaluation's deadline alert: the DAG carries an Airflow `DeadlineAlert` counted from the queue time
(6 h by default, `MASS_NIGHTLY_DEADLINE_HOURS`), Airflow's serializer keeps it, and the callback runs through Airflow's
own `CallbackTrigger` (what the triggerer runs for a missed deadline) and logs one line."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest
from mass_ops_airflow import alerts

from tests.dags.dag_files import fresh_dag_module


def test_the_nightly_dag_has_a_deadline_from_the_queue_time(monkeypatch):
    from airflow.sdk import AsyncCallback, DeadlineReference
    from airflow.serialization.serialized_objects import DagSerialization

    monkeypatch.delenv(alerts.NIGHTLY_DEADLINE_ENV, raising=False)
    dag = fresh_dag_module("mass_nightly_eval").dag
    (alert,) = dag.deadline if isinstance(dag.deadline, list) else [dag.deadline]
    assert alert.reference == DeadlineReference.DAGRUN_QUEUED_AT, "a backfilled night must not miss at creation"
    assert alert.interval == dt.timedelta(hours=6)
    assert isinstance(alert.callback, AsyncCallback) and alert.callback.path == alerts.CALLBACK_PATH
    # What the scheduler reads: the serialized DAG's deadline (reference, interval in seconds, callback path).
    (kept,) = DagSerialization.serialize_dag(dag)["deadline"]
    assert kept["reference"] == {"reference_type": "DagRunQueuedAtDeadline"}
    assert kept["interval"]["__data__"] == 6 * 3600
    assert kept["callback"]["__data__"]["path"] == alerts.CALLBACK_PATH


def test_the_deadline_is_a_deployment_setting(monkeypatch):
    monkeypatch.setenv(alerts.NIGHTLY_DEADLINE_ENV, "1.5")
    dag = fresh_dag_module("mass_nightly_eval").dag
    (alert,) = dag.deadline if isinstance(dag.deadline, list) else [dag.deadline]
    assert alert.interval == dt.timedelta(minutes=90)
    monkeypatch.setenv(alerts.NIGHTLY_DEADLINE_ENV, "0")
    assert not fresh_dag_module("mass_nightly_eval").dag.deadline, "0 turns the alert off"
    monkeypatch.setenv(alerts.NIGHTLY_DEADLINE_ENV, "soon")
    with pytest.raises(ValueError, match=r"^MASS_NIGHTLY_DEADLINE_HOURS='soon': must be a number of hours >= 0"):
        fresh_dag_module("mass_nightly_eval")


def test_a_missed_deadline_runs_the_callback_through_airflow_s_callback_trigger(caplog):
    from airflow.triggers.callback import CallbackTrigger

    context = {
        "dag_run": {"dag_id": "mass_nightly_eval", "dag_run_id": "scheduled__2026-11-30T03:00:00+00:00",
                    "queued_at": "2026-11-30T03:00:05+00:00"},
        "deadline": {"id": "d-1", "deadline_time": "2026-11-30T09:00:05+00:00"},
    }  # fmt: skip
    trigger = CallbackTrigger(callback_path=alerts.CALLBACK_PATH, callback_kwargs={"context": context})

    async def events() -> list:
        return [event async for event in trigger.run()]

    with caplog.at_level(logging.ERROR, logger="mass_ops_airflow.alerts"):
        fired = asyncio.run(events())
    expected = (
        "deadline missed: mass_nightly_eval run scheduled__2026-11-30T03:00:00+00:00 (queued 2026-11-30T03:00:05+00:00)"
        " was not finished by 2026-11-30T09:00:05+00:00; its unfinished tasks are in the Airflow UI (a long "
        "evaluation, a stuck model server or a full pool)"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "mass_ops_airflow.alerts"] == [expected]
    assert fired and "success" in str(fired[-1].payload).lower(), fired
