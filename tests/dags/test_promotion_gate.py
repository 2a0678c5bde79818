"""The promotion gate of the cycle DAG under Airflow's own `dag.test()`: with `promotion.require_approval` the run
parks in Airflow's human-in-the-loop approval (showing the evaluation headline) and `promote` does not run until a
person answers; the answer goes in the way Airflow's HITL REST endpoint records it (its model and event submit).
Without approval the gate is skipped (tests/dags/test_dag_runs.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.dags.dag_files import fresh_dag_module
from tests.dags.test_dag_runs import model_server, states

__all__ = ["model_server"]

HEADLINE = "L1 against L0: win rate 0.62, 95% interval 0.48 to 0.75 (Wilson).\n\nReport: /mass-ops/reports/demo-L0/"
WAIT_S = 600  # an upper bound for the run to reach the gate, never a measured duration


def _last_run_id() -> int:
    """The id of the newest run of any DAG in the test database (0 when there is none)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return int(session.scalar(select(func.max(DagRun.id))) or 0)


def _gate_instance(after_run: int) -> Any:
    """This test's approval task instance: the one of the cycle run created after run id `after_run` (the database
    is shared with the other DAG tests, whose runs skipped the gate)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        query = (
            select(TaskInstance)
            .join(DagRun, (DagRun.dag_id == TaskInstance.dag_id) & (DagRun.run_id == TaskInstance.run_id))
            .where(DagRun.id > after_run, TaskInstance.dag_id == "mass_cycle")
            .where(TaskInstance.task_id == "approve_promotion")
        )
        return session.scalars(query).first()


def _fail_runs_after(after_run: int) -> None:
    """End this test's run as failed, so `dag.test()` returns instead of waiting for an answer that will not come."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from sqlalchemy import update

    with create_session() as session:
        session.execute(update(DagRun).where(DagRun.id > after_run).values(state=DagRunState.FAILED))


def _respond(ti_id: Any, option: str) -> dict[str, Any]:
    """Answer the approval as Airflow's PATCH …/hitlDetails does: record the response on the HITL row and resume the
    parked task instance with the row's resume event."""
    from airflow._shared.timezones import timezone
    from airflow.models.hitl import HITLDetail
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import handle_event_submit
    from airflow.triggers.base import TriggerEvent
    from airflow.utils.session import create_session

    with create_session() as session:
        ti = session.get(TaskInstance, ti_id)
        detail = session.get(HITLDetail, ti_id)
        shown = {"subject": detail.subject, "body": detail.body, "options": list(detail.options)}
        detail.responded_by = {"id": "ops-1", "name": "ops-lead"}
        detail.responded_at = timezone.utcnow()
        detail.chosen_options = [option]
        detail.params_input = {}
        session.add(detail)
        handle_event_submit(TriggerEvent(detail.as_resume_event_payload()), task_instance=ti, session=session)
    return shown


@pytest.mark.slow(seconds=20)
def test_promote_waits_for_the_approval_which_shows_the_evaluation_headline(airflow_db, stages, model_server):
    stages.results.update(
        {
            "search_tasks": [51],
            "register": {"generation": "L1", "generation_id": 2},
            "rollout_units": [["L0", 51, 0], ["L1", 51, 0]],
            "promotion_request": {"required": True, "generation": "L1", "baseline": "L0", "headline": HEADLINE},
            "promote": {"generation": "L1", "generation_id": 2, "approval": "approved"},
        }
    )
    dag = fresh_dag_module("mass_cycle").dag
    for task in dag.tasks:
        task.retries = 0
    seen: dict[str, Any] = {}
    before = _last_run_id()

    def approver() -> None:
        """A person at the Required Actions page: waits for the parked approval, reads it, approves."""
        deadline = time.monotonic() + WAIT_S
        gate = _gate_instance(before)
        while (gate is None or gate.state != "awaiting_input") and time.monotonic() < deadline:
            if gate is not None and gate.state in ("upstream_failed", "failed", "skipped"):
                break
            time.sleep(0.5)
            gate = _gate_instance(before)
        seen["state"] = gate.state if gate is not None else None
        if seen["state"] != "awaiting_input":
            _fail_runs_after(before)
            return
        seen["before"] = list(stages.names())
        time.sleep(2)  # dag.test keeps polling the parked run meanwhile: still nothing may be promoted
        seen["still"] = list(stages.names())
        seen["shown"] = _respond(gate.id, "Approve")

    person = threading.Thread(target=approver, daemon=True)
    person.start()
    run = dag.test(run_conf={"preset": "demo"})  # the main thread: task timeouts use signals
    person.join(timeout=WAIT_S)
    assert seen["state"] == "awaiting_input", f"the run never parked at the gate: {states(run)}"
    assert "report" in seen["before"] and "promote" not in seen["before"], "nothing is promoted before an answer"
    assert "promote" not in seen["still"]
    assert seen["shown"] == {"subject": "Promote L1 over L0?", "body": HEADLINE, "options": ["Approve", "Reject"]}
    assert run.state == "success", states(run)
    assert stages.names()[-1] == "promote"
    assert [args[1:] for name, args in stages.calls if name == "promote"] == [("ops-lead",)], "who approved"
    counted = states(run)
    assert counted[("approve_promotion", "success")] == 1 and counted[("promote", "success")] == 1
