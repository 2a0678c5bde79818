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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime import handoff as hand
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.qwen_install import QwenInstall
from tests.fixtures.s3 import MotoS3Server
from tests.policy_server import PolicyServer
from tests.runtime.hostile_agent import hostile_findings
from tests.support.runtime import (
    API_KEY,
    KEY_VAR,
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
TASK, SEED = 51, 450051
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


@pytest.mark.slow
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


# --- the protocol, in-process --------------------------------------------------------------------------------


class ScriptedSandbox:
    """The sandbox side written by hand, for hand-offs no honest `episode run` produces."""

    def __init__(self, root: Path, config: CycleConfig, prompt: str) -> None:
        self.handoff = hand.Handoff(root)
        self.config = config
        self.prompt = prompt

    def announce_only(self) -> None:
        """Write request.json (and a heartbeat) as the sandbox does before it waits for the ledger."""
        unit = hand.HandoffUnit(
            task_id=TASK,
            kind="reference",
            seed=SEED,
            condition=f"t{TASK}_bare",
            prompt_sha256=hashlib.sha256(self.prompt.encode()).hexdigest(),
        )
        request = hand.HandoffRequest(cycle=self.config.cycle_name, config_hash=self.config.config_hash(), units=[unit])
        self.handoff.write(self.handoff.path(hand.REQUEST_FILE), request)
        self.handoff.path(hand.SANDBOX_ALIVE).touch()

    def announce(self) -> hand.Ledger:
        self.announce_only()
        ledger = self.handoff.path(hand.LEDGER_FILE)
        deadline = time.monotonic() + 60
        while not ledger.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.handoff.read(ledger, hand.Ledger)

    def attempt(self, attempt: int, *, prompt: str | None = None, finished: bool = True) -> Path:
        slug = EpisodeUnit(self.config.cycle_name, TASK, "reference", SEED).slug
        folder = self.handoff.attempt_dir(slug, attempt)
        target = folder if finished else folder.with_name(f".{folder.name}.partial")
        target.mkdir(parents=True)
        for name in hand.ATTEMPT_FILES:
            (target / EPISODE_FILES[name]).write_bytes(b"")
        (target / EPISODE_FILES["prompt"]).write_text(prompt or self.prompt)
        return target

    def complete(self, code: int = 0) -> None:
        self.handoff.write(self.handoff.path(hand.COMPLETE_FILE), hand.Completion(exit_code=code))


def serve_in_thread(publisher: hand.HandoffPublisher) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def serve() -> None:
        try:
            result["code"] = publisher.run()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, result


def finished_publication(folder: Path, attempt: int) -> None:
    from datetime import UTC, datetime

    record = {
        "status": "succeeded",
        "model": "m",
        "exit_code": 0,
        "failure": None,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "requests": 1,
        "max_prompt_tokens": 1,
        "started_at": datetime.now(UTC).isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "qwen_code_version": "x",
    }
    document = {"unit": folder.parent.name, "attempt": attempt, "record": record, "status": {}}
    (folder / hand.PUBLICATION_FILE).write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("unfinished attempt", "attempt a1 of reference-t51-s450051 was never finished (no publication.json)"),
        ("changed prompt", "the prompt of reference-t51-s450051/a1 differs from the one announced"),
        ("stray folder", "attempts/reference-t51-s450051/a7 is not an attempt the episode container announced"),
    ],
)
def test_the_publisher_refuses_what_was_not_handed_over_whole(tmp_path: Path, scenario: str, message: str) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    ledger = sandbox.announce()
    assert ledger.cycle_id == ctx.cycle_id and ledger.artifact_url == ctx.artifacts.url
    if scenario == "unfinished attempt":
        sandbox.attempt(1, finished=False)
    elif scenario == "changed prompt":
        finished_publication(sandbox.attempt(1, prompt="another prompt"), 1)
    else:
        finished_publication(sandbox.attempt(7), 7)
    sandbox.complete()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert message in str(error) and "\n" not in str(error)
    assert ctx.repo.episodes(ctx.cycle_id) == [] and ctx.artifacts.list("cycles/") == []
    failure = sandbox.handoff.read(sandbox.handoff.path(hand.PUBLISHER_FAILED_FILE), hand.PublisherFailure)
    assert message in failure.error


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


def test_what_the_publisher_writes_to_the_folder_carries_no_credential(tmp_path: Path) -> None:
    config = episode_config(tmp_path, "http://127.0.0.1:9/v1", metadata_url="postgresql://mass:pg-pass-9f3@db/mass")
    environ = {"AWS_SECRET_ACCESS_KEY": "wJalr-secret-71", "AWS_ACCESS_KEY_ID": "AKIA-id-55"}
    publisher = hand.HandoffPublisher(config, tmp_path / "handoff", environ=environ)
    leaked = "could not connect to postgresql://mass:pg-pass-9f3@db/mass as AKIA-id-55 / wJalr-secret-71 (pg-pass-9f3)"
    scrubbed = publisher.scrubbed(leaked)
    assert not {"pg-pass-9f3", "wJalr-secret-71", "AKIA-id-55"} & set(scrubbed.replace("/", " ").split())
    assert "pg-pass-9f3" not in scrubbed and scrubbed.startswith("could not connect to [REDACTED] as [REDACTED]")


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


def test_a_failed_upload_is_acknowledged_as_an_error_and_no_row_is_written(tmp_path: Path) -> None:
    import dataclasses

    from mass_ops.store.artifacts import ArtifactError
    from mass_ops.store.local_artifacts import LocalArtifactStore

    class FullDisk(LocalArtifactStore):
        def _publish(self, key: str, staged: Path, sha256: str, size: int) -> Any:
            if key.endswith("stream.jsonl"):
                raise ArtifactError(f"cannot store {key}: no space left on device")
            return super()._publish(key, staged, sha256, size)

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    broken = dataclasses.replace(ctx, artifacts=FullDisk(str(tmp_path / "artifacts")))
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: broken)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    finished_publication(sandbox.attempt(1), 1)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 1} and publisher.failures == 1
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
    ack = sandbox.handoff.read(sandbox.handoff.ack_path(unit.slug, 1), hand.Ack)
    assert ack.episode_id is None
    assert ack.error == f"ArtifactError: cannot store {unit.artifact_key('stream')}: no space left on device"
    assert ctx.repo.episodes(ctx.cycle_id) == [], "the row comes only after every artifact"
    assert not ctx.artifacts.exists(unit.artifact_key("status"))


def test_a_rollout_runs_on_the_server_the_publisher_looks_up(tmp_path: Path) -> None:
    from mass_ops.compute.kubernetes import inference_url
    from mass_ops.config import validate_config
    from tests.inner_loop_fakes import open_test_cycle

    data = episode_config(tmp_path, "http://127.0.0.1:9/v1").model_dump(mode="json")
    data["compute"]["backend"] = "kubernetes"
    ctx = open_test_cycle(validate_config(data))
    ctx.repo.register_generation("L1", 1, bf16_uri="models/L1-bf16", served_name="L1")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    unit = EpisodeUnit(ctx.cycle_name, TASK, "rollout", SEED, candidate=2, generation="L1")
    with hand.SandboxHandoff(tmp_path / "handoff") as session:
        sandbox_ctx = session.open(ctx.config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt="p")])
    thread.join(timeout=60)
    assert result == {"code": 0}
    assert sandbox_ctx.config.inference.endpoint == inference_url(ctx.config, ctx.cycle_name, "L1")
    assert sandbox_ctx.config.models.served_name == "L1"
    assert (
        sandbox_ctx.repo.episode_attempts(0, task_id=TASK, kind="rollout", seed=SEED, candidate=2, generation="L1")
        == []
    )


def delivering_publisher(
    ctx: CycleContext, root: Path, prompt: str, *, stored: bytes | None = None, uri: str | None = None
) -> hand.HandoffPublisher:
    """A publisher told to deliver `prompt`: stored as the operator stores it (or `stored` bytes under its key, or
    nothing when `stored` is b""), announced under `uri` (default: the artifact's own)."""
    from mass_ops.layout import episode_prompt_key

    sha = hashlib.sha256(prompt.encode()).hexdigest()
    key = episode_prompt_key(ctx.cycle_name, sha)
    data = prompt.encode() if stored is None else stored
    if data:
        ctx.artifacts.put_bytes(key, data)
    delivery = hand.PromptDelivery(uri or ctx.artifacts.uri(key), sha)
    return hand.HandoffPublisher(ctx.config, root, attach=lambda _config: ctx, prompt=delivery)


def test_the_publisher_writes_the_prompt_before_the_sandbox_reads_it(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    prompt = "the prompt of the unit\n"
    thread, result = serve_in_thread(delivering_publisher(ctx, tmp_path / "handoff", prompt))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
        assert (tmp_path / "handoff" / hand.PROMPT_FILE).read_text() == prompt
        sandbox.await_prompt(tmp_path / "elsewhere.txt")  # a prompt file of its own: nothing to wait for
        unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
        sandbox.open(ctx.config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt=prompt)])
    thread.join(timeout=60)
    assert result == {"code": 0}


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("missing", "does not exist"),
        ("other bytes", "does not hold the prompt of SHA-256"),
        ("another uri", "is not the prompt artifact of cycle episode-test with SHA-256"),
    ],
)
def test_a_prompt_the_publisher_cannot_vouch_for_stops_the_pod(tmp_path: Path, scenario: str, message: str) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    options: dict[str, Any] = {
        "missing": {"stored": b""},
        "other bytes": {"stored": b"a prompt the operator never computed"},
        "another uri": {"uri": ctx.artifacts.uri("cycles/elsewhere/prompt.txt")},
    }[scenario]
    thread, result = serve_in_thread(delivering_publisher(ctx, tmp_path / "handoff", "the prompt", **options))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with pytest.raises(hand.HandoffError) as caught, sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
    thread.join(timeout=60)
    assert isinstance(result.get("error"), hand.PromptDeliveryError) and message in str(result["error"])
    assert "the publisher gave up" in str(caught.value) and message in str(caught.value)
    assert not (tmp_path / "handoff" / hand.PROMPT_FILE).exists()


def test_a_request_announcing_another_prompt_is_refused(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    publisher = delivering_publisher(ctx, tmp_path / "handoff", "the delivered prompt")
    thread, result = serve_in_thread(publisher)
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "a prompt of its own")
    sandbox.announce_only()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "request.json announces reference-t51-s450051 with prompt" in str(error)
    assert "not the prompt" in str(error) and not (tmp_path / "handoff" / hand.LEDGER_FILE).exists()


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


# --- budgets: a pod's spend reaches the ledger at ingest; the sandbox sees the scopes' spend -------------------------


def api_log_with_costs(folder: Path, *costs: float) -> None:
    """The attempt's proxy log (gzip JSON lines) with one completion per cost, as a server reporting `usage.cost`."""
    lines = [
        json.dumps({"seq": i, "path": "/v1/chat/completions", "response": {"usage": {"prompt_tokens": 1, "cost": c}}})
        for i, c in enumerate(costs)
    ]
    (folder / EPISODE_FILES["api_log"]).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def spend(ctx: CycleContext) -> dict[str, tuple[int, float, int]]:
    return {s: (r.tokens, round(r.cost_usd, 6), r.requests) for s, r in ctx.repo.budget_spend(ctx.cycle_id).items()}


def test_a_pods_spend_is_charged_once_when_its_attempt_is_recorded(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    ctx.repo.add_budget_spend(ctx.cycle_id, ["cycle"], tokens=10, requests=1)  # spent before, elsewhere
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = sandbox.attempt(1)
    api_log_with_costs(folder, 0.0125, 0.0025)
    finished_publication(folder, 1)  # 1 prompt + 1 completion token, 1 request
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}
    charged = {"task:51": (2, 0.015, 1), "cycle": (12, 0.015, 2)}
    assert spend(ctx) == charged

    # The ingest retried (a publisher started again on the same folder, the operator's retry): the row exists, so
    # its spend was charged by the ingest that recorded it; nothing is added.
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(2):
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert publisher.failures == 0 and len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == charged


def test_an_ingest_that_failed_before_the_row_charges_when_it_is_retried(tmp_path: Path) -> None:
    from mass_ops.store.artifacts import ArtifactError
    from mass_ops.store.local_artifacts import LocalArtifactStore

    class FullDisk(LocalArtifactStore):
        def _publish(self, key: str, staged: Path, sha256: str, size: int) -> Any:
            if key.endswith("stream.jsonl"):
                raise ArtifactError(f"cannot store {key}: no space left on device")
            return super()._publish(key, staged, sha256, size)

    import dataclasses

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    broken = dataclasses.replace(ctx, artifacts=FullDisk(str(tmp_path / "artifacts")))
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: broken)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    finished_publication(sandbox.attempt(1), 1)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 1} and spend(ctx) == {}, "no row, no charge"
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(2):
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == {"task:51": (2, 0.0, 1), "cycle": (2, 0.0, 1)}


def test_a_charge_lost_after_the_row_was_recorded_is_made_once_by_the_retried_ingest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash window between committing the attempt's row and charging it: the retry charges, exactly once."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    real_charge = hand.charge_episode

    def killed(*args: Any, **kwargs: Any) -> bool:
        raise ConnectionError("the publisher's connection dropped after the row was committed")

    monkeypatch.setattr(hand, "charge_episode", killed)
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    finished_publication(sandbox.attempt(1), 1)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0} and len(ctx.repo.episodes(ctx.cycle_id)) == 1, "the row is durable"
    assert spend(ctx) == {}, "its charge was lost"

    monkeypatch.setattr(hand, "charge_episode", real_charge)
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(3):  # the operator's retries ingest the same attempt again
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert publisher.failures == 0 and len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == {"task:51": (2, 0.0, 1), "cycle": (2, 0.0, 1)}, "charged once, by the first retry"


def test_the_sandbox_checks_the_task_and_cycle_spend_the_publisher_read(tmp_path: Path) -> None:
    from mass_ops.config import validate_config
    from mass_ops.store.budgets import BudgetLedger, BudgetLimits, episode_scopes

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    data = ctx.config.model_dump(mode="json")
    data["budgets"] = {"task_tokens": 1_000, "cycle_tokens": 50_000, "episode_tokens": 400}
    config = validate_config(data)
    ctx.repo.add_budget_spend(ctx.cycle_id, episode_scopes(TASK), tokens=1_000)
    ctx.repo.add_budget_spend(ctx.cycle_id, episode_scopes(202), tokens=7)  # another task's: not handed over
    publisher = hand.HandoffPublisher(config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
    with hand.SandboxHandoff(tmp_path / "handoff") as session:
        sandbox_ctx = session.open(config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt="p")])
    thread.join(timeout=60)
    assert result == {"code": 0}
    seen = sandbox_ctx.repo.budget_spend(sandbox_ctx.cycle_id)
    assert {scope: row.tokens for scope, row in seen.items()} == {"task:51": 1_000, "cycle": 1_007}
    # The pod's pool asks this before each attempt, as it asks the store on the local backend.
    ledger = BudgetLedger(sandbox_ctx.repo, sandbox_ctx.cycle_id, BudgetLimits.from_mapping(data["budgets"]))
    refused = ledger.exhausted(episode_scopes(TASK))
    assert refused is not None and refused.setting == "budgets.task_tokens"


@pytest.mark.parametrize("task_id", ["tb2_hello-world", "swe_django__django-11099", 51])
def test_a_unit_names_a_cycle_task_by_number_and_a_benchmark_task_by_name(tmp_path: Path, task_id: Any) -> None:
    handoff = hand.Handoff(tmp_path)
    unit = hand.HandoffUnit(
        task_id=task_id, kind="benchmark", seed=1, candidate=0, generation="L1", condition="c", prompt_sha256="0" * 64
    )
    request = hand.HandoffRequest(cycle="c", config_hash="0" * 64, units=[unit])
    handoff.write(handoff.path(hand.REQUEST_FILE), request)
    assert handoff.read(handoff.path(hand.REQUEST_FILE), hand.HandoffRequest).units[0].task_id == task_id


@pytest.mark.parametrize("task_id", ["../tb2_x", "tb2_x/../y", "tb2_", "TB2_x", "", 0, -3])
def test_a_task_name_that_could_climb_out_of_a_key_is_refused(task_id: Any) -> None:
    with pytest.raises(ValidationError):
        hand.HandoffUnit(task_id=task_id, kind="benchmark", seed=1, condition="c", prompt_sha256="0" * 64)


# --- a benchmark task's workspace seed (ISSUE #18) -----------------------------------------------------------------


def stored_seed(ctx: CycleContext, files: dict[str, bytes], *, stored: bytes | None = None) -> Any:
    """A workspace seed archived as the benchmark stage archives one, stored under its SHA-256 (or `stored` bytes
    under that key, nothing when b"")."""
    from mass_ops.runtime.episode import WorkspaceSeed, workspace_seed_key
    from mass_ops.store.artifacts import write_tarball

    tree = Path(ctx.config.storage.artifact_url.removeprefix("file://")).parent / "seed-tree"
    for name, data in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    buffer = io.BytesIO()
    write_tarball(tree, buffer)
    sha = hashlib.sha256(buffer.getvalue()).hexdigest()
    key = workspace_seed_key(ctx.cycle_name, sha)
    data = buffer.getvalue() if stored is None else stored
    if data:
        ctx.artifacts.put_bytes(key, data)
    return WorkspaceSeed(ctx.artifacts.uri(key), sha)


def seeding_publisher(ctx: CycleContext, root: Path, prompt: str, seed: Any) -> hand.HandoffPublisher:
    publisher = delivering_publisher(ctx, root, prompt)
    publisher.workspace_seed = seed
    return publisher


def test_the_publisher_delivers_the_seed_before_the_prompt_and_the_sandbox_runner_reads_it_there(
    tmp_path: Path,
) -> None:
    from mass_ops.runtime.runner import WorkspaceSeedError, extract_workspace_seed, fetch_workspace_seed

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    seed = stored_seed(ctx, {"repo/calc.py": b"def add(a, b): return abs(a) + b\n", "data.csv": b"a,b\n"})
    prompt = "the prompt of the unit\n"
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", prompt, seed))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
        assert (tmp_path / "handoff" / hand.SEED_FILE).is_file()  # written before the prompt the sandbox waits for
        unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
        request = EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt=prompt, workspace_seed=seed)
        pod_ctx = sandbox.open(ctx.config, [request])
        # The sandbox reaches no store: its runner's fetch is answered from the hand-off folder, checked.
        workspace = tmp_path / "attempt" / "workspace"
        workspace.mkdir(parents=True)
        fetch_workspace_seed(pod_ctx.artifacts, seed, tmp_path / "attempt" / "seed.tar.gz")
        extract_workspace_seed(tmp_path / "attempt" / "seed.tar.gz", workspace, seed)
        assert (workspace / "repo" / "calc.py").read_bytes().startswith(b"def add")
        assert (workspace / "data.csv").read_bytes() == b"a,b\n"
        other = dataclasses_replace(seed, sha256="0" * 64)
        with pytest.raises(WorkspaceSeedError, match="does not exist"):
            fetch_workspace_seed(pod_ctx.artifacts, other, tmp_path / "attempt" / "other.tar.gz")
    thread.join(timeout=60)
    assert result == {"code": 0}


def dataclasses_replace(seed: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(seed, **changes)


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("missing", "does not exist"),
        ("other bytes", "does not hold the seed of SHA-256"),
        ("another uri", "is not the workspace seed of cycle episode-test with SHA-256"),
    ],
)
def test_a_seed_the_publisher_cannot_vouch_for_stops_the_pod_before_its_prompt(
    tmp_path: Path, scenario: str, message: str
) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    files = {"a.txt": b"a"}
    seed = {
        "missing": lambda: stored_seed(ctx, files, stored=b""),
        "other bytes": lambda: stored_seed(ctx, files, stored=b"not the archive the stage stored"),
        "another uri": lambda: dataclasses_replace(stored_seed(ctx, files), uri=ctx.artifacts.uri("cycles/x.tar.gz")),
    }[scenario]()
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", "the prompt", seed))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with pytest.raises(hand.HandoffError) as caught, sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
    thread.join(timeout=60)
    assert isinstance(result.get("error"), hand.SeedDeliveryError) and message in str(result["error"])
    assert "the publisher gave up" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "handoff" / hand.PROMPT_FILE).exists()
    assert not (tmp_path / "handoff" / hand.SEED_FILE).exists()


def test_a_request_announcing_another_seed_than_the_delivered_one_is_refused(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    seed = stored_seed(ctx, {"a.txt": b"a"})
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", "the prompt", seed))
    ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt").announce_only()  # announces no seed
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "announces reference-t51-s450051 with workspace seed none" in str(error)
    assert not (tmp_path / "handoff" / hand.LEDGER_FILE).exists()


def test_the_cost_of_a_log_skips_a_line_nested_past_the_parser_s_stack(tmp_path: Path) -> None:
    """A record the proxy wrote around an agent's deeply nested request cannot break the spend account."""
    path = tmp_path / "api.jsonl.gz"
    lines = [
        json.dumps({"seq": 1, "response": {"usage": {"cost": 0.25}}}),
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"seq": 3, "response": {"usage": {"cost": 0.5}}}),
    ]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert hand.api_log_cost(path) == 0.75


# --- containment (ISSUE #25.4-6): the agent against the pod's control plane, the publisher and the records --------


def test_a_hostile_agent_in_a_pod_reaches_no_proxy_control_and_the_records_stay_the_proxy_s(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall
) -> None:
    """The agent, in the sandbox with the runner, tries every door to the proxy's control: the control routes on its
    TCP listener (open a session elsewhere, close and discard the runner's, health), sessions through the hand-off
    (its next attempt, a second one for this attempt, another unit), and it forges the runner's close answer and log
    copy with fabricated records and no tokens. Every door is shut, and the row and the published log are the
    proxy's own: four requests, the server's tokens."""
    from tests.runtime.pod import run_pod
    from tests.support.runtime import MODEL, hostile_prompt, request

    handoff = tmp_path / "pod" / "handoff"
    slug = EpisodeUnit("episode-test", TASK, "reference", 7).slug
    attack = f"""
        import json, pathlib, time
        sessions = pathlib.Path({str(handoff)!r}) / "sessions"
        root = base_url.rsplit("/v1", 1)[0]
        auth = {{"Authorization": "Bearer " + token}}
        chat = {{"model": {MODEL!r}, "messages": [{{"role": "user", "content": "hello"}}]}}
        real = [http("POST", base_url + "/chat/completions", chat, auth)[0] for _ in range(4)]
        control = {{}}
        for name, method, path, body in [
            ("open_elsewhere", "POST", "/_mass_proxy/sessions", {{"upstream": "http://attacker.example"}}),
            ("close_and_discard", "POST", "/_mass_proxy/sessions/x/close", {{"discard": True}}),
            ("health", "GET", "/_mass_proxy/health", None),
        ]:
            control[name] = [http(method, root + path, body, headers)[0] for headers in ({{}}, auth)]
        asks = {{"next_attempt": "{slug}-a2-t1", "second_session": "{slug}-a1-t9"}}
        asks["other_unit"] = "reference-t9-s1-a1-t1"
        for name in asks.values():
            (sessions / (name + ".open")).write_text('{{"upstream": "http://attacker.example"}}')
        answers = {{}}
        deadline = time.monotonic() + 60
        for ask, name in asks.items():
            answer = sessions / (name + ".session.json")
            while not answer.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            answers[ask] = json.loads(answer.read_text())
        usage = {{"prompt_tokens": 0, "completion_tokens": 0}}
        fake = {{"seq": 99, "path": "/v1/chat/completions", "status": 200, "response": {{"usage": usage}}}}
        (sessions / "{slug}-a1-t1.log").write_text(json.dumps(fake) + "\\n")
        (sessions / "{slug}-a1-t1.closed.json").write_text(json.dumps({{"records": 1, "usage": {{"requests": 1}}}}))
        report(real=real, control=control, answers=answers)
    """
    with policy_host.serve(require_key=API_KEY) as server:
        ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
        pod = run_pod(
            policy_host,
            ctx,
            [request(ctx, hostile_prompt(attack))],
            install=hostile_install,
            upstream=server.base_url,
            tmp=tmp_path / "pod",
        )
        served = server.stats.chat_requests
    assert pod.sandbox_error is None and pod.publisher == {"code": 0}, (pod.sandbox_error, pod.publisher)
    assert [outcome.attempt for outcome in pod.outcomes] == [1]
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", 7, attempt=1)
    stream = ctx.artifacts.get_bytes(unit.artifact_key("stream")).decode()
    [found] = hostile_findings(stream)
    assert found["real"] == [200] * 4 and served == 4
    assert found["control"] == {door: [404, 404] for door in ("open_elsewhere", "close_and_discard", "health")}
    for ask, why in (
        ("next_attempt", "attempt 2 is not the next attempt"),
        ("second_session", "attempt 1 of " + slug + " already has its session"),
        ("other_unit", "is not a unit this pod announced"),
    ):
        answer = found["answers"][ask]
        assert answer["token"] is None and why in answer["error"], (ask, answer)
    # One session was opened for the attempt (the preflight's was discarded), and its log is what was published.
    [session_log] = pod.session_logs
    proxy_records = [json.loads(line) for line in session_log.read_text().splitlines()]
    published = gzip.decompress(ctx.artifacts.get_bytes(unit.artifact_key("api_log"))).decode()
    assert published == session_log.read_text() and len(proxy_records) == 4
    truth = UsageTotals.from_records(proxy_records)
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (4, truth.prompt_tokens, truth.completion_tokens)
    assert truth.prompt_tokens > 0 and truth.completion_tokens > 0
    status = json.loads(ctx.artifacts.get_bytes(unit.artifact_key("status")))
    assert status["usage"] == truth.as_dict() and status["hiw"]["api_requests"] == 4


def _session_ask(handoff: hand.Handoff, name: str, ask: str, answer: str, model: type[Any]) -> Any:
    """Ask the publisher in sessions/ as a runner would, and wait for its answer."""
    folder = handoff.path(hand.SESSIONS_DIR)
    handoff.write_bytes(folder / f"{name}.{ask}", b"")
    deadline = time.monotonic() + 60
    while not (folder / answer).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return handoff.read(folder / answer, model)


def test_a_pod_s_row_and_published_log_are_the_proxy_s_whatever_the_sandbox_hands_over(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """ISSUE #25.6: a sandbox that used its session for three requests, then handed over a record of none and a log
    of fabricated records (the agent shares its container): the row's counts, the status document's usage and the
    published log are what the proxy counted and wrote."""
    from mass_ops.runtime.session_proxy import SessionProxy
    from tests.runtime.hostile_agent import http
    from tests.support.runtime import MODEL

    proxy_dir = tmp_path / "proxy"
    with policy_host.serve(require_key=API_KEY) as server:
        proxy = SessionProxy(
            proxy_dir / "sessions",
            control_socket=proxy_dir / "control.sock",
            upstreams=[server.base_url],
            upstream_api_key=API_KEY,
        )
        policy_host.loop.run(proxy.start())
        try:
            ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
            pod_proxy = hand.PodProxy(proxy_dir / "control.sock", proxy_dir / "sessions")
            publisher = hand.HandoffPublisher(
                ctx.config, tmp_path / "handoff", attach=lambda _config: ctx, proxy=pod_proxy
            )
            thread, result = serve_in_thread(publisher)
            sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
            assert sandbox.announce().proxy_sessions
            slug = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug
            grant = _session_ask(
                sandbox.handoff, f"{slug}-a1-t1", "open", f"{slug}-a1-t1.session.json", hand.SessionGrant
            )
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            auth = {"Authorization": f"Bearer {grant.token}"}
            statuses = [http("POST", f"{grant.proxy_url}/v1/chat/completions", chat, auth)[0] for _ in range(3)]
            folder = sandbox.attempt(1, finished=False)
            fake = {
                "seq": 1,
                "path": "/v1/chat/completions",
                "status": 200,
                "response": {"usage": {"prompt_tokens": 1}},
            }
            (folder / EPISODE_FILES["api_log"]).write_bytes(gzip.compress((json.dumps(fake) + "\n").encode()))
            finished_publication(folder, 1)  # a record of one request, one prompt and one completion token
            os.rename(folder, sandbox.handoff.attempt_dir(slug, 1))
            sandbox.complete()
            thread.join(timeout=60)
        finally:
            policy_host.loop.run(proxy.stop())
    assert result == {"code": 0} and statuses == [200] * 3
    [session_log] = [p for p in (proxy_dir / "sessions").glob("*.jsonl") if p.name != "rejected.jsonl"]
    truth = UsageTotals.from_records(json.loads(line) for line in session_log.read_text().splitlines())
    [row] = ctx.repo.episodes(ctx.cycle_id)
    counts = (row.requests, row.prompt_tokens, row.completion_tokens, row.max_prompt_tokens)
    assert counts == (3, truth.prompt_tokens, truth.completion_tokens, truth.max_prompt_tokens)
    assert truth.requests == 3 and truth.completion_tokens > 1
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED, attempt=1)
    assert gzip.decompress(ctx.artifacts.get_bytes(unit.artifact_key("api_log"))) == session_log.read_bytes()
    assert json.loads(ctx.artifacts.get_bytes(unit.artifact_key("status")))["usage"] == truth.as_dict()
    # Charged once, by its row (the session's own charge is only for an attempt that has none).
    from mass_ops.store.budgets import task_scope

    [spend] = ctx.repo.budget_spend(ctx.cycle_id, [task_scope(TASK)]).values()
    assert (spend.tokens, spend.requests) == (truth.prompt_tokens + truth.completion_tokens, 3)


def _handed_over(sandbox: ScriptedSandbox, contents: dict[str, bytes]) -> Path:
    """Attempt 1 handed over whole (built under its temporary name, then renamed), each file with `contents`."""
    folder = sandbox.attempt(1, finished=False)
    for name, data in contents.items():
        (folder / EPISODE_FILES[name]).write_bytes(data)
    finished_publication(folder, 1)
    final = sandbox.handoff.attempt_dir(EpisodeUnit(sandbox.config.cycle_name, TASK, "reference", SEED).slug, 1)
    os.rename(folder, final)
    return final


@pytest.mark.parametrize("swap", ["symlink to /proc/self/environ", "hard link to a file outside"])
def test_a_file_swapped_after_the_publisher_s_check_publishes_the_bytes_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """ISSUE #25.5: the agent swaps attempt files for a link the moment the publisher has checked them (the publish
    step is where the old publisher re-opened them by name): the store gets the files that were checked."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-secret.txt"
    outside.write_text("AWS_SECRET_ACCESS_KEY=wJalr-outside-71")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    contents = {"workspace": b"the agent's workspace", "stream": b'{"type": "result"}\n'}
    real_publish = hand.publish_episode

    def swapped_then_published(*args: Any, **kwargs: Any) -> Any:
        for name in contents:
            path = folder / EPISODE_FILES[name]
            path.unlink()
            if swap.startswith("symlink"):
                path.symlink_to("/proc/self/environ")
            else:
                os.link(outside, path)
        return real_publish(*args, **kwargs)

    monkeypatch.setattr(hand, "publish_episode", swapped_then_published)
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = _handed_over(sandbox, contents)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}, result
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED, attempt=1)
    for name, data in contents.items():
        assert ctx.artifacts.get_bytes(unit.artifact_key(name)) == data


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_an_attempt_file_linked_to_a_file_outside_is_refused_and_nothing_is_published(
    tmp_path: Path, link: str
) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-secret.txt"
    outside.write_text("AWS_SECRET_ACCESS_KEY=wJalr-outside-71")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = sandbox.attempt(1, finished=False)
    target = folder / EPISODE_FILES["stream"]
    target.unlink()
    if link == "symlink":
        target.symlink_to(outside)
    else:
        os.link(outside, target)
    finished_publication(folder, 1)
    os.rename(folder, sandbox.handoff.attempt_dir(EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug, 1))
    sandbox.complete()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "stream.jsonl is missing or not a regular file of its own" in str(error)
    assert ctx.repo.episodes(ctx.cycle_id) == [] and ctx.artifacts.list("cycles/") == []


def test_the_publisher_writes_through_no_link_the_sandbox_planted(tmp_path: Path) -> None:
    """The sandbox plants a link at the temporary name of the ack the publisher will write (and the sessions/ folder
    as a link): the publisher's writes land in the hand-off folder and nowhere else."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-file.txt"
    outside.write_text("the publisher's own")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    slug = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug
    (tmp_path / "handoff" / "acks").mkdir()
    (tmp_path / "handoff" / "acks" / f".{slug}-a1.json.partial").symlink_to(outside)
    _handed_over(sandbox, {})
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}, result
    assert outside.read_text() == "the publisher's own"
    assert sandbox.handoff.read(sandbox.handoff.ack_path(slug, 1), hand.Ack).episode_id is not None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "handoff" / "sessions").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(hand.IncompleteHandoffError, match="sessions/ is a link or not a folder"):
        sandbox.handoff.write_bytes(sandbox.handoff.path("sessions") / "x.json", b"{}")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_the_publisher_checks_the_endpoint_before_it_opens_a_session_and_opens_none_when_it_fails(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """The preflight is the publisher's: an endpoint that does not answer is a transient refusal (the runner waits
    and asks again), and no session is left for the attempt, whose next ask can still have one."""
    from mass_ops.runtime.session_proxy import SessionProxy

    proxy_dir = tmp_path / "proxy"
    proxy = SessionProxy(
        proxy_dir / "sessions",
        control_socket=proxy_dir / "control.sock",
        upstreams=["http://127.0.0.1:9"],
        upstream_api_key=API_KEY,
    )
    policy_host.loop.run(proxy.start())
    try:
        ctx = open_episode_cycle(tmp_path / "cycle", "http://127.0.0.1:9/v1")
        pod_proxy = hand.PodProxy(proxy_dir / "control.sock", proxy_dir / "sessions")
        publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx, proxy=pod_proxy)
        thread, result = serve_in_thread(publisher)
        sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
        sandbox.announce()
        slug = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug
        grants = [
            _session_ask(sandbox.handoff, f"{slug}-a1-t{n}", "open", f"{slug}-a1-t{n}.session.json", hand.SessionGrant)
            for n in (1, 2)
        ]
        sandbox.complete()
        thread.join(timeout=60)
    finally:
        policy_host.loop.run(proxy.stop())
    assert result == {"code": 0}
    for grant in grants:
        assert grant.token is None and grant.transient, grant
        # through the pod's proxy, which answers 502 for an upstream that does not
        assert grant.error and grant.error.startswith("episode preflight: GET http://127.0.0.1:"), grant.error
        assert grant.error.endswith("/v1/models answered HTTP 502")
    assert [path.name for path in (proxy_dir / "sessions").iterdir()] == ["rejected.jsonl"]


def test_a_session_whose_attempt_is_never_handed_over_is_charged_to_the_budgets_all_the_same(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """The agent spends through its session, then stops its runner before the hand-over (no attempt, no row): the
    publisher charges what the proxy counted to the task and the cycle, once."""
    from mass_ops.runtime.session_proxy import SessionProxy
    from mass_ops.store.budgets import CYCLE_SCOPE, task_scope
    from tests.runtime.hostile_agent import http
    from tests.support.runtime import MODEL

    proxy_dir = tmp_path / "proxy"
    with policy_host.serve(require_key=API_KEY) as server:
        proxy = SessionProxy(
            proxy_dir / "sessions",
            control_socket=proxy_dir / "control.sock",
            upstreams=[server.base_url],
            upstream_api_key=API_KEY,
        )
        policy_host.loop.run(proxy.start())
        try:
            ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
            pod_proxy = hand.PodProxy(proxy_dir / "control.sock", proxy_dir / "sessions")
            publisher = hand.HandoffPublisher(
                ctx.config, tmp_path / "handoff", attach=lambda _config: ctx, proxy=pod_proxy
            )
            thread, result = serve_in_thread(publisher)
            sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
            sandbox.announce()
            slug = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug
            grant = _session_ask(
                sandbox.handoff, f"{slug}-a1-t1", "open", f"{slug}-a1-t1.session.json", hand.SessionGrant
            )
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            auth = {"Authorization": f"Bearer {grant.token}"}
            for _ in range(2):
                assert http("POST", f"{grant.proxy_url}/v1/chat/completions", chat, auth)[0] == 200
            sandbox.complete(code=137)  # the runner was killed: nothing handed over
            thread.join(timeout=60)
        finally:
            policy_host.loop.run(proxy.stop())
    assert result == {"code": 0} and ctx.repo.episodes(ctx.cycle_id) == []
    [session_log] = [p for p in (proxy_dir / "sessions").glob("*.jsonl") if p.name != "rejected.jsonl"]
    truth = UsageTotals.from_records(json.loads(line) for line in session_log.read_text().splitlines())
    spend = ctx.repo.budget_spend(ctx.cycle_id, [task_scope(TASK), CYCLE_SCOPE])
    assert truth.requests == 2 and truth.prompt_tokens + truth.completion_tokens > 0
    for scope in (task_scope(TASK), CYCLE_SCOPE):
        assert (spend[scope].tokens, spend[scope].requests) == (truth.prompt_tokens + truth.completion_tokens, 2)
