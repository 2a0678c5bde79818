"""One episode per task instance: the sandbox pod the run's compute backend gives (`ComputeBackend.episode_pod`, on
Kubernetes), or nothing to launch when the backend runs episodes in process (local).

Contract (Kubernetes): the pod is created only for a request known here (prompt stored content-addressed, seed and
condition passed) and only when the ledger admits it (`admit`); otherwise none is: an unknown prompt fails, a budget
stop is recorded as a not-started `budget_exhausted` attempt and fails without retry. The unit's next attempt is
leased on the pod, so `mass-ops status` counts it in flight. The wait is deferred to the triggerer; a retry
re-attaches, a kill deletes the pod, a failure carries its log tail; after exit 0 the store must hold the episode's
final attempt. A budget is overshot by at most (pods in flight for it) x `budgets.episode_tokens`.
`EpisodeStageOperator` runs the pod, then the stage function, in one task. Design: docs/kubernetes.md
(`mass_ops_airflow.operators.episode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from mass_ops_airflow.cycle import cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from mass_ops.compute.kubernetes import EpisodeSpec
    from mass_ops.config import CycleConfig


class EpisodePodOperator(BaseOperator):
    """Run one episode in its own sandbox pod.

    :param kind: reference, search, collection or rollout (templated).
    :param task: task id (templated: mapped tasks pass it from XCom).
    :param version: RHI workflow version of a search episode (templated).
    :param candidate: candidate index of a collection episode (templated).
    :param replicate: replicate of a rollout (templated).
    :param generation: generation evaluated by a rollout (templated).
    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param deferrable: wait in the triggerer (the default; an episode may run for hours).
    :param poll_interval_s: seconds between pod status checks while deferred.
    :param check_outputs: after success, require the episode's row in the metadata store.
    """

    template_fields: Sequence[str] = ("kind", "task", "version", "candidate", "replicate", "generation")
    ui_color = "#e8f8f5"

    def __init__(
        self,
        *,
        kind: str,
        task: int | str,
        version: int | str | None = None,
        candidate: int | str | None = None,
        replicate: int | str | None = None,
        generation: str | None = None,
        kubernetes_conn_id: str | None = None,
        deferrable: bool = True,
        poll_interval_s: float = 30.0,
        check_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.task = task
        self.version = version
        self.candidate = candidate
        self.replicate = replicate
        self.generation = generation
        self.kubernetes_conn_id = kubernetes_conn_id
        self.deferrable = deferrable
        self.poll_interval_s = poll_interval_s
        self.check_outputs = check_outputs
        self._runner: Any = None
        self._leased: tuple[EpisodeSpec, str] | None = None  # the bound episode and its pod's name, once built
        self._config: CycleConfig | None = None  # the run's config, once a pod is running (for `on_kill`)

    def episode(self) -> EpisodeSpec:
        """The episode this task runs (from its rendered fields)."""
        from mass_ops.compute.kubernetes import EpisodeSpec

        def number(value: Any) -> int | None:
            return None if value in (None, "", "None") else int(value)

        return EpisodeSpec(
            kind=self.kind,  # type: ignore[arg-type]
            task_id=int(self.task),
            version=number(self.version),
            candidate=number(self.candidate),
            replicate=number(self.replicate),
            generation=self.generation or None,
        )

    @staticmethod
    def bound_episode(config: CycleConfig, episode: EpisodeSpec) -> EpisodeSpec:
        """`episode` bound to the request its stage runs, with the prompt stored where the pod's publisher fetches
        it; `EpisodeUnitError` (one line) when the unit's prompt is not known yet."""
        from mass_ops_airflow.cycle import stage_function

        return stage_function("bind_episode")(config, episode)

    @staticmethod
    def admit(config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any] | None:
        """Before creating `episode`'s pod: None when its task's and the cycle's budgets leave room; else the budget
        stop (`message`: one line; the unit is recorded `budget_exhausted`, not started) and no pod may be created."""
        from mass_ops_airflow.cycle import stage_function

        return stage_function("admit_episode")(config, episode)

    @staticmethod
    def lease(config: CycleConfig, episode: EpisodeSpec, pod: str) -> None:
        """As `episode`'s pod (bound) is created: lease the unit's next attempt on `pod`, so `mass-ops status` shows
        it running until the pod's publisher records it (`stages.leases`; a store failure is only logged)."""
        from mass_ops_airflow.cycle import stage_function

        stage_function("lease_episode_pod")(config, episode, pod)

    @staticmethod
    def end_lease(config: CycleConfig, episode: EpisodeSpec) -> None:
        """`episode`'s pod is gone without its publisher ending the lease (it failed, never started, or was deleted):
        end it, so `mass-ops status` stops counting the unit in flight (a store failure is only logged)."""
        from mass_ops_airflow.cycle import stage_function

        stage_function("end_episode_pod_lease")(config, episode)

    @staticmethod
    def budget_failure(message: str) -> Exception:
        """The task's end for a budget stop: a failure Airflow does not retry (the budget must be raised first)."""
        from airflow.sdk.exceptions import AirflowFailException

        return AirflowFailException(message)

    def _build_runner(self, config: CycleConfig, episode: EpisodeSpec) -> Any:
        from mass_ops.compute.backend import backend_for, to_launch
        from mass_ops_airflow.operators._pod import sandbox_runner

        # A re-entry binds again: the request is deterministic and the prompt artifact content-addressed.
        bound = self.bound_episode(config, episode)
        manifest = to_launch(backend_for(config).episode_pod(config, bound), f"episode {episode.slug}")
        self._leased = (bound, str(manifest["metadata"]["name"]))
        self._runner = sandbox_runner(
            task_id=self.task_id,
            manifest=manifest,
            kubernetes_conn_id=self.kubernetes_conn_id,
            startup_timeout_s=config.compute.kubernetes.startup_timeout_s,
            deferrable=self.deferrable,
            poll_interval_s=self.poll_interval_s,
        )
        return self._runner

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops.compute.backend import backend_for

        config = cycle_config(context["params"])
        backend = backend_for(config)
        episode = self.episode()
        context["episode_label"] = episode.slug  # type: ignore[typeddict-unknown-key]  # map_index_template
        if episode.kind == "search" and (episode.version or 0) > config.search.iterations:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(f"search.iterations is {config.search.iterations}: no version {episode.version}")
        if backend.runs_in_process:  # the stage function runs the episode in its own episode pool
            return self._in_process(config, episode)
        if self.check_outputs and (done := self._recorded(config, episode)) is not None:
            # A retry or a cleared task after the episode was recorded: nothing to launch (units are idempotent).
            self.log.info("Episode %s is already recorded (%s): no pod", episode.slug, done)
            return self._after_pod(config, episode, done)
        stop = self.admit(config, episode)
        if stop is not None:
            raise self.budget_failure(f"episode {episode.slug}: no pod created: {stop['message']}")
        runner = self._build_runner(config, episode)
        if self._leased is not None:
            self.lease(config, *self._leased)
        self._config = config
        with self._lease_ended_on_failure(config):
            runner.execute(context)  # creates the pod (or re-attaches to it) and waits
        return self._finish(config, episode)

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the deferred wait: logs, cleanup and failure handling as the provider does, then the check."""
        config = cycle_config(context["params"])
        episode = self.episode()
        context["episode_label"] = episode.slug  # type: ignore[typeddict-unknown-key]
        runner = self._build_runner(config, episode)
        self._config = config
        with self._lease_ended_on_failure(config):
            runner.trigger_reentry(context, event)
        return self._finish(config, episode)

    @contextlib.contextmanager
    def _lease_ended_on_failure(self, config: CycleConfig) -> Iterator[None]:
        """A pod that failed or never started has no publisher left to end its lease: end it here, then re-raise.
        (A deferral — Airflow's TaskDeferred — is not a failure: the pod keeps running and keeps its lease.)"""
        from airflow.sdk.exceptions import TaskDeferred

        try:
            yield
        except TaskDeferred:
            raise
        except BaseException:
            if self._leased is not None:
                self.end_lease(config, self._leased[0])
            raise

    def _in_process(self, config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any]:
        self.log.info("Local backend: episode %s runs inside the stage task that follows", episode.slug)
        return {"backend": _backend_name(config), "episode": episode.slug}

    @staticmethod
    def _recorded(config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any] | None:
        from mass_ops_airflow.checks import StageOutputMissing, episode_recorded

        try:
            return episode_recorded(config, episode)
        except StageOutputMissing:
            return None

    def _finish(self, config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any]:
        check: dict[str, Any] = {}
        if self.check_outputs:
            from mass_ops_airflow.checks import EpisodeBudgetStopped, episode_recorded

            try:
                check = episode_recorded(config, episode)
            except EpisodeBudgetStopped as stopped:
                raise self.budget_failure(str(stopped)) from None
        return self._after_pod(config, episode, check)

    def _after_pod(self, config: CycleConfig, episode: EpisodeSpec, check: dict[str, Any]) -> dict[str, Any]:
        return {"backend": _backend_name(config), "episode": episode.slug, **check}

    def on_kill(self) -> None:
        if self._runner is not None:
            self._runner.on_kill()
        if self._leased is not None and self._config is not None:  # the pod is deleted: nothing will end the lease
            self.end_lease(self._config, self._leased[0])


class EpisodeStageOperator(EpisodePodOperator):
    """One unit of a stage built on an episode: the episode's sandbox pod, then the stage function in-process.

    Kubernetes backend: the pod runs the episode (skipped when it is already recorded), then `stage` runs here —
    it finds the episode recorded and does the rest (judge calls, proposals, rows). Local backend: `stage` runs the
    episode itself. XCom: the stage's result.

    :param stage: name of the `mass_ops.stages.api` function; it is called with the config and the episode's identity:
        `search_step(config, task, version)`, `collect_candidate(config, task, candidate)`,
        `rollout_unit(config, generation, task, replicate)`.
    """

    def __init__(self, *, stage: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage

    @staticmethod
    def stage_arguments(episode: EpisodeSpec) -> tuple[Any, ...]:
        """The stage's arguments after the config, from the episode's identity."""
        if episode.kind == "search":
            return (episode.task_id, episode.version)
        if episode.kind == "collection":
            return (episode.task_id, episode.candidate)
        if episode.kind == "rollout":
            return (episode.generation, episode.task_id, episode.replicate)
        raise ValueError(f"a {episode.kind} episode has no stage of its own; use EpisodePodOperator")

    def _run_stage(self, config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any]:
        from mass_ops_airflow.cycle import call_stage, stage_function

        try:
            result = call_stage(self.stage, config, *self.stage_arguments(episode))
        except Exception as exc:
            message = stage_function("budget_stop_message")(exc)
            if message is None:
                raise
            raise self.budget_failure(f"episode {episode.slug}: {message}") from exc
        return {"backend": _backend_name(config), "episode": episode.slug, "result": result}

    def _in_process(self, config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any]:
        return self._run_stage(config, episode)

    def _after_pod(self, config: CycleConfig, episode: EpisodeSpec, check: dict[str, Any]) -> dict[str, Any]:
        return self._run_stage(config, episode)


def _backend_name(config: CycleConfig) -> str:
    """The run's compute backend, as results report it."""
    from mass_ops.compute.backend import backend_for

    return backend_for(config).name
