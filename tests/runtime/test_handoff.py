"""The hand-off of a Kubernetes episode pod, run as the pod runs it: two processes sharing one folder.

`mass-ops episode run --handoff DIR` (the sandbox container) gets the inference key and nothing of the stores;
`mass-ops episode publish --handoff DIR` (the publisher container) gets the store and database settings and no key.
What the publisher records must equal what a direct local run records, field by field (timings and paths aside).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime import handoff as hand
from mass_ops.runtime.qwen_install import QwenInstall
from tests.fixtures.s3 import MotoS3Server
from tests.policy_server import PolicyServer
from tests.support.handoff import SEED
from tests.support.runtime import (
    API_KEY,
    KEY_VAR,
    TASK,
    PolicyHost,
    episode_config,
    fake_qwen_runtime,
    open_episode_cycle,
    process_alive,
)

REPO = Path(__file__).resolve().parents[2]
_CLI = (
    "import sys, typer\n"
    "from mass_ops.runtime.cli import episode_app\n"
    "app = typer.Typer()\n"
    "app.add_typer(episode_app, name='episode')\n"
    "app(sys.argv[1:], prog_name='mass-ops')\n"
)
# How long a sandbox may outlive a failed publisher before the test gives up on it (it reads publisher-failed.json
# within a poll when the publisher could write it).
PUBLISHER_GRACE_S = 30
# Row columns that differ between two runs of the same unit by nature: identity in its database, and timings.
# Artifact URIs and hashes differ by run (timestamps in the stream, the workspace archive); their contents are
# compared below.
ROW_VOLATILE = {
    "id",
    "cycle_id",
    "started_at",
    "finished_at",
    "duration_s",
    "created_at",
    "artifacts",
    "artifact_sha256",
}
# Status-document fields that are timings, and in its `hiw` part those naming places (the proxy's port, the store).
STATUS_VOLATILE = {"started_at", "finished_at", "durations"}
HIW_PLACES = ("client_endpoint", "prompt_source", "api_log")
STORE_VARIABLES = ("MASS_METADATA_URL", "MASS_ARTIFACT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def base_env(**extra: str) -> dict[str, str]:
    """A child's whole environment: nothing inherited but PATH and HOME (so no store credential leaks in)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def episode_process(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, "episode", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def pod_config(config: CycleConfig, tmp: Path) -> Path:
    """The config as a pod receives it: without `storage` (each container takes its stores from its environment)."""
    path = tmp / "pod-config.json"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude={"storage"})))
    return path


def unit_args(prompt: Path, scratch: Path, *, seed: int = SEED) -> list[str]:
    unit = ["--task", str(TASK), "--kind", "reference", "--seed", str(seed), "--prompt-file", str(prompt)]
    return [*unit, "--scratch-dir", str(scratch), "--log-format", "json"]


def store_env(config: CycleConfig, s3: MotoS3Server | None) -> dict[str, str]:
    env = {"MASS_METADATA_URL": config.storage.metadata_url, "MASS_ARTIFACT_URL": config.storage.artifact_url}
    if s3 is not None:
        env |= s3.environment() | {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    return env


@pytest.fixture
def pod(tmp_path: Path) -> dict[str, Any]:
    """What both containers share: the hand-off folder (an emptyDir: there before either container starts) and the
    scratch folder of the sandbox."""
    (tmp_path / "handoff").mkdir()
    return {"handoff": tmp_path / "handoff", "scratch": tmp_path / "scratch"}


def run_pod(
    config_file: Path,
    pod: dict[str, Any],
    run_args: list[str],
    sandbox_env: dict[str, str],
    publisher_env: dict[str, str],
    *,
    publish_args: tuple[str, ...] = (),
    while_running: Callable[[subprocess.Popen[str]], None] | None = None,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """The two containers of an episode pod as two processes; returns both exit codes and outputs."""
    handoff = str(pod["handoff"])
    return run_containers(
        ["run", "--handoff", handoff, "--config", str(config_file), *run_args],
        ["publish", "--handoff", handoff, "--config", str(config_file), "--log-format", "json", *publish_args],
        sandbox_env,
        publisher_env,
        while_running=while_running,
        timeout_s=timeout_s,
    )


def run_containers(
    run_args: list[str],
    publish_args: list[str],
    sandbox_env: dict[str, str],
    publisher_env: dict[str, str],
    *,
    while_running: Callable[[subprocess.Popen[str]], None] | None = None,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """`mass-ops episode <run_args>` and `mass-ops episode <publish_args>` side by side, the publisher first."""
    publisher = episode_process(publish_args, publisher_env)
    sandbox = episode_process(run_args, sandbox_env)
    try:
        if while_running is not None:
            while_running(sandbox)
        deadline = time.monotonic() + timeout_s
        stranded_since: float | None = None
        while True:
            try:  # in slices: a retried communicate() loses no output, and it keeps the sandbox's pipes drained
                run_out, run_err = sandbox.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise
            # A publisher that died without a word leaves the sandbox waiting for its start timeout (minutes):
            # end the run early and show the publisher's own message instead of a bare timeout.
            if publisher.poll() not in (None, 0):
                stranded_since = stranded_since or time.monotonic()
                if time.monotonic() - stranded_since > PUBLISHER_GRACE_S:
                    pytest.fail(f"the publisher exited {publisher.returncode}: {publisher.communicate()[1]}")
        pub_out, pub_err = publisher.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in (sandbox, publisher):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {
        "run": (sandbox.returncode, run_out, run_err),
        "publish": (publisher.returncode, pub_out, pub_err),
    }


def rows(ctx: CycleContext) -> list[dict[str, Any]]:
    return [
        {column: getattr(row, column) for column in row.__table__.columns.keys()}  # noqa: SIM118
        for row in ctx.repo.episodes(ctx.cycle_id)
    ]


def relative(uri: str, store_url: str) -> str:
    assert uri.startswith(store_url.rstrip("/") + "/"), (uri, store_url)
    return uri[len(store_url.rstrip("/")) + 1 :]


def tree(tarball: bytes) -> dict[str, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        return {m.name: archive.extractfile(m).read() if m.isreg() else None for m in archive.getmembers()}  # type: ignore[union-attr]


def recorded(ctx: CycleContext, row: dict[str, Any]) -> dict[str, Any]:
    """The row and its artifacts in comparable form: volatile fields out, URIs relative to the store root."""
    store = ctx.artifacts
    prefix = EpisodeUnit(ctx.cycle_name, TASK, "reference", row["seed"], attempt=row["attempt"]).artifact_prefix()
    files = {name: store.get_bytes(f"{prefix}/{file}") for name, file in EPISODE_FILES.items()}
    status = json.loads(files["status"])
    places = {name: status["hiw"].pop(name) for name in HIW_PLACES}
    settings = json.loads(files["settings"])
    for provider in settings["modelProviders"]["openai"]:
        provider.pop("baseUrl")  # the proxy's ephemeral port
    api_log = [json.loads(line) for line in gzip.decompress(files["api_log"]).splitlines()]
    workspace: dict[str, Any] = tree(files["workspace"])
    if "agent_env.json" in workspace:  # the stand-in's dump of its environment: the scope marker is random per run
        dumped = json.loads(workspace["agent_env.json"])
        dumped["env"].pop("MASS_EPISODE_SCOPE")
        workspace["agent_env.json"] = dumped
    return {
        "row": {k: v for k, v in row.items() if k not in ROW_VOLATILE},
        "artifacts": {name: relative(uri, store.url) for name, uri in row["artifacts"].items()},
        "status": {k: v for k, v in status.items() if k not in STATUS_VOLATILE},
        "status_uris": {name: relative(places[name], store.url) for name in ("prompt_source", "api_log")},
        "prompt": files["prompt"],
        "workspace": workspace,
        "settings": settings,
        "stream_events": [json.loads(line).get("type") for line in files["stream"].splitlines()],
        "api_requests": [(r["path"], r["status"], r["request"].get("seed")) for r in api_log],
        "stderr": files["stderr"],
    }


def compare_with_a_direct_run(
    tmp: Path,
    server: PolicyServer,
    s3: MotoS3Server,
    prompt_text: str,
    runtime_env: dict[str, str],
    pod: dict[str, Any],
    *,
    inference: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    endpoint = f"{server.base_url}/v1"
    # The pod's agent runs in its sandbox container, not under bwrap: the direct run's agent runs as a plain process
    # too, so that both agents see the same environment (real qwen-code writes it into every prompt).
    plain = {"sandbox": "none", "allow_unsandboxed_agent": True}
    direct = open_episode_cycle(tmp / "direct", endpoint, inference=inference, **plain)
    s3_url = f"s3://{s3.bucket}/handoff-test/{os.urandom(4).hex()}"
    published = open_episode_cycle(tmp / "pod", endpoint, artifact_url=s3_url, inference=inference, **plain)
    config_file = pod_config(published.config, tmp)
    prompt = tmp / "prompt.txt"
    prompt.write_text(prompt_text)

    # The direct local run: one process with the key and the stores (the same scratch folder, so the same paths).
    local = episode_process(
        ["run", "--config", str(config_file), *unit_args(prompt, pod["scratch"])],
        base_env(**runtime_env, **{KEY_VAR: API_KEY}, **store_env(direct.config, None)),
    )
    _, err = local.communicate(timeout=300)
    assert local.returncode == 0, err

    # The pod: the sandbox without any store setting, the publisher without the key.
    result = run_pod(
        config_file,
        pod,
        unit_args(prompt, pod["scratch"]),
        base_env(**runtime_env, **{KEY_VAR: API_KEY}),
        base_env(**store_env(published.config, s3)),
    )
    code, run_out, run_err = result["run"]
    assert code == 0, run_err
    code, pub_out, pub_err = result["publish"]
    assert code == 0, pub_err
    for text in (run_out, run_err, pub_out, pub_err):
        assert API_KEY not in text and s3.secret_access_key not in text

    [direct_row], [pod_row] = rows(direct), rows(published)
    # Both processes print the outcome with the real episode id (the sandbox learns it from the publisher's ack).
    assert json.loads(run_out)["episode_id"] == json.loads(pub_out)["episode_id"] == pod_row["id"]
    assert all(uri.startswith(s3_url) for uri in pod_row["artifacts"].values())
    return recorded(direct, direct_row), recorded(published, pod_row)


def assert_same_record(direct: dict[str, Any], via_pod: dict[str, Any]) -> None:
    for field in direct:  # field by field, so a failure names what differs
        assert via_pod[field] == direct[field], field


def test_handoff_records_what_a_direct_run_records(
    policy_host: PolicyHost, tmp_path: Path, s3_environment: MotoS3Server, pod: dict[str, Any]
) -> None:
    runtime = fake_qwen_runtime(tmp_path / "runtime")  # the stand-in agent, launched the way qwen-code is
    with policy_host.serve() as server:
        direct, via_pod = compare_with_a_direct_run(
            tmp_path,
            server,
            s3_environment,
            "Write the report.\n@agent requests=2 dump=1",
            {"MASS_RUNTIME_DIR": str(runtime)},
            pod,
        )
    assert_same_record(direct, via_pod)
    assert via_pod["row"]["status"] == "succeeded" and via_pod["row"]["requests"] == 2
    # The agent inside the sandbox saw no store setting (its whole environment is an allow-list anyway).
    seen = via_pod["workspace"]["agent_env.json"]["env"]
    assert not set(seen) & set(STORE_VARIABLES)
    assert sorted(os.listdir(pod["handoff"] / "acks")) == [f"reference-t{TASK}-s{SEED}-a1.json"]


@pytest.mark.slow(seconds=13)
def test_real_qwen_code_episode_through_the_handoff(
    policy_host: PolicyHost, tmp_path: Path, s3_environment: MotoS3Server, qwen_install: QwenInstall, pod: dict
) -> None:
    runtime_env = {"MASS_RUNTIME_DIR": str(qwen_install.qwen_entry.parents[4])}
    with policy_host.serve(argument_fragments=4, chunk_chars=16) as server:
        direct, via_pod = compare_with_a_direct_run(
            tmp_path,
            server,
            s3_environment,
            "Produce research_report.md and results/metrics.json.",
            runtime_env,
            pod,
            inference={"backend": "vllm"},
        )
    assert via_pod["row"]["status"] == "succeeded" and via_pod["row"]["qwen_code_version"] == "0.21.10"
    assert via_pod["workspace"]["research_report.md"].startswith(b"# Research report")  # type: ignore[union-attr]
    assert_same_record(direct, via_pod)


def test_retries_continue_after_the_recorded_attempts(
    policy_host: PolicyHost, tmp_path: Path, pod: dict[str, Any]
) -> None:
    runtime = fake_qwen_runtime(tmp_path / "runtime")
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path / "pod", f"{server.base_url}/v1")
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Write the report.\n@agent requests=1")
        sha = hashlib.sha256(prompt.read_bytes()).hexdigest()
        failed = ctx.repo.record_episode(
            ctx.cycle_id, task_id=TASK, kind="reference", seed=SEED, status="infra_failure", prompt_sha256=sha
        )
        config_file = pod_config(ctx.config, tmp_path)
        sandbox_env = base_env(MASS_RUNTIME_DIR=str(runtime), **{KEY_VAR: API_KEY})
        publisher_env = base_env(**store_env(ctx.config, None))
        first = run_pod(config_file, pod, unit_args(prompt, pod["scratch"]), sandbox_env, publisher_env)
        assert first["run"][0] == 0 and first["publish"][0] == 0, first
        requests_after_first = server.stats.chat_requests

        # A second pod for the same unit (an Airflow retry after the row was committed) runs nothing.
        again = {"handoff": tmp_path / "handoff-2", "scratch": pod["scratch"]}
        again["handoff"].mkdir()  # the new pod's own emptyDir
        second = run_pod(config_file, again, unit_args(prompt, pod["scratch"]), sandbox_env, publisher_env)
        assert second["run"][0] == 0 and second["publish"][0] == 0, second
        assert server.stats.chat_requests == requests_after_first

    recorded_rows = {row.attempt: row for row in ctx.repo.episodes(ctx.cycle_id)}
    assert set(recorded_rows) == {1, 2}
    assert recorded_rows[2].status == "succeeded" and recorded_rows[2].retry_of_id == failed.id
    assert json.loads(first["run"][1])["attempt"] == 2
    reused = json.loads(second["run"][1])
    assert reused["reused"] is True and reused["episode_id"] == recorded_rows[2].id
    assert second["publish"][1] == "" and not (again["handoff"] / "attempts").exists()


def test_a_sandbox_that_dies_leaves_an_incomplete_handoff_that_is_refused(
    policy_host: PolicyHost, tmp_path: Path, pod: dict[str, Any]
) -> None:
    runtime = fake_qwen_runtime(tmp_path / "runtime")
    with policy_host.serve() as server:
        # A plain agent process: the test reaps its sleepers by their host pids afterwards.
        ctx = open_episode_cycle(
            tmp_path / "pod", f"{server.base_url}/v1", sandbox="none", allow_unsandboxed_agent=True
        )
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Work for a while.\n@agent requests=1 sleep=60")
        config_file = pod_config(ctx.config, tmp_path)

        def kill_once_the_agent_runs(sandbox: subprocess.Popen[str]) -> None:
            deadline = time.monotonic() + 120
            while server.stats.chat_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(sandbox.pid, signal.SIGKILL)  # OOM-killed container: no marker, no more heartbeats

        result = run_pod(
            config_file,
            pod,
            unit_args(prompt, pod["scratch"]),
            base_env(MASS_RUNTIME_DIR=str(runtime), **{KEY_VAR: API_KEY}),
            base_env(**store_env(ctx.config, None)),
            publish_args=("--stale-after-s", "8"),
            while_running=kill_once_the_agent_runs,
        )
    workspace = next(pod["scratch"].glob(f"{ctx.cycle_name}/*/workspace"))
    for pid in (workspace / "pids.txt").read_text().split():  # the agent's sleepers outlive a SIGKILLed runner
        if process_alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)
    code, _out, err = result["publish"]
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines[-1].startswith(f"episode publish: hand-off {pod['handoff']} is incomplete: the episode container ")
    assert "before writing complete.json" in lines[-1]
    assert ctx.repo.episodes(ctx.cycle_id) == [] and ctx.artifacts.list("cycles/") == []
    assert (pod["handoff"] / hand.PUBLISHER_FAILED_FILE).exists()


# --- a pod built by the operator's code, then its stage -------------------------------------------------------


def local_command(command: list[str], config_file: Path, handoff: Path, proxy_dir: Path | None = None) -> list[str]:
    """A container command of an episode pod manifest as a local `episode` command line: the mounted config file,
    hand-off folder and proxy folder replaced by their local places."""

    assert command[:2] == ["mass-ops", "episode"], command
    return [_local_arg(arg, config_file, handoff, proxy_dir) for arg in command[2:]]


def _local_arg(arg: str, config_file: Path, handoff: Path, proxy_dir: Path | None) -> str:
    from mass_ops.compute import kubernetes as specs

    if arg == specs.CONFIG_FILE:
        return str(config_file)
    for mount, local in ((specs.HANDOFF_MOUNT, handoff), (specs.PROXY_LOG_MOUNT, proxy_dir)):
        if local is not None and (arg == mount or arg.startswith(f"{mount}/")):
            return str(local) + arg.removeprefix(mount)
    return arg


def proxy_container(command: list[str], proxy_dir: Path, upstream: str) -> subprocess.Popen[str]:
    """The pod's proxy container as a local process: its command with the local interpreter, folder and upstream, on
    an ephemeral port; returns once it listens (its port file, as the startup probe waits for it)."""
    from mass_ops.compute import kubernetes as specs

    args = [_local_arg(arg, Path(), Path(), proxy_dir) for arg in command[1:]]
    args[args.index("--listen") + 1] = "0"
    args[args.index("--upstream") + 1] = upstream
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=base_env(**{KEY_VAR: API_KEY}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = Path(_local_arg(specs.PROXY_READY_FILE, Path(), Path(), proxy_dir))
    deadline = time.monotonic() + 60
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), process.communicate(timeout=5)[1] if process.poll() is not None else "no port file"
    return process


def test_a_collection_pod_records_the_episode_its_stage_then_reuses(
    policy_host: PolicyHost, tmp_path: Path, pod: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mass_ops.compute import kubernetes as specs
    from mass_ops.stages import api as stages
    from mass_ops.stages.units import episode_request, publish_prompt

    runtime = fake_qwen_runtime(tmp_path / "runtime")
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path / "pod", f"{server.base_url}/v1")
        # The search retained v0 of the task (it beat the reference): its teacher candidates are collected.
        ctx.repo.record_workflow_version(ctx.cycle_id, TASK, 0, design="v0")
        ctx.repo.record_retained_workflow(ctx.cycle_id, TASK, version=0, beats_reference=True, last_evaluated_version=0)
        # What EpisodeStageOperator does in the Airflow worker, then the pod's three containers as processes: the
        # proxy with the key, the sandbox with nothing, the publisher with the stores and the proxy's control.
        identity = specs.EpisodeSpec("collection", TASK, candidate=1)
        request = episode_request(ctx, identity)
        bound = identity.bound(request, publish_prompt(ctx, request))
        spec = specs.episode_pod(ctx.config, specs.WorkloadSettings(), bound)["spec"]
        sandbox, publisher = spec["containers"]
        config_file = pod_config(ctx.config, tmp_path)
        proxy_dir = tmp_path / "proxy"
        proxy = proxy_container(spec["initContainers"][0]["command"], proxy_dir, server.base_url)
        try:
            result = run_containers(
                [*local_command(sandbox["command"], config_file, pod["handoff"]), "--scratch-dir", str(pod["scratch"])],
                local_command(publisher["command"], config_file, pod["handoff"], proxy_dir),
                base_env(MASS_RUNTIME_DIR=str(runtime)),
                base_env(**store_env(ctx.config, None)),
            )
        finally:
            os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(timeout=30)
        assert result["run"][0] == 0 and result["publish"][0] == 0, result
        [row] = ctx.repo.episodes(ctx.cycle_id)
        assert (row.kind, int(row.task_id), row.candidate, row.seed, row.condition, row.status) == (
            "collection", TASK, 1, request.unit.seed, request.condition, "succeeded",
        )  # fmt: skip
        assert row.prompt_sha256 == request.prompt_sha256
        assert (pod["handoff"] / hand.PROMPT_FILE).read_text() == request.prompt
        agent_requests = server.stats.chat_requests
        assert agent_requests > 0

        # Then the stage, in the worker: it finds the episode recorded and reuses it.
        monkeypatch.setenv("MASS_RUNTIME_DIR", str(runtime))
        monkeypatch.setenv(KEY_VAR, API_KEY)
        done = stages.collect_candidate(ctx.config, TASK, 1)
        assert done == {"task_id": TASK, "candidate": 1, "episode_id": row.id, "status": "succeeded", "attempt": 1}
        assert server.stats.chat_requests == agent_requests, "no second agent run"
    assert [r.id for r in ctx.repo.episodes(ctx.cycle_id)] == [row.id], "no second episode row"


def test_a_publisher_that_cannot_reach_the_cycle_stops_the_sandbox(
    policy_host: PolicyHost, tmp_path: Path, pod: dict[str, Any]
) -> None:
    runtime = fake_qwen_runtime(tmp_path / "runtime")
    with policy_host.serve() as server:
        config = episode_config(tmp_path / "pod", f"{server.base_url}/v1")  # never opened: no cycle row
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Write.\n@agent requests=1")
        result = run_pod(
            pod_config(config, tmp_path),
            pod,
            unit_args(prompt, pod["scratch"]),
            base_env(MASS_RUNTIME_DIR=str(runtime), **{KEY_VAR: API_KEY}),
            base_env(**store_env(config, None)),
        )
        assert server.stats.chat_requests == 0, "no agent starts before the publisher has answered"
    run_code, _, run_err = result["run"]
    pub_code, _, pub_err = result["publish"]
    assert pub_code == 1 and "is not open: run the validate_config stage first" in pub_err
    assert run_code == 1 and len(run_err.strip().splitlines()) == 1
    assert "the publisher gave up" in run_err and "validate_config" in run_err
    completion = hand.Handoff(pod["handoff"]).read(pod["handoff"] / hand.COMPLETE_FILE, hand.Completion)
    assert completion.exit_code == 1


def test_a_sandbox_refusing_its_input_leaves_nothing_to_publish(tmp_path: Path, pod: dict[str, Any]) -> None:
    ctx = open_episode_cycle(tmp_path / "pod", "http://127.0.0.1:9/v1")
    args = ["--task", str(TASK), "--kind", "reference", "--seed", "1", "--prompt-uri", "s3://bucket/prompt.txt"]
    result = run_pod(
        pod_config(ctx.config, tmp_path),
        pod,
        args,
        base_env(**{KEY_VAR: API_KEY}),
        base_env(**store_env(ctx.config, None)),
    )
    run_code, _, run_err = result["run"]
    assert run_code == 2 and run_err.strip() == (
        "--prompt-uri: a --handoff run reads no artifact store; use --prompt-file"
    )
    assert result["publish"][0] == 0, result["publish"][2]
    assert not (pod["handoff"] / hand.REQUEST_FILE).exists() and ctx.repo.episodes(ctx.cycle_id) == []


def test_publish_needs_the_prompt_uri_and_its_hash_together(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    args = ["publish", "--handoff", str(tmp_path / "handoff"), "--config", str(pod_config(ctx.config, tmp_path))]
    process = episode_process([*args, "--prompt-uri", "s3://bucket/p.txt"], base_env(**store_env(ctx.config, None)))
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 2 and err.strip() == "episode publish: give --prompt-uri and --prompt-sha256 together"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--proxy-control", "/p/control.sock"], "give --proxy-control and --proxy-sessions together"),
        (["--endpoint", "http://vllm-l1:8000/v1"], "give --endpoint and --served-name together"),
        (["--endpoint", "ftp://x/v1", "--served-name", "L1"], "--endpoint: episode server: 'ftp://x/v1' is not"),
    ],
)
def test_publish_needs_the_proxy_s_socket_and_folder_and_a_server_s_name_together(
    tmp_path: Path, given: list[str], message: str
) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    args = ["publish", "--handoff", str(tmp_path), "--config", str(pod_config(ctx.config, tmp_path)), *given]
    process = episode_process(args, base_env(**store_env(ctx.config, None)))
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_publish_refuses_a_handoff_folder_that_does_not_exist(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    missing = tmp_path / "no-such-volume"
    args = ["publish", "--handoff", str(missing), "--config", str(pod_config(ctx.config, tmp_path))]
    process = episode_process(args, base_env(**store_env(ctx.config, None)))
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 2
    assert err.strip() == f"episode publish: --handoff {missing} is not a folder (the volume both containers share)"
    assert not missing.exists(), "nothing created"
