"""One task's teacher collection as one task instance: its candidates' episodes, then the `collect_task` stage.

Contract: clearing the task instance reruns only the candidates that are not final (every recorded episode is
reused). A task searched only, or whose collection decision is "skip", is skipped with the reason. Local: the stage
runs the candidates itself and raises `CollectionIncompleteError` while some ended in infrastructure failures.
Kubernetes: one sandbox pod per unrecorded candidate, at most `inference.max_concurrent_requests` at once, each
admitted against the task's and the cycle's budgets; every pod is deleted once it ended, failures carry log tails,
then every candidate must be recorded final before the stage runs. A budget stop creates no further pod and fails
without retry. Why one task instance per task, and the pod loop: docs/kubernetes.md
(`mass_ops_airflow.operators.collection`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from mass_ops_airflow.cycle import cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from mass_ops.compute.kubernetes import EpisodeSpec
    from mass_ops.compute.limits import EndpointSlots
    from mass_ops.config import CycleConfig
    from mass_ops_airflow.kube import MassKubeHook

STAGE = "collect_task"


class CollectionPodsFailed(AirflowException):
    """Some candidates' pods failed or could not start; the message carries each one's reason and log tails."""


@dataclass
class _Pod:
    """A candidate's pod this try is responsible for (created, or re-attached from an earlier try)."""

    slug: str
    manifest: dict[str, Any]
    episode: EpisodeSpec
    created: bool = False

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def containers(self) -> list[str]:
        return [str(c["name"]) for c in self.manifest["spec"]["containers"]]


class TaskCollectionOperator(BaseOperator):
    """Every teacher candidate of one task, then the `collect_task` stage (see the module docstring).

    :param task: the task id (templated: the mapped inner-loop group passes it from XCom).
    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param poll_interval_s: seconds between pod status reads on the Kubernetes backend.
    """

    template_fields: Sequence[str] = ("task",)
    ui_color = "#fef5e7"

    def __init__(
        self,
        *,
        task: int | str,
        kubernetes_conn_id: str | None = None,
        poll_interval_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.task = task
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval_s = poll_interval_s
        self._pods: dict[str, _Pod] = {}
        self._namespace: str | None = None
        self._kube: MassKubeHook | None = None
        self._config: CycleConfig | None = None
        self._slots: EndpointSlots | None = None  # held by the pods in `_pods`

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from mass_ops.compute.backend import backend_for
        from mass_ops_airflow.cycle import call_stage

        config = cycle_config(context["params"])
        task_no = int(self.task)
        label = f"collection-t{task_no} ({config.collection.candidates} candidates)"
        context["unit_label"] = label  # type: ignore[typeddict-unknown-key]  # map_index_template
        if task_no not in config.tasks.train:
            raise AirflowSkipException(f"task {task_no} is searched only (not in tasks.train): no teacher collection")
        backend = backend_for(config)
        if not backend.runs_in_process:  # else the stage runs the candidates in its own episode pool
            self._run_pods(config, task_no)
        result = call_stage(STAGE, config, task_no)
        if isinstance(result, dict) and result.get("decision") == "skip":
            raise AirflowSkipException(f"task {task_no}: {result.get('reason')}")
        return {"backend": backend.name, "task": task_no, "result": result}

    # -- Kubernetes -----------------------------------------------------------------------------------------------

    @staticmethod
    def candidates(config: CycleConfig, task_no: int) -> list[EpisodeSpec]:
        """The identities of the task's teacher candidates (`collection.candidates` of them)."""
        from mass_ops.compute.kubernetes import EpisodeSpec

        return [
            EpisodeSpec(kind="collection", task_id=task_no, candidate=candidate)
            for candidate in range(config.collection.candidates)
        ]

    @staticmethod
    def _recorded(config: CycleConfig, episode: EpisodeSpec) -> bool:
        from mass_ops_airflow.checks import StageOutputMissing, episode_recorded

        try:
            episode_recorded(config, episode)
        except StageOutputMissing:
            return False
        return True

    def _run_pods(self, config: CycleConfig, task_no: int) -> None:
        from mass_ops.compute.backend import backend_for, to_launch
        from mass_ops.errors import InputError
        from mass_ops_airflow.checks import StageOutputMissing
        from mass_ops_airflow.operators.episode import EpisodePodOperator

        candidates = self.candidates(config, task_no)
        pending = [episode for episode in candidates if not self._recorded(config, episode)]
        if not pending:
            self.log.info("Every candidate of task %s is recorded: no pod", task_no)
            return
        try:
            bound = [EpisodePodOperator.bound_episode(config, episode) for episode in pending]
        except InputError as exc:
            # No request for this task's candidates: its collection decision is "skip", or its search has not
            # retained a workflow, or its teacher prompt changed. The stage that follows says which, and it runs no
            # episode in any of these cases (it stops on the same task-level check first).
            self.log.info("No candidate pod for task %s: %s", task_no, exc)
            return
        backend = backend_for(config)
        pods = [_Pod(e.slug, to_launch(backend.episode_pod(config, e), f"candidate {e.slug}"), e) for e in bound]
        failures, budget_stop = self._run_all(config, pods)
        if budget_stop is not None:
            raise EpisodePodOperator.budget_failure(
                f"task {task_no}: {budget_stop}" + (f"; also {len(failures)} pod(s) failed" if failures else "")
            )
        if failures:
            raise CollectionPodsFailed(
                f"task {task_no}: {len(failures)} of {len(pods)} candidate pod(s) failed; the others are "
                "recorded and are reused when this task instance is cleared\n" + "\n".join(failures)
            )
        missing = [episode.slug for episode in candidates if not self._recorded(config, episode)]
        if missing:
            raise StageOutputMissing(
                f"task {task_no}: the pods exited 0 but these candidates have no final episode recorded: "
                f"{', '.join(missing)}"
            )

    def _run_all(self, config: CycleConfig, pods: list[_Pod]) -> tuple[list[str], str | None]:
        """Run the pods, at most `inference.max_concurrent_requests` at once (one endpoint slot each): (the failures'
        reports, the budget stop's one line or None). A budget stop starts no further pod; the running ones finish."""
        from mass_ops.compute.limits import EndpointSlots
        from mass_ops_airflow.kube import MassKubeHook
        from mass_ops_airflow.operators.episode import EpisodePodOperator

        self._kube = MassKubeHook(self.kubernetes_conn_id)
        self._namespace = config.compute.kubernetes.namespace
        self._config = config
        self._slots = slots = EndpointSlots.of(config)
        startup_s = config.compute.kubernetes.startup_timeout_s
        queue = list(pods)
        failures: list[str] = []
        budget_stop: str | None = None
        try:
            while queue or self._pods:
                while queue and slots.try_acquire():
                    pod = queue.pop(0)
                    stop = None if self._read(pod.name) is not None else EpisodePodOperator.admit(config, pod.episode)
                    if stop is not None:  # recorded budget_exhausted (not started); launch nothing more
                        slots.release()
                        budget_stop = f"candidate {pod.slug}: no pod created: {stop['message']}"
                        self.log.error("%s", budget_stop)
                        queue.clear()
                        break
                    self._pods[pod.name] = pod
                for pod in list(self._pods.values()):
                    if not pod.created:
                        pod.created = self._start(pod)
                        continue  # read it back on the next round
                    verdict = self._verdict(pod, startup_s)
                    if verdict is None:
                        continue
                    if verdict:
                        failures.append(verdict)
                        self.log.error("%s", verdict)
                        self._end_lease(pod)  # no publisher is left to end it
                    else:
                        self.log.info("Candidate %s: pod %s succeeded", pod.slug, pod.name)
                    self._delete(pod.name)
                    self._forget(pod.name)
                if queue or self._pods:
                    self._sleep()
        finally:
            self._delete_all()  # a failure or kill in the middle leaves no pod behind
        return failures, budget_stop

    def _sleep(self) -> None:
        time.sleep(self.poll_interval_s)

    def _start(self, pod: _Pod) -> bool:
        """Create the pod, or re-attach to one of its name still working from an earlier try (names are the
        episode's: deterministic). A finished left-over is deleted first; False while it is still going away."""
        existing = self._read(pod.name)
        if existing is not None:
            phase = getattr(existing.status, "phase", None)
            if phase in ("Pending", "Running"):
                self.log.info("Candidate %s: re-attached to pod %s (%s)", pod.slug, pod.name, phase)
                return True
            self._delete(pod.name)
        if self._config is not None:  # `status` shows the candidate running from its pod's creation on
            from mass_ops_airflow.operators.episode import EpisodePodOperator

            EpisodePodOperator.lease(self._config, pod.episode, pod.name)
        try:
            self._hook.start_pod(pod.manifest)
        except Exception as exc:
            if getattr(exc, "status", None) == 409:  # the left-over is still terminating: try again next round
                return False
            raise
        self.log.info("Candidate %s: created pod %s", pod.slug, pod.name)
        return True

    @property
    def _hook(self) -> MassKubeHook:
        assert self._kube is not None, "set by _run_all"
        return self._kube

    def _read(self, name: str) -> Any:
        return self._hook.read_pod(name, str(self._namespace))

    def _verdict(self, pod: _Pod, startup_s: float) -> str | None:
        """None while the pod runs; "" when it succeeded; else why it failed, with its containers' log tails."""
        from mass_ops_airflow.kube import pod_problem

        remote = self._read(pod.name)
        if remote is None:
            return f"candidate {pod.slug}: pod {pod.name} disappeared before it finished"
        phase = getattr(remote.status, "phase", None)
        if phase == "Succeeded":
            return ""
        if phase == "Failed":
            reason = getattr(remote.status, "reason", None) or getattr(remote.status, "message", None) or "Failed"
            return self._report(pod, f"pod {pod.name} failed ({reason})")
        problem = pod_problem(remote, schedule_timeout_s=startup_s)
        if problem:
            return self._report(pod, problem)
        return None

    def _report(self, pod: _Pod, why: str) -> str:
        from mass_ops_airflow.kube import LOG_TAIL_LINES

        lines = [f"candidate {pod.slug}: {why}"]
        for container in pod.containers:
            tail = self._hook.log_tail(pod.name, str(self._namespace), container=container)
            lines.append(f"last {LOG_TAIL_LINES} lines of the pod's log, container {container}:\n{tail}")
        return "\n".join(lines)

    def _delete(self, name: str) -> None:
        self._hook.delete_pod(name, str(self._namespace))

    def _delete_all(self) -> None:
        """Delete the pods still in flight (a kill, or an error while waiting) and end their leases."""
        for name, pod in list(self._pods.items()):
            try:
                self._delete(name)
            except Exception:  # keep deleting the others; the error is in the log
                self.log.exception("Could not delete pod %s", name)
            if pod.created:
                self._end_lease(pod)
            self._forget(name)

    def _forget(self, name: str) -> None:
        """`name`'s pod is no longer this task's: its endpoint slot is free again."""
        if self._pods.pop(name, None) is not None and self._slots is not None:
            self._slots.release()

    def _end_lease(self, pod: _Pod) -> None:
        if self._config is not None:
            from mass_ops_airflow.operators.episode import EpisodePodOperator

            EpisodePodOperator.end_lease(self._config, pod.episode)

    def on_kill(self) -> None:
        if self._kube is not None:
            self._delete_all()
