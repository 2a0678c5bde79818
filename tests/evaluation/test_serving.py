"""Where a registered generation is served during an evaluation: local state files (and real local servers, with the
readiness stub standing in for `transformers serve`), Kubernetes Service URLs under the registered served name, and
the served context that points the runner and the in-loop client at one generation."""

from __future__ import annotations

import dataclasses
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from mass_ops.compute import local
from mass_ops.compute.kubernetes import inference_url
from mass_ops.compute.local import LocalServerError, ServerState, is_alive, read_state
from mass_ops.config import CycleConfig, validate_config
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.critical_path import server_priority
from mass_ops.evaluation.rollouts import rollout_requests
from mass_ops.serving import (
    GenerationServer,
    ServingError,
    generation_server,
    serve_generations,
    serving_config,
    serving_context,
    state_file,
    stop_generations,
)
from mass_ops.store.model_folders import publish_model
from tests.evaluation.fakes import EvalEnv, record_local_server
from tests.inner_loop_fakes import FakeExecutor

STUB = Path(__file__).resolve().parents[1] / "compute" / "model_server_stub.py"
SCOPE = "inner-loop-test-evaluation"


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """State files and downloaded weights live under runs/ of the cwd: keep them in the test's folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def kubernetes_context(env: EvalEnv, namespace: str = "mass-eval") -> CycleContext:
    data = env.config.model_dump(mode="json")
    data["compute"]["backend"] = "kubernetes"
    data["compute"]["kubernetes"]["namespace"] = namespace
    return dataclasses.replace(env.ctx, config=validate_config(data))


def flat(document: Any, prefix: str = "") -> dict[str, Any]:
    """A nested document as {"a.b.c": leaf}."""
    if isinstance(document, dict):
        items: dict[str, Any] = {}
        for key, value in document.items():
            items.update(flat(value, f"{prefix}{key}."))
        return items
    return {prefix.rstrip("."): document}


# -- generation_server -----------------------------------------------------------------------------------------------


def test_local_backend_reads_the_generation_state_file_of_the_scope(eval_env, in_tmp):
    path = record_local_server(SCOPE, "L1", endpoint="http://127.0.0.1:8123/v1", served_name="runs/models/x/L1-bf16")
    assert path == Path("runs/servers") / SCOPE / "L1.json" and (in_tmp / path).is_file()
    assert generation_server(eval_env.ctx, "L1", SCOPE) == GenerationServer(
        "L1", "http://127.0.0.1:8123/v1", "runs/models/x/L1-bf16"
    )
    # The parent has no server in this scope, and L1 none in another: one clear line each.
    with pytest.raises(ServingError, match=r"no local server of L0 was started in scope 'inner-loop-test-evaluation'"):
        generation_server(eval_env.ctx, "L0", SCOPE)
    with pytest.raises(ServingError, match=r"no local server of L1 was started in scope 'nightly'"):
        generation_server(eval_env.ctx, "L1", "nightly")


def test_an_unregistered_generation_is_one_clear_error_on_both_backends(eval_env):
    # Even with a state file for it: no server serves a generation the metadata store does not know.
    record_local_server(SCOPE, "L7", endpoint="http://127.0.0.1:8123/v1", served_name="L7")
    for ctx in (eval_env.ctx, kubernetes_context(eval_env)):
        with pytest.raises(ServingError, match=r"^generation 'L7' is not registered in the metadata store$"):
            generation_server(ctx, "L7", SCOPE)


def test_kubernetes_backend_reaches_the_service_of_the_registered_served_name(eval_env):
    repo = eval_env.ctx.repo
    repo.register_generation(
        "L2", 2, bf16_uri="models/L2-bf16", parent_id=repo.get_generation("L1").id, served_name="mass-tiny-L2"
    )
    ctx = kubernetes_context(eval_env)
    named = generation_server(ctx, "L2", SCOPE)
    assert named == GenerationServer("L2", inference_url(ctx.config, SCOPE, "mass-tiny-L2"), "mass-tiny-L2")
    assert named.endpoint != inference_url(ctx.config, SCOPE, "L2")  # the Service is named after the served name
    assert ".mass-eval.svc:8011/v1" in named.endpoint
    # Registered without a served name: served under the generation's own name (as the operator's targets are).
    unnamed = generation_server(ctx, "L1", SCOPE)
    assert unnamed == GenerationServer("L1", inference_url(ctx.config, SCOPE, "L1"), "L1")
    # Another scope is another Service.
    assert generation_server(ctx, "L1", "nightly").endpoint == inference_url(ctx.config, "nightly", "L1")
    assert generation_server(ctx, "L1", "nightly").endpoint != unnamed.endpoint


# -- the served config and context -----------------------------------------------------------------------------------


def test_serving_config_changes_exactly_the_endpoint_and_the_served_name(eval_env):
    server = GenerationServer("L1", "http://10.1.2.3:8011/v1", "served-L1")
    served = serving_config(eval_env.config, server)
    before, after = flat(eval_env.config.model_dump(mode="json")), flat(served.model_dump(mode="json"))
    assert set(before) == set(after)
    assert {key for key in before if before[key] != after[key]} == {"inference.endpoint", "models.served_name"}
    assert (served.inference.endpoint, served.models.served_name) == ("http://10.1.2.3:8011/v1", "served-L1")
    assert eval_env.config.inference.endpoint == eval_env.endpoint  # the cycle's config is left as it was
    assert served.cycle_name == eval_env.config.cycle_name
    # models.served_name is part of the cycle's identity, so the hash moves: the served config is never re-attached.
    assert served.config_hash() != eval_env.config.config_hash()


def test_a_local_generation_server_is_served_as_the_openai_compatible_server_it_is(eval_env):
    """Locally every generation runs on `transformers serve`, even when the in-loop endpoint is a vLLM server that
    schedules by priority: rollouts and judges on it must send neither vLLM's sampling extensions nor `priority`
    (it answers them with HTTP 422). A Kubernetes generation server is a vLLM Deployment of the cycle's config."""
    inference = eval_env.config.inference.model_copy(
        update={
            "backend": "vllm",
            "server": eval_env.config.inference.server.model_copy(update={"scheduling_policy": "priority"}),
        }
    )
    vllm_loop = eval_env.config.model_copy(update={"inference": inference})
    server = GenerationServer("L1", "http://127.0.0.1:8012/v1", "served-L1")
    local = serving_config(vllm_loop, server).inference
    assert (local.backend, local.server.scheduling_policy) == ("openai-compatible", "fcfs")
    assert server_priority(serving_config(vllm_loop, server), "other") is None
    cluster = vllm_loop.model_copy(update={"compute": vllm_loop.compute.model_copy(update={"backend": "kubernetes"})})
    remote = serving_config(cluster, server).inference
    assert (remote.backend, remote.server.scheduling_policy) == ("vllm", "priority")


def test_serving_context_stays_in_the_cycle_and_records_there(eval_env):
    ctx = eval_env.ctx
    server = GenerationServer("L1", "http://10.1.2.3:8011/v1", "served-L1")
    served = serving_context(ctx, server)
    assert (served.cycle_id, served.cycle_name) == (ctx.cycle_id, ctx.cycle_name)
    assert served.repo is ctx.repo and served.artifacts is ctx.artifacts and served.catalogue is ctx.catalogue
    assert served.config.models.served_name == "served-L1" and ctx.config.models.served_name == "policy-stand-in"
    # Attaching the served config would be refused (its hash differs from the frozen one) ...
    with pytest.raises(ValueError, match="inner-loop-test"):
        attach_cycle(served.config)
    # ... and nothing needs to: an episode run on the served context is recorded in the same cycle, on that model.
    (request,) = rollout_requests(served, "L1", [51], 1)
    (outcome,) = FakeExecutor(served).run([request])
    row = ctx.repo.get_episode(outcome.episode_id)
    assert (row.cycle_id, row.generation, row.model, row.kind) == (ctx.cycle_id, "L1", "served-L1", "rollout")


# -- local servers ---------------------------------------------------------------------------------------------------


def test_serve_generations_refuses_the_kubernetes_backend(eval_env, in_tmp):
    with pytest.raises(ServingError, match="local backend only"):
        serve_generations(kubernetes_context(eval_env), ["L1", "L0"], SCOPE)
    assert not (in_tmp / "runs").exists()  # nothing was started or written


def test_stopping_a_scope_without_servers_is_a_no_op(in_tmp):
    assert stop_generations("never-started") == []
    assert not (in_tmp / "runs").exists()
    (in_tmp / "runs" / "servers" / "empty").mkdir(parents=True)
    assert stop_generations("empty") == []


def test_stopping_a_scope_forgets_servers_that_are_already_gone(eval_env):
    record_local_server(SCOPE, "L1", endpoint="http://127.0.0.1:8123/v1", served_name="L1")
    record_local_server(SCOPE, "L0", endpoint="http://127.0.0.1:8124/v1", served_name="L0")
    record_local_server("nightly", "L1", endpoint="http://127.0.0.1:8125/v1", served_name="L1")
    assert stop_generations(SCOPE) == ["L0", "L1"]
    assert not state_file(SCOPE, "L1").exists() and not state_file(SCOPE, "L0").exists()
    assert state_file("nightly", "L1").exists()  # another scope is left alone
    with pytest.raises(ServingError, match="no local server of L1"):
        generation_server(eval_env.ctx, "L1", SCOPE)


@pytest.fixture
def stub_servers(eval_env, monkeypatch) -> Any:
    """The readiness stub in place of `transformers serve` (it lists the model it is started for), tiny published
    weights for L0 and L1, and a cycle context whose endpoint is on free ports; every server is stopped at the end."""
    unhealthy: set[str] = set()

    def stub_argv(model: str, *, port: int, host: str = "127.0.0.1", extra: Any = ()) -> list[str]:
        argv = [sys.executable, str(STUB), "--port", str(port), "--name", model]
        return argv + (["--unhealthy"] if Path(model).name.removesuffix("-bf16") in unhealthy else [])

    monkeypatch.setattr("mass_ops.compute.local.transformers_serve_argv", stub_argv)
    started: list[ServerState] = []
    real_start = local.start_server

    def start_server(*args: Any, **kwargs: Any) -> ServerState:
        started.append(real_start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(local, "start_server", start_server)
    for name in ("L0", "L1"):
        folder = eval_env.tmp / "weights" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(f'{{"model": "{name}"}}')
        publish_model(eval_env.ctx.artifacts, f"models/{name}-bf16", folder)
    with socket.socket() as probe:  # the in-loop endpoint: a port the evaluation servers must not assume is free
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def context(readiness_timeout_s: int = 30) -> CycleContext:
        config: CycleConfig = eval_env.config
        server = config.inference.server.model_copy(update={"readiness_timeout_s": readiness_timeout_s})
        inference = config.inference.model_copy(update={"endpoint": f"http://127.0.0.1:{port}/v1", "server": server})
        return dataclasses.replace(eval_env.ctx, config=config.model_copy(update={"inference": inference}))

    try:
        yield port, context, unhealthy, started
    finally:
        stop_generations(SCOPE)


def test_serve_generations_starts_one_server_per_generation_and_stop_ends_them(stub_servers, in_tmp):
    port, context, _, _ = stub_servers
    ctx = context()
    servers = serve_generations(ctx, ["L1", "L0", "L1"], SCOPE)  # a generation named twice is served once
    weights = {name: f"runs/models/inner-loop-test/{name}-bf16" for name in ("L1", "L0")}
    assert [(server.generation, server.served_name) for server in servers] == [
        ("L1", weights["L1"]),
        ("L0", weights["L0"]),
    ]
    ports = [int(server.endpoint.removeprefix("http://127.0.0.1:").removesuffix("/v1")) for server in servers]
    assert len(set(ports)) == 2 and port not in ports, "each on a free port of its own, never the in-loop endpoint's"
    # The registered weights were fetched from the artifact store into a local folder each server loads.
    assert (in_tmp / weights["L0"] / "config.json").read_text() == '{"model": "L0"}'
    assert [generation_server(ctx, name, SCOPE) for name in ("L1", "L0")] == servers
    states = {name: read_state(state_file(SCOPE, name)) for name in ("L1", "L0")}
    assert all(is_alive(state) for state in states.values())
    # Serving again finds the same live servers instead of starting others.
    assert serve_generations(ctx, ["L1", "L0"], SCOPE) == servers
    assert {name: read_state(state_file(SCOPE, name)).pid for name in states} == {n: s.pid for n, s in states.items()}

    assert stop_generations(SCOPE) == ["L0", "L1"]
    assert not any(is_alive(state) for state in states.values())
    with pytest.raises(ServingError, match="no local server of L1"):
        generation_server(ctx, "L1", SCOPE)


def test_a_server_that_never_becomes_ready_stops_them_all(stub_servers):
    _, context, unhealthy, started = stub_servers
    unhealthy.add("L0")
    with pytest.raises(LocalServerError, match="not ready after 2 s"):
        serve_generations(context(readiness_timeout_s=2), ["L1", "L0"], SCOPE)
    assert len(started) == 2 and not any(is_alive(state) for state in started)
    assert read_state(state_file(SCOPE, "L1")) is None and read_state(state_file(SCOPE, "L0")) is None


def test_a_generation_that_cannot_be_served_leaves_no_server_running(eval_env, stub_servers):
    _, context, _, started = stub_servers
    repo = eval_env.ctx.repo
    repo.register_generation("L2", 2, bf16_uri="models/L2-bf16", parent_id=repo.get_generation("L1").id)
    # L1 starts first; the second generation fails (not registered / no published weights) and L1 is stopped again.
    for second, problem in (("L9", "generation 'L9' is not registered"), ("L2", "no model is published at")):
        with pytest.raises(ValueError, match=problem):
            serve_generations(context(), ["L1", second], SCOPE)
        assert read_state(state_file(SCOPE, "L1")) is None and read_state(state_file(SCOPE, second)) is None
    assert len(started) == 2 and not any(is_alive(state) for state in started)  # L1, started and stopped twice
