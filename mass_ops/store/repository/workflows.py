"""The RHI search's records: each task's workflow versions and the workflow retained at the end."""

from __future__ import annotations

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    RepositoryBase,
    TaskId,
    _task,
)
from mass_ops.store.schema import (
    RetainedWorkflow,
    WorkflowVersion,
)


class WorkflowRecords(RepositoryBase):
    """Rows of `workflow_versions` and `retained_workflows`."""

    def record_workflow_version(
        self,
        cycle_id: int,
        task_id: TaskId,
        version: int,
        *,
        design: str,
        parent_version: int | None = None,
        diff: str | None = None,
        prompt_uri: str | None = None,
        prompt_sha256: str | None = None,
        proposal_call_id: int | None = None,
    ) -> WorkflowVersion:
        """Version `version` of a task's design. A different design under the same version is a UnitConflictError."""
        key = {"cycle_id": cycle_id, "task_id": _task(task_id), "version": version}
        values = {
            "design": design,
            "parent_version": parent_version,
            "diff": diff,
            "prompt_uri": prompt_uri,
            "prompt_sha256": prompt_sha256,
            "proposal_call_id": proposal_call_id,
        }
        return self._record(WorkflowVersion, key, values, must_match=("design", "prompt_sha256"))

    def workflow_versions(self, cycle_id: int, task_id: TaskId) -> list[WorkflowVersion]:
        """All versions of a task's design, v0 first."""
        return self._all(
            sa.select(WorkflowVersion)
            .where(WorkflowVersion.cycle_id == cycle_id, WorkflowVersion.task_id == _task(task_id))
            .order_by(WorkflowVersion.version)
        )

    def cycle_workflow_versions(self, cycle_id: int) -> list[WorkflowVersion]:
        """Every workflow version of a cycle, all tasks, in the order they were recorded."""
        return self._all(
            sa.select(WorkflowVersion).where(WorkflowVersion.cycle_id == cycle_id).order_by(WorkflowVersion.id)
        )

    def record_retained_workflow(
        self,
        cycle_id: int,
        task_id: TaskId,
        *,
        version: int | None,
        beats_reference: bool,
        last_evaluated_version: int,
        model: str | None = None,
    ) -> RetainedWorkflow:
        """The outcome of a task's search; `version` None means no version beat the reference."""
        key = {"cycle_id": cycle_id, "task_id": _task(task_id)}
        values = {
            "version": version,
            "beats_reference": beats_reference,
            "last_evaluated_version": last_evaluated_version,
            "model": model,
        }
        return self._record(RetainedWorkflow, key, values, must_match=("version", "beats_reference"))

    def retained_workflows(self, cycle_id: int) -> list[RetainedWorkflow]:
        return self._all(
            sa.select(RetainedWorkflow).where(RetainedWorkflow.cycle_id == cycle_id).order_by(RetainedWorkflow.id)
        )
