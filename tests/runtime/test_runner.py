"""EpisodeRunner: preflight, agent environment and limits, process groups, artifacts then row; one real qwen-code
episode end to end; the `mass-ops episode run` entry point."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import load_config
from mass_ops.errors import InfrastructureError
from mass_ops.layout import EPISODE_FILES
from mass_ops.runtime.episode import EpisodeOutcome
from mass_ops.runtime.pool import EpisodePool, EpisodePromptConflictError
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import (
    AttemptPaths,
    EndpointUnreachableError,
    EpisodeBusyError,
    EpisodePreflightError,
    EpisodeRunner,
    ModelNotListedError,
    agent_environment,
    lease_host,
    resolve_api_key,
)
from mass_ops.store.repository import MetadataRepository
from tests.policy_server import RequestKind, classify_request
from tests.policy_server.faults import Fault, FaultRule
from tests.policy_server.policies import ChatRequest, PolicyReply, ResearchTeamPolicy
from tests.support.runtime import (
    API_KEY,
    KEY_VAR,
    MODEL,
    PolicyHost,
    cli_process,
    open_episode_cycle,
    process_alive,
    request,
    runner_environ,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]
# The runner's fallback where bwrap is unavailable: its process-group cleanup must hold on its own.
_UNSANDBOXED: dict[str, Any] = {"sandbox": "none", "allow_unsandboxed_agent": True}


def _runner(ctx: Any, install: QwenInstall, tmp: Path, **options: Any) -> EpisodeRunner:
    return EpisodeRunner(ctx, install=install, environ=runner_environ(), scratch_dir=tmp / "scratch", **options)


def _records(outcome: EpisodeOutcome, ctx: Any) -> list[dict[str, Any]]:
    key = f"{_prefix(outcome)}/{EPISODE_FILES['api_log']}"
    return [json.loads(line) for line in gzip.decompress(ctx.artifacts.get_bytes(key)).decode().splitlines()]


def _prefix(outcome: EpisodeOutcome) -> str:
    unit = outcome.request.unit
    return f"cycles/{unit.cycle}/episodes/{unit.slug}/a{outcome.attempt}"


# --- preflight --------------------------------------------------------------------------------------------------


def test_model_not_listed_is_a_clear_error_and_creates_nothing(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve(models=("some-other-model",)) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _runner(ctx, stand_in_install, tmp_path)
        with pytest.raises(ModelNotListedError) as caught:
            asyncio.run(runner.run_attempt(request(ctx, "hello"), 1))
        assert server.stats.chat_requests == 0
    message = str(caught.value)
    assert "\n" not in message and repr(MODEL) in message and "some-other-model" in message
    assert not (tmp_path / "scratch").exists()
    assert ctx.artifacts.list("cycles/") == []
    assert ctx.repo.episodes(ctx.cycle_id) == []


def test_unreachable_endpoint_is_a_transient_preflight_error(tmp_path: Path, stand_in_install: QwenInstall) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")  # discard port: nothing listens
    with pytest.raises(EndpointUnreachableError, match=r"GET http://127\.0\.0\.1:9/v1/models failed"):
        asyncio.run(_runner(ctx, stand_in_install, tmp_path).preflight())
    assert not (tmp_path / "scratch").exists()


def test_api_key_rules() -> None:
    local = load_config("demo")
    assert resolve_api_key(local, {}) == "EMPTY"  # a local server without --api-key
    assert resolve_api_key(local, {"MASS_DEMO_API_KEY": "k-123"}) == "k-123"
    with pytest.raises(EpisodePreflightError, match=r"MASS_DEMO_API_KEY .* contains whitespace") as caught:
        resolve_api_key(local, {"MASS_DEMO_API_KEY": "sk-abc def"})
    assert "sk-abc" not in str(caught.value)
    remote = load_config(
        "paper",
        [
            "inference.backend=openrouter",
            "inference.endpoint=https://openrouter.ai/api/v1",
            "inference.api_key_env=OPENROUTER_API_KEY",
            "inference.context_window_tokens=131072",
            "inference.episode_max_output_tokens=8192",
            "inference.max_output_tokens=8192",
        ],
    )
    with pytest.raises(EpisodePreflightError, match=r"OPENROUTER_API_KEY .* is not set"):
        resolve_api_key(remote, {})


def test_agent_environment_is_an_allow_list(tmp_path: Path) -> None:
    config = load_config("demo", ["runtime.thread_limit=3", "runtime.stream_idle_timeout_ms=1234"])
    paths = AttemptPaths(tmp_path / "a1")
    env = agent_environment(config, paths, agent_token="tok-12345678", scope="s1", path_value="/usr/bin:/bin")
    assert env["MASS_EPISODE_TOKEN"] == "tok-12345678" and "MASS_DEMO_API_KEY" not in env
    assert env["HOME"] == str(paths.home) and env["QWEN_HOME"] == str(paths.home / ".qwen")
    assert {env[v] for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")} == {"3"}
    assert env["NUMEXPR_NUM_THREADS"] == env["OPENMM_CPU_THREADS"] == "3" and env["LOKY_MAX_CPU_COUNT"] == "6"
    assert env["QWEN_STREAM_IDLE_TIMEOUT_MS"] == "1234" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NO_PROXY"] == "127.0.0.1,localhost" and env["QWEN_TELEMETRY_ENABLED"] == "false"
    assert not {"AWS_SECRET_ACCESS_KEY", "MASS_METADATA_URL", "USER"} & set(env)
    assert env["MASS_EPISODE_SANDBOX"] == "none" and env["TMPDIR"] == str(paths.tmp)
    # In the bwrap sandbox the attempt's tmp/ is the agent's private /tmp, and the agent is told it is sandboxed.
    boxed = agent_environment(config, paths, agent_token="t", scope="s", path_value="/bin", sandbox="bwrap")
    assert boxed["MASS_EPISODE_SANDBOX"] == "bwrap" and boxed["TMPDIR"] == "/tmp"
    clash = load_config("demo", ["inference.api_key_env=HOME"])
    with pytest.raises(EpisodePreflightError, match="collides"):
        agent_environment(clash, paths, agent_token="x", scope="s", path_value="/bin")
    with pytest.raises(EpisodePreflightError, match="collides"):  # the key's variable may not shadow the token's
        agent_environment(
            load_config("demo", ["inference.api_key_env=MASS_EPISODE_TOKEN"]),
            paths,
            agent_token="x",
            scope="s",
            path_value="/bin",
        )


# --- one attempt with the light stand-in agent -------------------------------------------------------------------


def test_attempt_publishes_every_artifact_then_the_row(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _runner(ctx, stand_in_install, tmp_path)
        episode = request(ctx, "Write the report.\n@agent requests=2 dump=1", seed=11)
        outcome = asyncio.run(runner.run_attempt(episode, 1))

    assert outcome.status == "succeeded" and outcome.attempt == 1 and not outcome.reused
    assert set(outcome.artifacts) == set(EPISODE_FILES)
    for name, uri in outcome.artifacts.items():
        key = f"{_prefix(outcome)}/{EPISODE_FILES[name]}"
        assert ctx.artifacts.uri(key) == uri and ctx.artifacts.exists(key)
    assert ctx.artifacts.get_bytes(f"{_prefix(outcome)}/prompt.txt").decode() == episode.prompt
    assert ctx.artifacts.get_json(f"{_prefix(outcome)}/status.json") == outcome.status_record

    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert row.id == outcome.episode_id and row.status == "succeeded" and row.attempt == 1 and row.seed == 11
    assert row.prompt_sha256 == episode.prompt_sha256 and row.artifacts == outcome.artifacts
    # The row holds the SHA-256 each artifact was published with (a reader hands it back to the store).
    assert row.artifact_sha256 == {
        name: ctx.artifacts.info(f"{_prefix(outcome)}/{EPISODE_FILES[name]}").sha256 for name in EPISODE_FILES
    }
    assert row.requests == 2 and row.prompt_tokens == outcome.status_record["usage"]["prompt_tokens"] > 0
    assert row.qwen_code_version == "stand-in" and row.condition == "t51_bare"

    dest = tmp_path / "ws"
    EpisodePool(ctx, runner=runner).workspace(outcome, dest)
    assert (dest / "research_report.md").read_text().startswith("# Research report")
    dumped = json.loads((dest / "agent_env.json").read_text())
    # The agent saw the prompt on stdin, the key only in its environment, and nothing outside the allow-list.
    assert dumped["argv"][1:] == ["--model", MODEL, "--approval-mode", "yolo", "--output-format", "stream-json"]
    assert dumped["key_present"] is True and not any(API_KEY in arg for arg in dumped["argv"])
    assert set(dumped["env"]) <= {
        "PATH",
        "HOME",
        "QWEN_HOME",
        "TMPDIR",
        "LANG",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "OPENMM_CPU_THREADS",
        "LOKY_MAX_CPU_COUNT",
        "CUDA_VISIBLE_DEVICES",
        "QWEN_STREAM_IDLE_TIMEOUT_MS",
        "QWEN_STREAM_MAX_LIFETIME_MS",
        "QWEN_TELEMETRY_ENABLED",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING",
        "NO_PROXY",
        "no_proxy",
        "MASS_EPISODE_SCOPE",
        "MASS_EPISODE_SANDBOX",
        "LC_CTYPE",  # Python's own locale coercion may add it
    }
    settings = json.loads(ctx.artifacts.get_bytes(f"{_prefix(outcome)}/settings.json"))
    assert settings["modelProviders"]["openai"][0]["envKey"] == "MASS_EPISODE_TOKEN"
    assert settings["modelProviders"]["openai"][0]["generationConfig"]["samplingParams"]["seed"] == 11
    assert list((tmp_path / "scratch" / ctx.cycle_name).iterdir()) == []  # scratch removed


# --- the agent holds no secret (ISSUE #13.4) ----------------------------------------------------------------------


class _EnvCapturingRunner(EpisodeRunner):
    """The real runner, keeping the environment it built for each agent (what the agent process receives)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_envs: list[dict[str, str]] = []

    async def _run_agent(self, install: QwenInstall, paths: AttemptPaths, env: dict[str, str], scope: str) -> Any:
        self.agent_envs.append(dict(env))
        return await super()._run_agent(install, paths, env, scope)


def _assert_keyless(env: dict[str, str]) -> None:
    """No variable named like the key's, and the key's bytes in no name or value (raw, base64, hex, reversed)."""
    import base64

    assert KEY_VAR not in env
    block = "\0".join(f"{name}={value}" for name, value in env.items())
    for form in (API_KEY, base64.b64encode(API_KEY.encode()).decode(), API_KEY.encode().hex(), API_KEY[::-1]):
        assert form not in block
    token = env["MASS_EPISODE_TOKEN"]
    assert len(token) >= 40 and token != API_KEY  # secrets.token_urlsafe(32)


def test_the_agent_gets_a_token_not_the_key_and_the_proxy_adds_the_key(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    """An upstream that requires the key serves the episode, though the agent never had the key."""
    with policy_host.serve(require_key=API_KEY) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _EnvCapturingRunner(
            ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "scratch"
        )
        first = asyncio.run(runner.run_attempt(request(ctx, "Report.\n@agent requests=2 leak=1", seed=5), 1))
        second = asyncio.run(runner.run_attempt(request(ctx, "Report.\n@agent requests=1", seed=6), 1))
        credentials = list(server.credentials)  # type: ignore[attr-defined]

    assert first.status == second.status == "succeeded"
    # Every request reached the upstream with the key, which only the proxy (this process) put there.
    assert credentials and set(credentials) == {f"Bearer {API_KEY}"}
    assert [len(_records(outcome, ctx)) for outcome in (first, second)] == [2, 1]
    assert all(record["status"] == 200 for record in _records(first, ctx))
    [env, other] = runner.agent_envs
    _assert_keyless(env)
    assert env["MASS_EPISODE_TOKEN"] != other["MASS_EPISODE_TOKEN"]  # a fresh token per attempt
    # The careless agent wrote down its credential: the token (nothing to redact), never the key.
    dest = tmp_path / "ws"
    EpisodePool(ctx, runner=runner).workspace(first, dest)
    assert (dest / "leak.txt").read_text() == f"the key is {env['MASS_EPISODE_TOKEN']}\n"


def test_with_priority_scheduling_the_episode_s_proxy_stamps_its_place_on_the_chain(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    """ISSUE #17.2: every model request of a search episode at version 1 reaches the server with priority 1 (the demo
    preset searches one version: 0 is the most urgent, ranking the least); a collection episode's with 2."""
    with policy_host.serve() as server:
        inference = {"backend": "vllm", "server": {"scheduling_policy": "priority"}}
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", inference=inference)
        runner = _runner(ctx, stand_in_install, tmp_path)
        search = request(ctx, "Report.\n@agent requests=2", seed=5, kind="search", version=1)
        collection = request(ctx, "Report.\n@agent requests=1", seed=6, kind="collection", candidate=0)
        outcomes = [asyncio.run(runner.run_attempt(episode, 1)) for episode in (search, collection)]
        received = [body.get("priority") for body in server.requests]

    assert [outcome.status for outcome in outcomes] == ["succeeded", "succeeded"]
    assert ctx.config.search.iterations == 1
    assert received == [1, 1, 2]
    assert [record["request"]["priority"] for record in _records(outcomes[0], ctx)] == [1, 1]


def test_the_row_counts_what_the_proxy_counted_not_what_the_agent_left_in_its_log(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall
) -> None:
    """ISSUE #25.6, locally: an agent that can write its attempt's proxy log (no sandbox) truncates it between its
    requests and appends fabricated records; the row's counts are the proxy's own counters all the same."""
    from tests.support.runtime import hostile_prompt

    attack = f"""
        import json
        log = workspace.parent / "logs" / "api_requests.jsonl"
        auth = {{"Authorization": "Bearer " + token}}
        chat = {{"model": {MODEL!r}, "messages": [{{"role": "user", "content": "hello"}}]}}
        usage = [json.loads(http("POST", base_url + "/chat/completions", chat, auth)[2])["usage"] for _ in range(2)]
        log.write_text("")
        usage.append(json.loads(http("POST", base_url + "/chat/completions", chat, auth)[2])["usage"])
        fake = {{"path": "/v1/chat/completions", "status": 200, "response": {{"usage": {{"prompt_tokens": 10**9}}}}}}
        with log.open("a") as out:
            out.write(json.dumps(fake) + "\\n")
        report(usage=usage)
    """
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", **_UNSANDBOXED)
        runner = _runner(ctx, hostile_install, tmp_path)
        outcome = asyncio.run(runner.run_attempt(request(ctx, hostile_prompt(attack)), 1))
    from tests.runtime.hostile_agent import hostile_findings

    [found] = hostile_findings(ctx.artifacts.get_bytes(f"{_prefix(outcome)}/{EPISODE_FILES['stream']}").decode())
    seen = found["usage"]
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (
        3,
        sum(u["prompt_tokens"] for u in seen),
        sum(u["completion_tokens"] for u in seen),
    )
    assert outcome.status_record["usage"]["requests"] == 3


def test_in_a_pod_the_runner_holds_no_key_and_uses_the_proxy_container(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    """The sandbox side of a Kubernetes episode pod: no key in its environment at all; the pod's proxy holds the key,
    and the publisher gives each attempt its own session (after its preflight, which leaves no log) and log."""
    from tests.runtime.pod import run_pod

    with policy_host.serve(require_key=API_KEY) as server:
        ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
        requests = [request(ctx, "Report.\n@agent requests=2", seed=s) for s in (1, 2)]
        pod = run_pod(
            policy_host,
            ctx,
            requests,
            install=stand_in_install,
            upstream=server.base_url,
            tmp=tmp_path,
            runner_class=_EnvCapturingRunner,
        )
        credentials = list(server.credentials)  # type: ignore[attr-defined]

    assert pod.sandbox_error is None and pod.publisher == {"code": 0}, (pod.sandbox_error, pod.publisher)
    outcomes = pod.outcomes
    assert [outcome.status for outcome in outcomes] == ["succeeded", "succeeded"]
    assert credentials and set(credentials) == {f"Bearer {API_KEY}"}
    assert [len(_records(outcome, ctx)) for outcome in outcomes] == [2, 2]  # each attempt its own session log
    assert [row.requests for row in ctx.repo.episodes(ctx.cycle_id)] == [2, 2]
    for env in pod.runner.agent_envs:
        _assert_keyless(env)
    # The preflights' sessions were discarded; one log per attempt is left, and no request was refused.
    assert len(pod.session_logs) == 2 and (pod.proxy_dir / "sessions" / "rejected.jsonl").read_text() == ""


@pytest.mark.postgres
def test_production_profile_postgres_and_s3(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall, postgres_url: str, s3_artifact_url: str
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(
            tmp_path, f"{server.base_url}/v1", metadata_url=postgres_url, artifact_url=s3_artifact_url
        )
        with EpisodePool(ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "s") as pool:
            [outcome] = pool.run([request(ctx, "Report.\n@agent requests=2 dump=1", seed=21)])
            [again] = pool.run([request(ctx, "Report.\n@agent requests=2 dump=1", seed=21)])
            dest = pool.workspace(outcome, tmp_path / "ws")
    assert outcome.status == "succeeded" and again.reused and again.episode_id == outcome.episode_id
    assert all(uri.startswith(f"{s3_artifact_url}/cycles/episode-test/") for uri in outcome.artifacts.values())
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert row.artifacts == outcome.artifacts and row.status == "succeeded"
    # The S3 credentials of this process never reach the agent.
    assert not [name for name in json.loads((dest / "agent_env.json").read_text())["env"] if name.startswith("AWS")]


def test_wall_clock_limit_stops_the_whole_process_group(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        # Unsandboxed (what the runner does where bwrap is unavailable): the pids it checks are host pids. The
        # sandboxed agent is covered by tests/runtime/test_local_sandbox.py.
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", episode_wall_clock_s=3, **_UNSANDBOXED)
        runner = _runner(ctx, stand_in_install, tmp_path, kill_grace_s=1.0)
        started = time.monotonic()
        outcome = asyncio.run(runner.run_attempt(request(ctx, "Work forever.\n@agent requests=1 sleep=120"), 1))
        elapsed = time.monotonic() - started

    assert elapsed < 20
    assert outcome.status == "model_failure"
    failure = outcome.status_record["failure"]
    assert failure["subtype"] == "wall_clock_limit" and "3 s" in failure["message"]
    assert outcome.status_record["terminated_by"] == "wall_clock"
    assert outcome.status_record["exit_code"] is not None and outcome.status_record["exit_code"] < 0  # by signal
    dest = tmp_path / "ws"
    EpisodePool(ctx, runner=runner).workspace(outcome, dest)
    child, detached = (int(pid) for pid in (dest / "pids.txt").read_text().split())
    # The child in the agent's group and the grandchild that left it with setsid are both gone.
    assert not process_alive(child) and not process_alive(detached)


def test_paper_presets_set_no_wall_clock_limit_and_others_keep_one() -> None:
    """ISSUE #12.7: the reference has no episode wall-clock limit (MASS_SPEC §4); the other presets keep theirs."""
    from mass_ops.config import RuntimeConfig

    assert load_config("paper").runtime.episode_wall_clock_s is None
    assert load_config("cycle2").runtime.episode_wall_clock_s is None
    assert load_config("demo").runtime.episode_wall_clock_s == 600
    assert RuntimeConfig().episode_wall_clock_s == 6 * 3600  # a custom config keeps a limit unless it says null
    description = RuntimeConfig.model_fields["episode_wall_clock_s"].description or ""
    assert "null = no limit" in description and "paper" in description


def test_no_wall_clock_limit_lets_the_agent_run_to_its_end(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", episode_wall_clock_s=None)
        runner = _runner(ctx, stand_in_install, tmp_path, kill_grace_s=1.0)
        outcome = asyncio.run(runner.run_attempt(request(ctx, "Take your time.\n@agent requests=1 sleep=2"), 1))

    assert ctx.config.runtime.episode_wall_clock_s is None
    assert outcome.status == "succeeded" and outcome.status_record["terminated_by"] is None
    assert outcome.status_record["operational_limits"]["episode_wall_clock_s"] is None
    assert outcome.status_record["exit_code"] == 0


def test_background_processes_end_with_the_episode(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", **_UNSANDBOXED)  # host pids, as above
        runner = _runner(ctx, stand_in_install, tmp_path)
        outcome = asyncio.run(runner.run_attempt(request(ctx, "Start a server.\n@agent requests=1 sleep=0.2"), 1))
    assert outcome.status == "succeeded"
    dest = tmp_path / "ws"
    EpisodePool(ctx, runner=runner).workspace(outcome, dest)
    pids = [int(pid) for pid in (dest / "pids.txt").read_text().split()]
    assert len(pids) == 2 and not any(process_alive(pid) for pid in pids)


def test_a_running_attempt_is_not_started_twice(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    import fcntl

    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _runner(ctx, stand_in_install, tmp_path)
        folder = tmp_path / "scratch" / ctx.cycle_name
        folder.mkdir(parents=True)
        with open(folder / ".reference-t51-s7-a1.lock", "a") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            with pytest.raises(EpisodeBusyError, match="already running in another process"):
                asyncio.run(runner.run_attempt(request(ctx, "hi"), 1))
        assert ctx.repo.episodes(ctx.cycle_id) == []
        assert asyncio.run(runner.run_attempt(request(ctx, "hi\n@agent requests=1"), 1)).status == "succeeded"


# --- the real qwen-code ------------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=12)
def test_real_qwen_code_episode_end_to_end(policy_host: PolicyHost, tmp_path: Path, qwen_install: QwenInstall) -> None:
    with policy_host.serve(argument_fragments=4, chunk_chars=16) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", inference={"backend": "vllm"})
        episode = request(ctx, "Produce research_report.md and results/metrics.json.", seed=450051)
        with EpisodePool(
            ctx, install=qwen_install, environ=runner_environ(), scratch_dir=tmp_path / "scratch", retry_backoff_s=0
        ) as pool:
            [outcome] = pool.run([episode])
            chat_requests = server.stats.chat_requests

            # A completed unit is never rerun; a different prompt for it is refused.
            [again] = pool.run([episode])
            assert again.reused and again.episode_id == outcome.episode_id and again.status == "succeeded"
            assert server.stats.chat_requests == chat_requests
            changed = request(ctx, "Another prompt.", seed=450051)
            with pytest.raises(EpisodePromptConflictError, match="prompt may not change"):
                pool.run([changed])
            dest = tmp_path / "ws"
            pool.workspace(outcome, dest)

    record = outcome.status_record
    assert outcome.status == "succeeded", record["failure"]
    assert record["trace_has_success_result"] is True and record["qwen_code_version"] == "0.21.10"
    assert record["exit_code"] == 0 and record["seed"] == 450051

    # The workspace holds what the orchestrator and its subagent wrote.
    report = (dest / "research_report.md").read_text()
    metrics = json.loads((dest / "results" / "metrics.json").read_text())
    assert report.startswith("# Research report") and metrics["seed"] == 450051

    # The proxy log holds the orchestrator's and the subagent's requests, with settings-driven sampling params.
    records = _records(outcome, ctx)
    chats = [r for r in records if r["path"] == "/v1/chat/completions"]
    kinds = [classify_request(r["request"]) for r in chats]
    assert kinds.count(RequestKind.ORCHESTRATOR) >= 4 and kinds.count(RequestKind.SUBAGENT) >= 2
    first = chats[0]["request"]
    assert first["seed"] == 450051 and first["top_k"] == 20 and first["max_tokens"] == 2048
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    workspace = tmp_path / "scratch" / ctx.cycle_name / f"{episode.unit.slug}-a1" / "workspace"
    tools_used = set()
    for chat in chats:
        assert chat["status"] == 200 and chat["response"]["done"] is True and "proxy_error" not in chat
        for call in chat["response"]["choices"][0]["message"]["tool_calls"] or []:
            tools_used.add(call["function"]["name"])
            fragments = chat["sse_raw"].count(f'"index": {call["index"]}, "function": {{"arguments"')
            assert fragments >= 2  # the arguments really arrived in pieces
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "write_file":  # reassembled arguments == the bytes that landed
                written = dest / Path(arguments["file_path"]).relative_to(workspace)
                assert arguments["content"] == written.read_text()
    assert {"write_file", "run_shell_command", "agent"} <= tools_used

    # Token totals: the proxy log's usage, the row, and qwen-code's own accounting agree.
    usage = record["usage"]
    assert usage["requests"] == len(chats)
    assert usage["prompt_tokens"] == sum(c["response"]["usage"]["prompt_tokens"] for c in chats)
    assert usage["completion_tokens"] == sum(c["response"]["usage"]["completion_tokens"] for c in chats)
    assert usage["max_prompt_tokens"] == max(c["response"]["usage"]["prompt_tokens"] for c in chats)
    stream = ctx.artifacts.get_bytes(f"{_prefix(outcome)}/stream.jsonl").decode().splitlines()
    [result] = [json.loads(line) for line in stream if '"type":"result"' in line.replace(" ", "")]
    assert result["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert result["usage"]["output_tokens"] == usage["completion_tokens"]
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert (row.prompt_tokens, row.completion_tokens, row.requests, row.max_prompt_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["requests"],
        usage["max_prompt_tokens"],
    )
    assert row.status == "succeeded" and row.artifacts == outcome.artifacts


# --- the CLI entry point ------------------------------------------------------------------------------------------


def test_cli_runs_units_and_prints_one_json_outcome_per_seed(policy_host: PolicyHost, tmp_path: Path) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        config = write_config(ctx, tmp_path)
        prompt = ctx.artifacts.put_bytes("inputs/prompt.txt", b"Write the report.\n@agent requests=2")
        args = ["run", "--config", str(config), "--task", "51", "--kind", "search", "--version", "0"]
        args += ["--seed", "450051", "--seed", "450052", "--prompt-uri", prompt.uri, "--log-format", "json"]
        args += ["--scratch-dir", str(tmp_path / "scratch")]
        process = cli_process(args, tmp_path)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [line["unit"] for line in lines] == [f"{ctx.cycle_name}/search-t51-v0-s{s}" for s in (450051, 450052)]
    rows = {row.id: row for row in ctx.repo.episodes(ctx.cycle_id)}
    for line in lines:
        assert line["status"] == "succeeded" and line["attempt"] == 1 and line["reused"] is False
        row = rows[line["episode_id"]]
        assert row.artifacts == line["artifacts"] and row.condition == "t51_v0" and row.version == 0
        assert all(ctx.artifacts.exists(f"{_prefix_of(row)}/{name}") for name in EPISODE_FILES.values())
    logs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(entry.get("episode_event", {}).get("kind") == "done" for entry in logs)
    assert API_KEY not in stdout + stderr


def _prefix_of(row: Any) -> str:
    return f"cycles/episode-test/episodes/search-t51-v0-s{row.seed}/a{row.attempt}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kind", "search", "--seed", "1"], "--version: search episodes need the workflow version"),
        (["--kind", "nonsense", "--seed", "1"], "--kind: 'nonsense' is not one of"),
        (["--kind", "reference", "--seed", "1", "--task", "999"], "--task: task 999 is not part of cycle"),
        (["--kind", "reference", "--seed", "1", "--prompt-uri", "s3://elsewhere/p.txt"], "is not an artifact of"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    config = write_config(ctx, tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    args = ["run", "--config", str(config), "--task", "51", *extra]
    if "--prompt-uri" not in extra:
        args += ["--prompt-file", str(prompt)]
    process = cli_process(args, tmp_path)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1
    assert ctx.repo.episodes(ctx.cycle_id) == []


# --- workspace seeds (ISSUE #18) ----------------------------------------------------------------------------------


class _WorkspaceCapturingRunner(EpisodeRunner):
    """The real runner, keeping what each agent's workspace held when the agent started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started_with: list[dict[str, bytes]] = []

    async def _run_agent(self, install: QwenInstall, paths: AttemptPaths, env: dict[str, str], scope: str) -> Any:
        files = [p for p in paths.workspace.rglob("*") if p.is_file()]
        self.started_with.append({p.relative_to(paths.workspace).as_posix(): p.read_bytes() for p in files})
        return await super()._run_agent(install, paths, env, scope)


def _seed_archive(members: dict[str, bytes], link: tuple[str, str] | None = None) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tar.addfile(info)
    return buffer.getvalue()


def _stored_seed(ctx: Any, data: bytes) -> Any:
    """The archive stored as the cycle's workspace seed of its SHA-256."""
    import hashlib

    from mass_ops.runtime.episode import WorkspaceSeed, workspace_seed_key

    sha256 = hashlib.sha256(data).hexdigest()
    return WorkspaceSeed(ctx.artifacts.put_bytes(workspace_seed_key(ctx.cycle_name, sha256), data).uri, sha256)


def test_the_agent_starts_in_its_seeded_workspace_and_the_episode_names_the_seed(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    import dataclasses

    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        seed = _stored_seed(ctx, _seed_archive({"repo/calc.py": b"def add(a, b): return a + b\n", "data.csv": b"1"}))
        runner = _WorkspaceCapturingRunner(
            ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "scratch"
        )
        episode = dataclasses.replace(request(ctx, "Fix it.\n@agent requests=1", seed=3), workspace_seed=seed)
        outcome = asyncio.run(runner.run_attempt(episode, 1))

    assert outcome.status == "succeeded"
    assert runner.started_with == [{"repo/calc.py": b"def add(a, b): return a + b\n", "data.csv": b"1"}]
    assert outcome.status_record["workspace_seed"] == {"uri": seed.uri, "sha256": seed.sha256}
    dest = tmp_path / "ws"
    EpisodePool(ctx, runner=runner).workspace(outcome, dest)
    assert (dest / "repo" / "calc.py").read_text().startswith("def add")  # the final workspace holds the seed


def test_a_hostile_seed_starts_no_agent_and_records_nothing(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    import dataclasses

    from mass_ops.runtime.runner import WorkspaceSeedError

    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        seed = _stored_seed(ctx, _seed_archive({"ok.txt": b"ok"}, link=("etc", "/etc")))
        runner = _WorkspaceCapturingRunner(
            ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "scratch"
        )
        episode = dataclasses.replace(request(ctx, "Fix it.\n@agent requests=1", seed=3), workspace_seed=seed)
        with pytest.raises(WorkspaceSeedError, match="'etc' is a link to an absolute path '/etc'") as caught:
            asyncio.run(runner.run_attempt(episode, 1))

    assert "\n" not in str(caught.value)
    assert runner.started_with == [] and ctx.repo.episodes(ctx.cycle_id) == []
    assert list((tmp_path / "scratch" / ctx.cycle_name).iterdir()) == []  # the attempt folder is gone


# --- leases: an attempt in flight is visible before its row (ISSUE #15.3) -------------------------------------------


class _LeaseWatchingPolicy:
    """The stand-in policy, noting the cycle's leases at every chat request: the agent is running right then."""

    def __init__(self, ctx: Any) -> None:
        self.inner = ResearchTeamPolicy()
        self.repo = MetadataRepository.from_url(ctx.config.storage.metadata_url)
        self.cycle_id = ctx.cycle_id
        self.seen: list[list[tuple[str, int, str | None]]] = []

    def respond(self, request: ChatRequest) -> PolicyReply:
        leases = self.repo.episode_leases(self.cycle_id)
        self.seen.append([(lease.unit_key, lease.attempt, lease.host) for lease in leases])
        return self.inner.respond(request)


def test_an_attempt_holds_a_lease_while_its_agent_runs_and_not_after_its_row(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        policy = _LeaseWatchingPolicy(ctx)
        server.policy = policy
        outcome = asyncio.run(
            _runner(ctx, stand_in_install, tmp_path).run_attempt(request(ctx, "hi\n@agent requests=2"), 1)
        )
    assert outcome.status == "succeeded"
    assert policy.seen == [[("reference-t51-s7", 1, lease_host())]] * 2
    assert ctx.repo.episode_leases(ctx.cycle_id) == [] and len(ctx.repo.episodes(ctx.cycle_id)) == 1


def test_an_infrastructure_failure_ends_its_lease_with_its_row(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve(faults=[FaultRule(Fault.HTTP_503, requests=frozenset({2}))]) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        policy = _LeaseWatchingPolicy(ctx)
        server.policy = policy
        runner = _runner(ctx, stand_in_install, tmp_path)
        outcome = asyncio.run(runner.run_attempt(request(ctx, "hi\n@agent requests=2"), 2))
    assert outcome.status == "infra_failure"
    assert policy.seen == [[("reference-t51-s7", 2, lease_host())]], "the request before the 503: attempt 2 running"
    assert ctx.repo.episode_leases(ctx.cycle_id) == []


class _FailingSink:
    """A publication sink whose store fails after the agent ran (nothing recorded); notes the leases it saw."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.seen: list[int] = []

    def deliver(self, publication: Any, abort: Any) -> EpisodeOutcome:
        self.seen = [lease.attempt for lease in self.ctx.repo.episode_leases(self.ctx.cycle_id)]
        raise InfrastructureError("artifact store unreachable")


def test_an_attempt_that_dies_before_its_row_ends_its_lease_too(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        sink = _FailingSink(ctx)
        runner = _runner(ctx, stand_in_install, tmp_path, sink=sink)
        with pytest.raises(InfrastructureError, match="artifact store unreachable"):
            asyncio.run(runner.run_attempt(request(ctx, "hi\n@agent requests=1"), 1))
    assert sink.seen == [1] and ctx.repo.episodes(ctx.cycle_id) == []
    assert ctx.repo.episode_leases(ctx.cycle_id) == []


def test_in_a_pod_the_operators_lease_stands_until_the_publisher_records_the_attempt(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """The sandbox reaches no store (its repository is the hand-off's stand-in: its lease calls do nothing); the
    operator leased the pod's attempt when it created the pod, and the publisher ends the lease with the row."""
    from tests.runtime.test_handoff import SEED, base_env, pod_config, run_pod, store_env, unit_args
    from tests.support.runtime import fake_qwen_runtime

    runtime = fake_qwen_runtime(tmp_path / "runtime")
    pod = {"handoff": tmp_path / "handoff", "scratch": tmp_path / "scratch"}
    pod["handoff"].mkdir()
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path / "pod", f"{server.base_url}/v1")
        policy = _LeaseWatchingPolicy(ctx)
        server.policy = policy
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Write the report.\n@agent requests=1")
        unit = {"task_id": 51, "kind": "reference", "seed": SEED}
        ctx.repo.start_episode_lease(ctx.cycle_id, attempt=1, host="ep-reference-t51", **unit)  # the operator's
        result = run_pod(
            pod_config(ctx.config, tmp_path),
            pod,
            unit_args(prompt, pod["scratch"]),
            base_env(MASS_RUNTIME_DIR=str(runtime), **{KEY_VAR: API_KEY}),
            base_env(**store_env(ctx.config, None)),
        )
    assert result["run"][0] == 0 and result["publish"][0] == 0, result
    assert policy.seen == [[(f"reference-t51-s{SEED}", 1, "ep-reference-t51")]]
    assert [row.status for row in ctx.repo.episodes(ctx.cycle_id)] == ["succeeded"]
    assert ctx.repo.episode_leases(ctx.cycle_id) == []


class _RenewalWaitingPolicy(_LeaseWatchingPolicy):
    """Holds the agent's first request until the attempt's lease has been renewed (the runner renews it while the
    agent runs), then answers; notes whether it saw a renewal before its deadline."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.renewed: list[bool] = []

    def respond(self, request: ChatRequest) -> PolicyReply:
        deadline = time.monotonic() + 30
        renewed = False
        while not renewed and time.monotonic() < deadline:
            renewed = any(
                lease.renewed_at is not None and lease.renewed_at > lease.started_at
                for lease in self.repo.episode_leases(self.cycle_id)
            )
            if not renewed:
                time.sleep(0.02)
        self.renewed.append(renewed)
        return self.inner.respond(request)


def test_a_running_attempt_renews_its_lease(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    """A local runner renews its lease while the attempt lives: `status` tells a runner that died (no renewals) from
    one at work even when episodes have no time limit."""
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        policy = _RenewalWaitingPolicy(ctx)
        server.policy = policy
        runner = _runner(ctx, stand_in_install, tmp_path, lease_renew_s=0.05)
        outcome = asyncio.run(runner.run_attempt(request(ctx, "hi\n@agent requests=1"), 1))
    assert outcome.status == "succeeded" and policy.renewed == [True]
    assert ctx.repo.episode_leases(ctx.cycle_id) == [], "ended with its row, renewals stopped"


def test_the_runner_s_log_reader_skips_a_line_nested_past_the_parser_s_stack(tmp_path: Path) -> None:
    """Classification reads the attempt's proxy log; one unreadable line (here nested past the JSON parser's stack)
    is skipped, not fatal."""
    from mass_ops.runtime.runner import _read_proxy_log

    log = tmp_path / "api.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    lines = [json.dumps({"seq": 1, "status": 200}), deep, json.dumps({"seq": 3, "status": 503})]
    log.write_text("\n".join(lines) + "\n")
    assert [(r["seq"], r["status"]) for r in _read_proxy_log(log)] == [(1, 200), (3, 503)]
