"""Stand-ins for the evaluation tests, each named as such.

* `eval_env` (fixture): the scripted OpenAI-compatible policy server (`tests.policy_server`) serving the in-loop model
  and an external "gpt-judge", SQLite + local-folder stores, a cycle whose config names two external judges, and the
  generations L0 → L1 registered.
* `AnthropicStandIn`: an httpx2 transport answering the Anthropic Messages API with a scripted SSE stream — the real
  `anthropic` SDK parses it; no network.
* `BenchmarkExecutor`: an `EpisodeExecutor` that writes scripted benchmark workspaces and records real episode rows
  (with token accounting), reusing finished units like the real runner.
* Judges by alias: judges see workspaces only as `workspace_alias(...)`; `alias_judge` decides from those aliases.
* Generation servers: `serve_generation_stand_ins` gives each evaluated generation its own scripted policy server and
  records it as that generation's local server (state file under the cwd); `RecordingExecutors` is the executor
  factory the cycle and nightly functions take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import CycleConfig, validate_config
from mass_ops.context import CycleContext
from mass_ops.evaluation.pairing import RolloutPair, pairs_document, pairs_from_document
from mass_ops.llm import LLMClient
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.stages.evaluate import workspace_alias
from mass_ops.store.repository import MetadataRepository
from tests.inner_loop_fakes import (
    FakeExecutor,
    ScriptedPolicy,
    fast_client,
    inner_loop_config,
    migrated_sqlite,
    open_test_cycle,
    serve_policy,
)
from tests.policy_server import ChatRequest, PolicyServer, RequestKind, classify_request

FIXTURES = Path(__file__).parent / "fixtures"
GPT_JUDGE = "gpt-judge"
CLAUDE_JUDGE = "claude-judge"
GPT_KEY_ENV = "MASS_TEST_GPT_JUDGE_KEY"
CLAUDE_KEY_ENV = "MASS_TEST_CLAUDE_JUDGE_KEY"
# Recognisable fake keys: tests assert they never reach a row, an artifact or a log.
GPT_KEY = "sk-test-gpt-judge-SECRET-0001"
CLAUDE_KEY = "sk-ant-test-claude-judge-SECRET-0002"
_PATH = re.compile(r"# Workspace ([AB]) \(evidence only\)\nPath: `([^`]+)`")


def shown_aliases(user_text: str) -> dict[str, str]:
    """{"A": alias, "B": alias} of a pairwise judge prompt."""
    return dict(_PATH.findall(user_text))


def alias_judge(prefer: Callable[[str, str], str]) -> Callable[[str], str]:
    """A verdict function over the user prompt: `prefer(alias_a, alias_b)` returns A, B or tie."""

    def decide(user_text: str) -> str:
        aliases = shown_aliases(user_text)
        return prefer(aliases["A"], aliases["B"])

    return decide


def preferring(winners: set[str], ties: set[str] | frozenset[str] = frozenset()) -> Callable[[str, str], str]:
    """Prefer the workspace whose alias is in `winners`; a tie when either alias is in `ties`."""

    def prefer(alias_a: str, alias_b: str) -> str:
        if alias_a in ties or alias_b in ties:
            return "tie"
        if alias_a in winners and alias_b not in winners:
            return "A"
        if alias_b in winners and alias_a not in winners:
            return "B"
        return "tie"

    return prefer


def aliases_of(pairs: Sequence[RolloutPair], side: str) -> set[str]:
    return {workspace_alias(pair.a if side == "a" else pair.b) for pair in pairs}


# -- the Anthropic stand-in ------------------------------------------------------------------------------------------


def _sse(events: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


class AnthropicStandIn:
    """Answers ``POST /v1/messages`` (streamed) with thinking + text blocks; `answer(body)` gives the text."""

    def __init__(self, answer: Callable[[dict[str, Any]], str], *, status: int = 200) -> None:
        self.answer = answer
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def client(self) -> Any:
        import httpx2

        return httpx2.Client(transport=httpx2.MockTransport(self))

    def __call__(self, request: Any) -> Any:
        import httpx2

        body = json.loads(request.content)
        with self._lock:
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
        if self.status != 200:
            error = {"type": "error", "error": {"type": "overloaded_error", "message": "scripted failure"}}
            return httpx2.Response(self.status, json=error)
        text = self.answer(body)
        events = [
            {
                "type": "message_start",
                "message": {
                    "id": f"msg_{len(self.bodies)}",
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": len(json.dumps(body)) // 4, "output_tokens": 1},
                },
            },
            {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Weigh."}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}},
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
            *(
                {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": text[i : i + 40]}}
                for i in range(0, len(text), 40)
            ),
            {"type": "content_block_stop", "index": 1},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": max(1, len(text) // 4)},
            },
            {"type": "message_stop"},
        ]
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(events))


def verdict_text(winner: str) -> str:
    return json.dumps({"winner": winner, "rationale": f"Workspace {winner} has the more complete deliverables."})


def user_text_of(body: dict[str, Any]) -> str:
    """The user message of an Anthropic request body."""
    return "\n".join(str(m.get("content")) for m in body.get("messages") or [] if m.get("role") == "user")


# -- benchmark executor ----------------------------------------------------------------------------------------------


class BenchmarkExecutor:
    """`EpisodeExecutor` for benchmark tasks: `files_for(request)` gives the workspace files; rows get token counts
    `tokens_for(request)` (completion) and a 30 s duration."""

    def __init__(
        self,
        ctx: CycleContext,
        files_for: Callable[[EpisodeRequest], dict[str, bytes]],
        tokens_for: Callable[[EpisodeRequest], int] = lambda request: 1000,
    ) -> None:
        self.ctx = ctx
        self.files_for = files_for
        self.tokens_for = tokens_for
        self.executed: list[str] = []

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        return [self._one(request) for request in requests]

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        self.ctx.artifacts.get_dir(self.ctx.artifacts.key_of(outcome.artifacts["workspace"]), dest)
        return dest

    def _one(self, request: EpisodeRequest) -> EpisodeOutcome:
        unit = request.unit
        repo: MetadataRepository = self.ctx.repo
        attempts = repo.episode_attempts(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            candidate=unit.candidate,
            generation=request.generation,
        )
        if attempts:
            row = attempts[-1]
            return EpisodeOutcome(request, row.id, row.attempt, row.status, {}, dict(row.artifacts), reused=True)
        attempt = dataclasses.replace(unit, attempt=1)
        with tempfile.TemporaryDirectory(prefix="bench-ws-") as scratch:
            root = Path(scratch) / "workspace"
            root.mkdir()
            for relative, content in self.files_for(request).items():
                path = root / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            workspace = self.ctx.artifacts.put_dir(attempt.artifact_key("workspace"), root).uri
        status = self.ctx.artifacts.put_json(attempt.artifact_key("status"), {"condition": request.condition}).uri
        started = datetime(2026, 10, 1, 12, 0, tzinfo=UTC)
        row = repo.record_episode(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            status="succeeded",
            candidate=unit.candidate,
            generation=request.generation,
            condition=request.condition,
            prompt_sha256=request.prompt_sha256,
            prompt_tokens=5000,
            completion_tokens=self.tokens_for(request),
            started_at=started,
            finished_at=started + timedelta(seconds=30),
            artifacts={"workspace": workspace, "status": status},
        )
        self.executed.append(row.unit_key)
        return EpisodeOutcome(request, row.id, row.attempt, "succeeded", {}, dict(row.artifacts))


# -- the environment -------------------------------------------------------------------------------------------------


def evaluation_config(config: CycleConfig, *, judge_endpoint: str, **evaluation: Any) -> CycleConfig:
    """`config` with two external judges: gpt-judge on the policy server and claude-judge (Anthropic stand-in)."""
    data = config.model_dump(mode="json")
    data["evaluation"].update(
        judge_seeds=[42, 43, 44],
        judges=[
            {
                "name": GPT_JUDGE,
                "provider": "openai-compatible",
                "model": GPT_JUDGE,
                "base_url": judge_endpoint,
                "api_key_env": GPT_KEY_ENV,
                "reasoning_effort": "xhigh",
                "max_tokens": 4096,
            },
            {
                "name": CLAUDE_JUDGE,
                "provider": "anthropic",
                "model": "claude-stand-in",
                "base_url": "http://anthropic.stand-in",
                "api_key_env": CLAUDE_KEY_ENV,
                "reasoning_effort": "max",
                "max_tokens": 4096,
            },
        ],
        **evaluation,
    )
    return validate_config(data)


@dataclasses.dataclass
class EvalEnv:
    tmp: Path
    server: PolicyServer
    policy: ScriptedPolicy
    config: CycleConfig
    ctx: CycleContext
    client: LLMClient

    @property
    def endpoint(self) -> str:
        return f"{self.server.base_url}/v1"

    def rollout_executor(self, **options: Any) -> FakeExecutor:
        return FakeExecutor(self.ctx, **options)

    def judge_requests(self) -> list[dict[str, Any]]:
        """Chat bodies the policy server received for the external gpt-judge."""
        return [body for body in self.server.requests if body.get("model") == GPT_JUDGE]


def register_generations(repo: MetadataRepository, names: Sequence[str] = ("L0", "L1")) -> None:
    parent = None
    for number, name in enumerate(names):
        row = repo.register_generation(name, number, bf16_uri=f"models/{name}-bf16", parent_id=parent)
        parent = row.id


@contextlib.contextmanager
def open_eval_env(tmp: Path, monkeypatch: pytest.MonkeyPatch, metadata_url: str | None = None) -> Iterator[EvalEnv]:
    """Policy server + stores (SQLite unless `metadata_url`) + an opened cycle with two external judges and the
    generations L0, L1 registered."""
    monkeypatch.setenv(GPT_KEY_ENV, GPT_KEY)
    monkeypatch.setenv(CLAUDE_KEY_ENV, CLAUDE_KEY)
    policy = ScriptedPolicy()
    with serve_policy(policy, models=("policy-stand-in", GPT_JUDGE)) as server:
        base = inner_loop_config(
            endpoint=f"{server.base_url}/v1",
            metadata_url=metadata_url or migrated_sqlite(tmp / "metadata.db"),
            artifact_url=str(tmp / "artifacts"),
            tasks=(51, 202),
        )
        config = evaluation_config(base, judge_endpoint=f"{server.base_url}/v1")
        ctx = open_test_cycle(config)
        register_generations(ctx.repo)
        client = fast_client(config)
        try:
            yield EvalEnv(tmp, server, policy, config, ctx, client)
        finally:
            client.close()


@pytest.fixture(name="eval_env")
def eval_env_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EvalEnv]:
    """The evaluation environment on SQLite and a local artifact folder."""
    with open_eval_env(tmp_path, monkeypatch) as env:
        yield env


def policy_verdicts(env: EvalEnv, decide: Callable[[str], str]) -> None:
    """Make the policy server's judges (gpt-judge and the in-loop self-judge) answer with `decide(user_text)`."""

    def winner(request: ChatRequest) -> str:
        return decide(request.user_text())

    env.policy.judge_winner = winner


# -- generation servers of a cycle or nightly evaluation -------------------------------------------------------------


def record_local_server(scope: str, generation: str, *, endpoint: str, served_name: str) -> Path:
    """Write the local state file (under the cwd) saying `generation` is served in `scope` at `endpoint`.

    The recorded process has already exited and its start time can never match, so `stop_generations` treats it as
    gone and never signals anything."""
    from mass_ops.compute.local import ServerState
    from mass_ops.serving import state_file

    finished = subprocess.Popen(["true"])
    finished.wait()
    state = ServerState(
        pid=finished.pid,
        pgid=finished.pid,
        argv=["stand-in", generation],
        endpoint=endpoint,
        served_name=served_name,
        log_path=str(state_file(scope, generation).with_suffix(".log")),
        started_at=0.0,
        start_ticks=-1,
    )
    path = state_file(scope, generation)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(state)))
    return path


@dataclasses.dataclass
class GenerationStandIn:
    """A scripted policy server standing in for one generation's model server (served as ``served-<name>``)."""

    generation: str
    server: PolicyServer
    policy: ScriptedPolicy

    @property
    def served_name(self) -> str:
        return f"served-{self.generation}"

    @property
    def endpoint(self) -> str:
        return f"{self.server.base_url}/v1"

    def judge_requests(self) -> list[dict[str, Any]]:
        """Chat bodies this generation's server received as in-loop judge calls."""
        return [body for body in self.server.requests if classify_request(body) is RequestKind.JUDGE]


@contextlib.contextmanager
def serve_generation_stand_ins(scope: str, names: Sequence[str]) -> Iterator[dict[str, GenerationStandIn]]:
    """One scripted policy server per generation, each recorded as that generation's local server in `scope`."""
    with contextlib.ExitStack() as stack:
        found: dict[str, GenerationStandIn] = {}
        for name in names:
            policy = ScriptedPolicy()
            server = stack.enter_context(serve_policy(policy, models=(f"served-{name}",)))
            found[name] = GenerationStandIn(name, server, policy)
            record_local_server(scope, name, endpoint=found[name].endpoint, served_name=found[name].served_name)
        yield found


def prefer_generation(ctx: CycleContext, generation: str) -> Callable[[str], str]:
    """A verdict function over a pairwise prompt: the workspace that `generation` rolled out wins (a tie when neither
    or both shown workspaces are its). Aliases are looked up among the cycle's rollout episodes at judging time."""

    def decide(user_text: str) -> str:
        owners = {
            workspace_alias(f"{ctx.cycle_name}/{row.unit_key}"): row.generation
            for row in ctx.repo.episodes(ctx.cycle_id, kind="rollout")
        }
        shown = shown_aliases(user_text)
        a, b = owners.get(shown["A"]), owners.get(shown["B"])
        if a == generation and b != generation:
            return "A"
        if b == generation and a != generation:
            return "B"
        return "tie"

    return decide


def judge_with(policy: ScriptedPolicy, decide: Callable[[str], str]) -> None:
    """Make a scripted policy's judges answer with `decide(user_text)`."""
    policy.judge_winner = lambda request: decide(request.user_text())


def route_anthropic_judges(monkeypatch: pytest.MonkeyPatch, stand_in: AnthropicStandIn) -> None:
    """Every Anthropic judge that `external_judges` opens talks to `stand_in` (no network)."""
    from mass_ops.evaluation import external

    real = external.open_external_judge

    def opened(judge: Any, **options: Any) -> Any:
        if judge.provider == "anthropic":
            options["http_client"] = stand_in.client()
        return real(judge, **options)

    monkeypatch.setattr(external, "open_external_judge", opened)


class RecordingExecutors:
    """An executor factory (context → context manager) handing out a `FakeExecutor` on the context it is given —
    the served context, so episode rows name the generation's served model — and keeping them to count what ran."""

    def __init__(self) -> None:
        self.made: list[FakeExecutor] = []

    def __call__(self, ctx: CycleContext) -> contextlib.AbstractContextManager[FakeExecutor]:
        executor = FakeExecutor(ctx)
        self.made.append(executor)
        return contextlib.nullcontext(executor)

    @property
    def executed(self) -> list[str]:
        """Unit keys of the episode attempts actually run (not reused), over every executor handed out."""
        return [key for executor in self.made for key in executor.executed]


# -- child process of the kill-and-resume test -----------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def spawn_judging(config: CycleConfig, pairs: Sequence[RolloutPair], tmp: Path) -> subprocess.Popen[str]:
    """`judge_pairs` with the gpt-judge over `pairs` in a child process (`python -m tests.evaluation.fakes`)."""
    config_file, pairs_file = tmp / "judge-config.json", tmp / "judge-pairs.json"
    config_file.write_text(json.dumps(config.model_dump(mode="json")))
    pairs_file.write_text(json.dumps(pairs_document(pairs)))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "tests.evaluation.fakes", str(config_file), str(pairs_file)]
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _child(argv: Sequence[str] | None = None) -> None:
    from mass_ops.context import attach_cycle
    from mass_ops.evaluation.external import external_judges
    from mass_ops.stages.evaluate import judge_pairs

    config_file, pairs_file = (Path(arg) for arg in (argv or sys.argv[1:]))
    config = validate_config(json.loads(config_file.read_text()))
    pairs = pairs_from_document(json.loads(pairs_file.read_text()))
    with external_judges(config, names=[GPT_JUDGE]) as judges:
        judge_pairs(attach_cycle(config), pairs, judges, max_workers=1)
    print("done", flush=True)


if __name__ == "__main__":
    _child()
