"""On Kubernetes a benchmark instance's episode runs in its own sandbox pod (#18.2): the stage hands out the pod's
bound spec instead of running the episode, the pod's request is the one the in-process path runs, and once the pod
has recorded the episode the grading reads it and runs nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mass_ops.compute.kubernetes import EpisodeSpec
from mass_ops.evaluation.benchmarks.suite import (
    EpisodeNotRecorded,
    RecordedEpisodes,
    fixed_executor,
    instance_request,
    prepare_instance,
)
from mass_ops.evaluation.benchmarks.tb2 import TerminalBench2
from mass_ops.stages.benchmarks import instance_step
from mass_ops.stages.units import EpisodeUnitError, episode_request
from tests.evaluation.benchmarks.test_adapters import make_tb2_task
from tests.evaluation.fakes import BenchmarkExecutor


def hello(request) -> dict[str, bytes]:
    return {"hello.txt": b"hi"}


def test_the_stage_hands_out_the_episode_pod_then_grades_what_the_pod_recorded(tmp_path, eval_env):
    ctx = eval_env.ctx
    make_tb2_task(tmp_path, "hello-world")  # [agent] timeout_sec = 600
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()

    step = instance_step(ctx, adapter, "L1", 0, task, episode_pod=True)
    assert step["status"] == "episode" and step["task"] == "tb2_hello-world" and step["cycle"] == ctx.cycle_name
    assert step["wall_clock_s"] == 600, "the task's official limit, stricter than none configured"
    assert step["server"] == {"endpoint": ctx.config.inference.endpoint, "served_name": ctx.config.models.served_name}
    assert ctx.repo.episodes(ctx.cycle_id) == [], "no episode ran in the stage"
    # The pod's spec is bound to the request the in-process path runs; its prompt is stored where the publisher
    # fetches it, and the request rebuilt from the spec (what the pod's `episode run` runs) is that same request.
    spec = EpisodeSpec(**step["episode"])
    in_process = instance_request(ctx, task, "L1", 0)
    assert (spec.kind, spec.task_id, spec.candidate, spec.generation) == ("benchmark", task.name, 0, "L1")
    assert (spec.seed, spec.condition, spec.prompt_sha256) == (
        in_process.unit.seed, in_process.condition, in_process.prompt_sha256,
    )  # fmt: skip
    assert ctx.artifacts.get_bytes(ctx.artifacts.key_of(spec.prompt_uri)).decode() == task.instruction
    pod_request = episode_request(ctx, spec)
    assert pod_request == in_process
    # Asked again before the pod ran (a retry): the same pod, still nothing run.
    assert instance_step(ctx, adapter, "L1", 0, task, episode_pod=True) == step

    pod = BenchmarkExecutor(ctx, hello)  # the pod: runs the request and records it (its publisher)
    pod.run([pod_request])
    graded = instance_step(ctx, adapter, "L1", 0, task, episode_pod=True)
    assert graded["status"] == "grade" and graded["job"]["image"] == "registry.local/tb2/hello-world:2.0"
    assert len(pod.executed) == 1 and len(ctx.repo.episodes(ctx.cycle_id)) == 1


def test_the_pod_path_grades_the_workspace_the_in_process_path_grades(tmp_path, eval_env):
    ctx = eval_env.ctx
    make_tb2_task(tmp_path, "hello-world")
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()
    in_process = prepare_instance(ctx, adapter, fixed_executor(BenchmarkExecutor(ctx, hello)), "L1", 0, task)
    step = instance_step(ctx, adapter, "L1", 1, task, episode_pod=True)
    BenchmarkExecutor(ctx, hello).run([episode_request(ctx, EpisodeSpec(**step["episode"]))])
    in_pod = instance_step(ctx, adapter, "L1", 1, task, episode_pod=True)
    # Same files left by the agent → the same grader job (image, script, limit and bundle), trial apart.
    assert in_pod["bundle_sha256"] == in_process.bundle_sha256


def test_the_grading_never_runs_an_unrecorded_episode(tmp_path, eval_env):
    ctx = eval_env.ctx
    make_tb2_task(tmp_path, "hello-world")
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()
    with pytest.raises(EpisodeNotRecorded, match="its episode pod has not run it"):
        prepare_instance(ctx, adapter, fixed_executor(RecordedEpisodes(ctx)), "L1", 0, task)
    assert ctx.repo.episodes(ctx.cycle_id) == []


def test_an_unbound_benchmark_episode_has_no_request():
    from types import SimpleNamespace

    spec = EpisodeSpec("benchmark", "tb2_hello-world", candidate=0, generation="L1")
    with pytest.raises(EpisodeUnitError, match="bound by its benchmark stage, which reads the dataset"):
        episode_request(SimpleNamespace(cycle_name="c"), spec)  # type: ignore[arg-type]


def cli_params(command: list[str]) -> dict[str, object]:
    """The parameters `mass-ops …` parses from a container's command (Click raises on an unknown option)."""
    import typer

    from mass_ops.cli import app

    assert command[0] == "mass-ops"
    group: Any = typer.main.get_command(app)
    context = group.make_context("mass-ops", list(command[1:]))
    while hasattr(group, "resolve_command"):  # a command group (Typer may carry its own Click)
        name, sub, rest = group.resolve_command(context, context._protected_args + context.args)
        assert sub is not None and name is not None
        context = sub.make_context(name, rest, parent=context)
        group = sub
    return context.params


def test_a_seeded_instance_pod_carries_its_seed_to_the_publisher_and_the_sandbox(tmp_path, eval_env):
    from mass_ops.compute.kubernetes import WorkloadSettings, episode_pod
    from tests.evaluation.benchmarks.test_seeds import make_harbor_task

    ctx = eval_env.ctx
    make_harbor_task(tmp_path)  # its image copies data.csv and src/ into /app
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()
    step = instance_step(ctx, adapter, "L1", 0, task, episode_pod=True)
    spec = EpisodeSpec(**step["episode"])
    in_process = instance_request(ctx, task, "L1", 0)
    assert in_process.workspace_seed is not None
    assert (spec.workspace_seed_uri, spec.workspace_seed_sha256) == (
        in_process.workspace_seed.uri, in_process.workspace_seed.sha256,
    )  # fmt: skip
    # The request the pod's stage rebuilds from the spec is the in-process one, seed included.
    assert episode_request(ctx, spec) == in_process
    sandbox, publisher = episode_pod(ctx.config, WorkloadSettings(), spec, wall_clock_s=600)["spec"]["containers"]
    seed_args = ["--workspace-seed-uri", spec.workspace_seed_uri, "--workspace-seed-sha256", spec.workspace_seed_sha256]
    for container in (sandbox, publisher):
        command = container["command"]
        start = command.index("--workspace-seed-uri")
        assert command[start : start + 4] == seed_args
        parsed = cli_params(command)  # the CLI the containers run accepts every argument the pod gives it
        assert (parsed["workspace_seed_uri"], parsed["workspace_seed_sha256"]) == tuple(seed_args[1::2])
    # A spec naming a seed that is not the cycle's stored seed of that hash has no request.
    forged = dataclasses.replace(spec, workspace_seed_uri=ctx.artifacts.uri("cycles/elsewhere/seed.tar.gz"))
    with pytest.raises(EpisodeUnitError, match="is not the cycle's stored seed"):
        episode_request(ctx, forged)


def test_an_unseeded_instance_pod_has_no_seed_arguments(tmp_path, eval_env):
    from mass_ops.compute.kubernetes import WorkloadSettings, episode_pod

    ctx = eval_env.ctx
    make_tb2_task(tmp_path, "hello-world")  # its image copies nothing
    adapter = TerminalBench2(tmp_path)
    [task] = adapter.tasks()
    spec = EpisodeSpec(**instance_step(ctx, adapter, "L1", 0, task, episode_pod=True)["episode"])
    assert spec.workspace_seed_uri is None
    pod = episode_pod(ctx.config, WorkloadSettings(), spec)
    assert not any("--workspace-seed-uri" in c["command"] for c in pod["spec"]["containers"])
