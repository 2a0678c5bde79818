"""One benchmark trial: in-process when the run's compute backend runs work in process (local); otherwise
(Kubernetes) one instance at a time, each graded by a grader Job from the benchmark's image.

Contract: every instance gets one score, recorded once with the evaluator's version, then `benchmark_trial_record`
writes the trial's row. On Kubernetes the agent runs in its own episode sandbox pod and the grade comes from a grader
Job (`benchmark_grader_job`), both deferred to the triggerer and failing with their containers' log tails; a budget
stop fails without retry. A retry skips every recorded instance, never relaunches a recorded episode, reuses the log
of a grader Job that already succeeded, re-attaches to one still running and replaces one that failed; a kill
deletes the Job or episode pod in flight. The stages in order: docs/kubernetes.md
(`mass_ops_airflow.operators.benchmark`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from mass_ops_airflow.cycle import call_stage, cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from mass_ops.config import CycleConfig
    from mass_ops_airflow.kube import MassKubeHook


@dataclass(frozen=True)
class GraderRun:
    """The grader job `benchmark_instance` returned (the fields `benchmark_grader_job` reads)."""

    benchmark: str
    instance: str
    image: str
    script: str
    timeout_s: float


class GraderJobFailed(RuntimeError):
    """A grader Job failed; the message carries its pod's log tails."""


class BenchmarkTrialOperator(BaseOperator):
    """Run, grade and record trial `unit[1]` of benchmark `unit[0]` for the run's `generation` param (with its
    `limit` and `data_dir` params).

    :param unit: ``[benchmark, trial]`` (templated: mapped from the run's units), or a mapping with ``benchmark``,
        ``trial`` and any of ``generation``, ``limit``, ``data_dir``, which then win over the run's params (the nightly
        benchmark slice maps over (benchmark, generation)).
    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param poll_interval_s: seconds between Job status reads while deferred.
    :param delete_timeout_s: how long to wait for a failed grader Job of a previous try to disappear.
    :param run_params: the DAG's params that are not config keys (stripped before the config is built).
    :param stage_prefix: the stage functions run are ``<prefix>_trial``, ``<prefix>_trial_tasks``,
        ``<prefix>_instance``, ``<prefix>_grader_result`` and ``<prefix>_trial_record`` (same signatures):
        ``benchmark`` (stages.benchmarks), or ``nightly_benchmark`` (the nightly slice: its cycle and servers).
    :param deferrable: wait for episode pods in the triggerer (the default; an episode may run for hours).
    """

    template_fields: Sequence[str] = ("unit",)
    ui_color = "#fef9e7"

    def __init__(
        self,
        *,
        unit: Any,
        kubernetes_conn_id: str | None = None,
        poll_interval_s: float = 15.0,
        delete_timeout_s: int = 600,
        run_params: Sequence[str] = ("generation", "benchmarks", "trials", "limit", "data_dir"),
        stage_prefix: str = "benchmark",
        deferrable: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.unit = unit
        self.run_params = tuple(run_params)
        self.stage_prefix = stage_prefix
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval_s = poll_interval_s
        self.delete_timeout_s = delete_timeout_s
        self.deferrable = deferrable
        self._in_flight: dict[str, str] | None = None
        self._runner: Any = None  # the episode pod's runner while one is in flight

    # -- the run's choice ------------------------------------------------------------------------------------------

    def _choice(self, context: Context) -> tuple[str, int, str, int | None, str | None]:
        params = context["params"]
        unit = self.unit if isinstance(self.unit, Mapping) else {"benchmark": self.unit[0], "trial": self.unit[1]}
        benchmark, trial = str(unit["benchmark"]), int(unit["trial"])
        generation = str(unit["generation"]) if "generation" in unit else str(params["generation"])
        limit = unit["limit"] if "limit" in unit else params.get("limit")
        data_dir = unit["data_dir"] if "data_dir" in unit else params.get("data_dir")
        label = f"{benchmark} {generation} t{trial}" if "generation" in unit else f"{benchmark} t{trial}"
        context["unit_label"] = label  # type: ignore[typeddict-unknown-key]  # map_index_template
        return benchmark, trial, generation, limit, data_dir

    def _stage(self, step: str) -> str:
        """The stage function of `step` ("trial", "instance", …) for this operator's stage family."""
        return f"{self.stage_prefix}_{step}"

    def config_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The run's params that build the cycle config (the DAG's run params are not config)."""
        from mass_ops_airflow.params import config_params

        return config_params(params, self.run_params)

    # -- entry points ------------------------------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops.compute.backend import backend_for

        benchmark, trial, generation, limit, data_dir = self._choice(context)
        config = cycle_config(self.config_params(context["params"]))
        backend = backend_for(config)
        if backend.runs_in_process:
            result = call_stage(self._stage("trial"), config, benchmark, generation, trial, limit, data_dir)
            return {"backend": backend.name, "result": result}
        return self._advance(context, config, 0)  # its first call checks the dataset and evaluator

    def execute_complete(self, context: Context, event: dict[str, Any], index: int = 0) -> dict[str, Any]:
        """Resume after instance `index`'s grader Job ended: record its result (or fail with its log tails), then
        go on with the next instance."""
        self._choice(context)
        config = cycle_config(self.config_params(context["params"]))
        name = str(event.get("job_name"))
        if event.get("status") != "succeeded":
            self._fail(config, name, str(event.get("message") or event.get("status")))
        self._collect(context, config, index, name)
        return self._advance(context, config, index + 1)

    def episode_complete(
        self, context: Context, event: dict[str, Any], index: int = 0, episode: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume after instance `index`'s episode pod ended: the provider's logs, cleanup and failure handling, the
        post-check, then the same instance again (now graded from its recorded episode) and the ones after it."""
        self._choice(context)
        config = cycle_config(self.config_params(context["params"]))
        if episode is None:
            raise ValueError("episode_complete: the deferral carried no episode")
        runner, pod_config, spec = self._episode_runner(config, episode)
        runner.trigger_reentry(context, event)
        self._episode_recorded(pod_config, spec)
        return self._advance(context, config, index)

    def on_kill(self) -> None:
        if self._runner is not None:
            self._runner.on_kill()
        if not self._in_flight:
            return
        from mass_ops_airflow.kube import MassKubeHook

        hook = MassKubeHook(self.kubernetes_conn_id)
        deleted = hook.delete_objects(self._in_flight["namespace"], jobs=[self._in_flight["job"]])
        self.log.info("Task killed: deleted %s", ", ".join(deleted) or "nothing (already gone)")

    # -- one instance at a time ----------------------------------------------------------------------------------------

    def _tasks(self, context: Context, config: CycleConfig) -> list[str]:
        benchmark, _, _, limit, data_dir = self._choice(context)
        return list(call_stage(self._stage("trial_tasks"), config, benchmark, limit, data_dir)["tasks"])

    def _advance(self, context: Context, config: CycleConfig, start: int) -> dict[str, Any]:
        """Instances `start`… in order; defers at the first one that needs a grader Job; records the trial after
        the last."""
        benchmark, trial, generation, limit, data_dir = self._choice(context)
        tasks = self._tasks(context, config)
        for index in range(start, len(tasks)):
            prepared = self._instance(context, config, tasks[index])
            if prepared["status"] == "episode":
                self._run_episode(context, config, index, prepared)  # defers while the pod runs
                prepared = self._instance(context, config, tasks[index])
            if prepared["status"] == "budget_exhausted":
                raise self._budget_failure(f"{tasks[index]}: no episode pod created: {prepared['message']}")
            if prepared["status"] == "episode":
                raise RuntimeError(f"{tasks[index]}: its episode pod ended but the episode is still to run")
            if prepared["status"] == "recorded":
                continue
            if self._grade(context, config, index, prepared):
                continue  # a grader Job of a previous try had succeeded: its result is recorded now
        from mass_ops.compute.backend import backend_for

        result = call_stage(self._stage("trial_record"), config, benchmark, generation, trial, limit, data_dir)
        return {"backend": backend_for(config).name, "result": result}

    def _instance(self, context: Context, config: CycleConfig, task: str) -> dict[str, Any]:
        """`<prefix>_instance` of `task`: on Kubernetes its episode runs in a pod, never in this task."""
        benchmark, trial, generation, _, data_dir = self._choice(context)
        return call_stage(self._stage("instance"), config, benchmark, generation, trial, task, data_dir, True)

    # -- the episode pod -----------------------------------------------------------------------------------------------

    def _episode_runner(self, config: CycleConfig, episode: dict[str, Any]) -> tuple[Any, CycleConfig, Any]:
        """The pod runner of an instance's episode (`benchmark_instance`'s ``episode`` answer), the config of the
        cycle it is recorded in (the nightly slice records in its own), and its spec."""
        from mass_ops.compute import kubernetes as specs
        from mass_ops.compute.backend import backend_for, to_launch
        from mass_ops_airflow.operators._pod import sandbox_runner

        # The stage names the cycle; its config differs from the run's by the name only (stages.nightly).
        cycle = str(episode["cycle"])
        pod_config = config if cycle == config.cycle_name else config.model_copy(update={"name": cycle})
        spec = specs.EpisodeSpec(**episode["episode"])
        server = episode.get("server")
        pod = backend_for(pod_config).episode_pod(
            pod_config,
            spec,
            wall_clock_s=episode.get("wall_clock_s"),
            server=specs.EpisodeServer(**server) if server else None,
        )
        manifest = to_launch(pod, f"episode {spec.slug}")
        self._runner = sandbox_runner(
            task_id=self.task_id,
            manifest=manifest,
            kubernetes_conn_id=self.kubernetes_conn_id,
            startup_timeout_s=config.compute.kubernetes.startup_timeout_s,
            deferrable=self.deferrable,
            poll_interval_s=self.poll_interval_s,
        )
        return self._runner, pod_config, spec

    def _run_episode(self, context: Context, config: CycleConfig, index: int, episode: dict[str, Any]) -> None:
        """Run instance `index`'s episode pod; deferrable: defer to `episode_complete` with what it needs."""
        from airflow.sdk.exceptions import TaskDeferred

        from mass_ops_airflow.operators.episode import EpisodePodOperator

        runner, pod_config, spec = self._episode_runner(config, episode)
        self.log.info("Episode pod for %s (%s, time limit %s s)", episode["task"], spec.slug, episode["wall_clock_s"])
        EpisodePodOperator.lease(pod_config, spec, runner.name)  # `status` shows it running from now on
        try:
            runner.execute(context)
        except TaskDeferred as deferred:
            # The provider defers to its own `trigger_reentry`; resume here instead, knowing which instance it was.
            self.defer(
                trigger=deferred.trigger,
                method_name="episode_complete",
                kwargs={"index": index, "episode": episode},
                timeout=deferred.timeout,
            )
        self._episode_recorded(pod_config, spec)

    def _episode_recorded(self, pod_config: CycleConfig, spec: Any) -> None:
        """The post-check of an episode pod: its episode is recorded (a budget stop fails without retry)."""
        from mass_ops_airflow.checks import EpisodeBudgetStopped, episode_recorded

        self._runner = None
        try:
            found = episode_recorded(pod_config, spec)
        except EpisodeBudgetStopped as stopped:
            raise self._budget_failure(str(stopped)) from None
        self.log.info("Episode %s recorded: %s", spec.slug, found)

    @staticmethod
    def _budget_failure(message: str) -> Exception:
        from mass_ops_airflow.operators.episode import EpisodePodOperator

        return EpisodePodOperator.budget_failure(message)

    def _unit_label(self, context: Context) -> str:
        _, trial, generation, _, _ = self._choice(context)
        return f"{generation}-t{trial}"

    def _grade(self, context: Context, config: CycleConfig, index: int, prepared: dict[str, Any]) -> bool:
        """Create (or re-attach to) instance `index`'s grader Job and defer; True when a Job of a previous try had
        already succeeded and its result was recorded here instead."""
        from mass_ops.compute import kubernetes as specs
        from mass_ops.compute.backend import backend_for, to_launch
        from mass_ops_airflow.kube import MassKubeHook, job_state
        from mass_ops_airflow.triggers import JobCompletionTrigger

        job = prepared["job"]
        run = GraderRun(job["benchmark"], job["instance"], job["image"], job["script"], float(job["timeout_s"]))
        unit = self._unit_label(context)
        grader = backend_for(config).grader_job(
            config, run, bundle_uri=prepared["bundle_uri"], bundle_sha256=prepared["bundle_sha256"], unit=unit
        )
        manifest = to_launch(grader, f"grader of {run.instance}")
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        hook = MassKubeHook(self.kubernetes_conn_id)
        self._in_flight = {"job": name, "namespace": namespace}
        existing = hook.read_job(name, namespace)
        if existing is not None:
            state, _ = job_state(existing)
            if state == "succeeded":
                self.log.info("Grader Job %s already succeeded in a previous try: reading its result", name)
                self._collect(context, config, index, name)
                return True
            if state == "failed":
                self.log.info("Replacing grader Job %s, which failed in a previous try", name)
                hook.delete_objects(namespace, jobs=[name])
                selector = specs.scope_selector(config, config.cycle_name, manifest["metadata"]["labels"])
                hook.wait_jobs_gone(namespace, selector, timeout_s=self.delete_timeout_s)
                existing = None
            else:
                self.log.info("Re-attaching to grader Job %s, still running from a previous try", name)
        if existing is None:
            hook.start_job(manifest)
            self.log.info("Created grader Job %s for %s (image %s)", name, run.instance, run.image)
        self.defer(
            trigger=JobCompletionTrigger(
                job_name=name,
                namespace=namespace,
                conn_id=self.kubernetes_conn_id,
                schedule_timeout_s=config.compute.kubernetes.startup_timeout_s,
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
            kwargs={"index": index},
        )
        return False  # not reached: defer raises

    def _grader_pods(self, hook: MassKubeHook, namespace: str, name: str) -> list[Any]:
        from mass_ops.compute.kubernetes import JOB_NAME_LABEL

        pods = hook.list_pods(namespace, f"{JOB_NAME_LABEL}={name}")
        return sorted(pods, key=lambda p: str(p.metadata.creation_timestamp or ""))

    def _collect(self, context: Context, config: CycleConfig, index: int, name: str) -> None:
        """Read the grader container's log of Job `name`, record instance `index`'s score from it, delete the Job."""
        from mass_ops.compute.kubernetes import GRADER_CONTAINER
        from mass_ops_airflow.kube import MassKubeHook

        benchmark, trial, generation, _, data_dir = self._choice(context)
        task = self._tasks(context, config)[index]
        namespace = config.compute.kubernetes.namespace
        hook = MassKubeHook(self.kubernetes_conn_id)
        pods = self._grader_pods(hook, namespace, name)
        if not pods:
            raise GraderJobFailed(f"grader Job {name} for {task} succeeded but its pod is gone; clear the task")
        log = hook.read_pod_log(pods[-1].metadata.name, namespace, container=GRADER_CONTAINER)
        scored = call_stage(
            self._stage("grader_result"), config, benchmark, generation, trial, task, str(log), data_dir
        )
        self.log.info("%s t%d %s: score %s (%s)", benchmark, trial, task, scored["score"], scored["evaluator"])
        hook.delete_objects(namespace, jobs=[name])
        self._in_flight = None

    def _fail(self, config: CycleConfig, name: str, message: str) -> None:
        """Raise `GraderJobFailed` with the grader pod's log tails, after deleting the Job."""
        from mass_ops.compute.kubernetes import GRADER_CONTAINER, GRADER_FETCH_CONTAINER
        from mass_ops_airflow.kube import LOG_TAIL_LINES, MassKubeHook

        namespace = config.compute.kubernetes.namespace
        hook = MassKubeHook(self.kubernetes_conn_id)
        tails = []
        for pod in self._grader_pods(hook, namespace, name):
            for container in (GRADER_FETCH_CONTAINER, GRADER_CONTAINER):
                tail = hook.log_tail(pod.metadata.name, namespace, container=container)
                tails.append(f"--- {pod.metadata.name} {container} (last {LOG_TAIL_LINES} lines) ---\n{tail}")
        hook.delete_objects(namespace, jobs=[name])
        self._in_flight = None
        raise GraderJobFailed("\n".join([f"grader Job {name} failed: {message}", *(tails or ["(no pods found)"])]))
