"""Readiness, Job and TrainJob triggers: events only from observation, absolute deadlines, deletion only on a user
kill."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import time

from mass_ops_airflow.triggers import InferenceReadinessTrigger, JobCompletionTrigger, TrainJobCompletionTrigger

from tests.compute.model_server_stub import serve_in_thread


async def first_event(trigger):
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def run_trigger(trigger, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(first_event(trigger), timeout))


def round_trip(trigger):
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    return rebuilt


def endpoint(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_ready_when_every_server_lists_its_name():
    first, second = serve_in_thread("L0"), serve_in_thread("L1")
    try:
        servers = [
            {"endpoint": endpoint(first), "served_name": "L0"},
            {"endpoint": endpoint(second), "served_name": "L1"},
        ]
        trigger = round_trip(InferenceReadinessTrigger(servers=servers, deadline_ts=time.time() + 30))
        event = run_trigger(trigger)
        assert event["status"] == "ready" and event["servers"] == servers
    finally:
        first.shutdown()
        second.shutdown()


def test_timeout_says_what_is_missing():
    server = serve_in_thread("some-other-model")
    try:
        trigger = InferenceReadinessTrigger(
            servers=[{"endpoint": endpoint(server), "served_name": "L1"}],
            deadline_ts=time.time() + 1.0,
            poll_interval_s=0.2,
        )
        started = time.monotonic()
        event = run_trigger(trigger)
        assert event["status"] == "timeout"
        assert "/v1/models lists ['some-other-model'] but not 'L1'" in event["message"]
        assert time.monotonic() - started < 10
    finally:
        server.shutdown()


def waiting_pod(cluster, name: str, reason: str, labels: dict[str, str]) -> None:
    cluster.objects["pods"][name] = {
        "metadata": {"name": name, "namespace": "mass-ops", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "i"}]},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "vllm", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
                 "state": {"waiting": {"reason": reason, "message": "manifest unknown"}}},
            ],
        },
    }  # fmt: skip


def test_a_fatal_pod_state_fails_fast(cluster):
    waiting_pod(cluster, "vllm-x-1", "ImagePullBackOff", {"app.kubernetes.io/instance": "vllm-x"})
    trigger = InferenceReadinessTrigger(
        servers=[{"endpoint": "http://127.0.0.1:9/v1", "served_name": "L1"}],
        deadline_ts=time.time() + 600,
        kubernetes={"namespace": "mass-ops", "selector": "app.kubernetes.io/instance=vllm-x", "schedule_timeout_s": 60},
    )
    event = run_trigger(trigger)
    assert event["status"] == "failed"
    assert event["message"] == "pod vllm-x-1: container vllm is ImagePullBackOff: manifest unknown"


def test_unschedulable_gpu_pod_fails_after_the_schedule_timeout(cluster):
    from mass_ops_airflow.kube import pod_problem

    from tests.plugins.kube_fakes import to_model

    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=120)
    pod = to_model(
        {
            "metadata": {"name": "train-0", "creationTimestamp": since.isoformat()},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/4 nodes have nvidia.com/gpu", "lastTransitionTime": since.isoformat()},
                ],
            },
        },
        "V1Pod",
    )  # fmt: skip
    assert pod_problem(pod, schedule_timeout_s=600) is None
    problem = pod_problem(pod, schedule_timeout_s=60)
    assert problem.startswith("pod train-0 could not be scheduled for 12")
    assert "Unschedulable 0/4 nodes have nvidia.com/gpu" in problem


def test_readiness_kill_deletes_what_the_operator_created(cluster):
    cluster.create("deployments", {"metadata": {"name": "vllm-a"}, "spec": {}})
    cluster.create("services", {"metadata": {"name": "vllm-a"}, "spec": {}})
    trigger = InferenceReadinessTrigger(
        servers=[],
        deadline_ts=0,
        cleanup={"namespace": "mass-ops", "deployments": ["vllm-a"], "services": ["vllm-a"]},
    )
    asyncio.run(trigger.on_kill())
    assert ("apps", "deployments", "delete") in cluster.calls and ("", "services", "delete") in cluster.calls
    assert cluster.terminating["deployments"] == {"vllm-a"}


def job_trigger() -> JobCompletionTrigger:
    return round_trip(
        JobCompletionTrigger(
            job_name="mass-c-train", namespace="mass-ops", conn_id=None, schedule_timeout_s=60, poll_interval_s=0.05,
            service_name="mass-c-train",
        )
    )  # fmt: skip


def test_job_trigger_reports_success_and_failure(cluster):
    cluster.create("jobs", {"metadata": {"name": "mass-c-train"}, "spec": {"template": {"spec": {"containers": []}}}})

    async def finish_later():
        await asyncio.sleep(0.2)
        cluster.batch.set_job_condition("mass-c-train", "Failed", "BackoffLimitExceeded")

    async def scenario():
        finisher = asyncio.create_task(finish_later())
        event = await first_event(job_trigger())
        await finisher
        return event

    event = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert event == {"status": "failed", "message": "Failed: BackoffLimitExceeded", "job_name": "mass-c-train"}
    cluster.batch.set_job_condition("mass-c-train", "Complete")
    assert run_trigger(job_trigger())["status"] == "succeeded"
    assert ("batch", "jobs/status", "get") not in cluster.calls, "the Role grants jobs, not jobs/status"


def test_job_trigger_fails_fast_on_a_pod_that_cannot_start(cluster):
    cluster.create("jobs", {"metadata": {"name": "mass-c-train"}, "spec": {"template": {"spec": {"containers": []}}}})
    waiting_pod(cluster, "mass-c-train-0-abc", "ErrImagePull", {"batch.kubernetes.io/job-name": "mass-c-train"})
    event = run_trigger(job_trigger())
    assert event["status"] == "failed" and "ErrImagePull" in event["message"]


def test_job_kill_deletes_job_and_service(cluster):
    cluster.create("jobs", {"metadata": {"name": "mass-c-train"}, "spec": {"template": {"spec": {"containers": []}}}})
    cluster.create("services", {"metadata": {"name": "mass-c-train"}, "spec": {}})
    asyncio.run(job_trigger().on_kill())
    assert cluster.terminating["jobs"] == {"mass-c-train"} and cluster.terminating["services"] == {"mass-c-train"}


def trainjob_trigger() -> TrainJobCompletionTrigger:
    return round_trip(
        TrainJobCompletionTrigger(
            trainjob_name="mass-c-train",
            namespace="mass-ops",
            conn_id=None,
            schedule_timeout_s=60,
            poll_interval_s=0.05,
        )
    )


def test_trainjob_trigger_reads_the_trainjob_conditions(cluster):
    cluster.create("trainjobs", {"metadata": {"name": "mass-c-train"}, "spec": {}})

    async def finish_later():
        await asyncio.sleep(0.2)
        cluster.set_trainjob_condition("mass-c-train", "Failed", "node-0 exited 1")

    async def scenario():
        finisher = asyncio.create_task(finish_later())
        event = await first_event(trainjob_trigger())
        await finisher
        return event

    event = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert event == {"status": "failed", "message": "Failed: node-0 exited 1", "trainjob_name": "mass-c-train"}
    cluster.set_trainjob_condition("mass-c-train", "Complete")
    assert run_trigger(trainjob_trigger())["status"] == "succeeded"
    assert ("trainer.kubeflow.org", "trainjobs", "get") in cluster.calls


def test_trainjob_trigger_fails_fast_on_a_node_pod_that_cannot_start(cluster):
    cluster.create("trainjobs", {"metadata": {"name": "mass-c-train"}, "spec": {}})
    waiting_pod(cluster, "mass-c-train-node-0-0-x", "ErrImagePull", {"jobset.sigs.k8s.io/jobset-name": "mass-c-train"})
    event = run_trigger(trainjob_trigger())
    assert event["status"] == "failed" and "mass-c-train-node-0-0-x" in event["message"]


def test_trainjob_kill_deletes_the_trainjob(cluster):
    cluster.create("trainjobs", {"metadata": {"name": "mass-c-train"}, "spec": {}})
    asyncio.run(trainjob_trigger().on_kill())
    assert cluster.terminating["trainjobs"] == {"mass-c-train"}
