"""Repair a failed DAG run the way an operator does from the UI ("Clear" on the failed task, downstream included),
then let the run finish in this process.

`clear_failed` uses Airflow's own `clear_task_instances` on the failed and upstream-failed task instances, which puts
them (and the run) back to be scheduled. `finish_run` then drives that same run with the loop `dag.test()` uses —
Airflow's `DagRun.update_state` decides what is schedulable and `_run_task` runs each task instance in-process — since
`dag.test()` itself always starts by clearing every task of its logical date, which is not what a repair does.
"""

from __future__ import annotations

from typing import Any

MAX_IDLE_ROUNDS = 5


def _session() -> Any:
    from airflow import settings

    return settings.Session()


def _run(session: Any, dag_id: str, run_id: str) -> Any:
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    return session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))


def clear_failed(dag_id: str, run_id: str) -> list[str]:
    """Clear the run's failed and upstream-failed task instances; returns them as ``task_id[map_index]``."""
    from airflow.models.taskinstance import clear_task_instances
    from airflow.utils.state import DagRunState, TaskInstanceState

    session = _session()
    run = _run(session, dag_id, run_id)
    broken = {TaskInstanceState.FAILED, TaskInstanceState.UPSTREAM_FAILED}
    tis = [ti for ti in run.get_task_instances(session=session) if ti.state in broken]
    clear_task_instances(tis, session, dag_run_state=DagRunState.QUEUED)
    session.commit()
    return sorted(f"{ti.task_id}[{ti.map_index}]" for ti in tis)


def finish_run(dag: Any, run_id: str) -> Any:
    """Schedule and run the cleared task instances of `run_id` until the run is finished; returns the run."""
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import DagRunState, TaskInstanceState

    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    session = _session()
    run = _run(session, dag.dag_id, run_id)
    run.dag = scheduler_dag
    run.state = DagRunState.RUNNING
    session.commit()
    idle = 0
    while run.state == DagRunState.RUNNING:
        session.expire_all()
        schedulable, _ = run.update_state(session=session)
        for ti in schedulable:
            ti.try_number += 1
            ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        scheduled = [ti for ti in run.get_task_instances(session=session) if ti.state == TaskInstanceState.SCHEDULED]
        for ti in scheduled:
            _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
        idle = 0 if scheduled else idle + 1
        if idle > MAX_IDLE_ROUNDS:
            waiting = sorted(
                f"{ti.task_id}[{ti.map_index}]={ti.state}"
                for ti in run.get_task_instances(session=session)
                if ti.state not in (TaskInstanceState.SUCCESS, TaskInstanceState.SKIPPED)
            )
            raise AssertionError(f"run {run_id} is stuck while {run.state}: {', '.join(waiting)}")
    return run
