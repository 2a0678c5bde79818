"""Stand-ins for the inner-loop tests: a fake episode executor, a scripted policy wrapper, cycle/config builders.

`FakeExecutor` implements the `EpisodeExecutor` protocol without qwen-code: it writes a deterministic, plausible
research workspace (report, deliverables, plots, results JSON, code, tests) for each request, publishes it to the
artifact store and records real episode rows through the repository — reusing finished units, refusing a changed
prompt, turning configured units into model or infrastructure failures, and retrying infrastructure failures as new
attempts with the same seed. The LLM side is the real HTTP stand-in of `tests.policy_server`.

Run as a module, it is the child process of the crash-resume tests:
`python -m tests.inner_loop_fakes search|collect CONFIG.json [--latency S] [--progress FILE]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import CycleConfig, read_config_source, validate_config
from mass_ops.context import CycleContext, attach_cycle, open_cycle
from mass_ops.judge.evidence import task_plot_paths
from mass_ops.llm import LLMClient, RetryPolicy
from mass_ops.llm.calls import open_client
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.store.artifacts import ArtifactStore
from mass_ops.store.migrations import upgrade
from mass_ops.store.repository import MetadataRepository
from tests.policy_server import (
    ChatRequest,
    EventLoopThread,
    PolicyReply,
    PolicyServer,
    PolicyServerConfig,
    RequestKind,
    ResearchTeamPolicy,
    classify_request,
)

MODEL = "policy-stand-in"

# -- the fake executor ---------------------------------------------------------------------------------------------


def plausible_workspace(request: EpisodeRequest, task_text: str) -> dict[str, bytes]:
    """Files of a research workspace whose completeness and numbers depend deterministically on the seed."""
    seed = request.unit.seed
    digest = int.from_bytes(hashlib.sha256(f"{request.unit.slug}".encode()).digest()[:4], "big")
    sharpe = round(0.2 + (digest % 1000) / 1000, 3)
    plots = task_plot_paths(task_text)
    kept_plots = plots[: max(1, len(plots) - digest % 3)]
    sections = ["Abstract", "Introduction", "Methods", "Results", "Limitations", "Conclusion"]
    if digest % 4 == 0:
        sections.remove("Limitations")
    report = f"# {request.condition} (seed {seed})\n\n" + "\n\n".join(
        f"## {name}\nSection {name.lower()} of the run; headline Sharpe {sharpe}." for name in sections
    )
    metrics = {"seed": seed, "sharpe": sharpe, "rmse": round(1.0 - sharpe / 2, 4), "n_runs": 5}
    files: dict[str, bytes] = {
        "research_report.md": report.encode(),
        "results/metrics.json": json.dumps(metrics, indent=2).encode(),
        "results/model_comparison.json": json.dumps({"model": sharpe, "baseline": 0.1}).encode(),
        "results/ablation_log.json": json.dumps([{"removed": "rates", "delta": -0.05}]).encode(),
        "results/raw_records.json": json.dumps(list(range(50))).encode(),
        "requirements.txt": b"numpy==2.1.0\npandas==2.2.3\n",
        "run_pipeline.py": b"import json\n\n\ndef main():\n    print('regenerate results')\n\n\nmain()\n",
        "tests/test_pipeline.py": b"def test_metrics_exist():\n    assert True\n",
        "logs.txt": f"Plan\nExecution\nReflection (condition {request.condition})\n".encode(),
    }
    if digest % 5 != 0:
        index = [{"path": path, "description": "produced file"} for path in sorted(files)]
        files["deliverables/index.json"] = json.dumps(index, indent=2).encode()
    for plot in kept_plots:
        files[plot] = b"\x89PNG\r\n\x1a\n" + seed.to_bytes(8, "big")
    return files


@dataclasses.dataclass
class FailurePlan:
    """How a unit (by slug) fails: a model failure on every attempt, infrastructure failures on the first
    `infra_attempts` attempts, or its proxy refusing it for a spent budget (`budget_exhausted`, never retried)."""

    model_failure: bool = False
    infra_attempts: int = 0
    budget_exhausted: bool = False


class FakeExecutor:
    """`EpisodeExecutor` writing plausible workspaces and real episode rows (see module docstring)."""

    def __init__(
        self,
        ctx: CycleContext,
        *,
        failures: dict[str, FailurePlan] | None = None,
        latency_s: float = 0.0,
        capacity: int = 4,
        max_attempts: int | None = None,
        on_episode: Callable[[EpisodeRequest], None] | None = None,
        workspace_files: Callable[[EpisodeRequest, str], dict[str, bytes]] = plausible_workspace,
    ) -> None:
        self.ctx = ctx
        self.repo: MetadataRepository = ctx.repo
        self.artifacts: ArtifactStore = ctx.artifacts
        self.failures = failures or {}
        self.latency_s = latency_s
        self.capacity = capacity
        self.max_attempts = max_attempts or ctx.config.runtime.max_infra_attempts
        self.on_episode = on_episode
        self.workspace_files = workspace_files
        self.executed: list[str] = []  # unit keys of attempts actually run (not reused)
        self._lock = threading.Lock()

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        if not requests:
            return []
        if self.capacity == 1:
            return [self._one(request) for request in requests]
        with ThreadPoolExecutor(max_workers=min(self.capacity, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        self.artifacts.get_dir(self.artifacts.key_of(outcome.artifacts["workspace"]), dest)
        return dest

    def _attempts(self, request: EpisodeRequest) -> list[Any]:
        unit = request.unit
        return self.repo.episode_attempts(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            version=unit.version,
            candidate=unit.candidate,
            generation=request.generation,
        )

    def _outcome(self, request: EpisodeRequest, row: Any, reused: bool) -> EpisodeOutcome:
        status_record = self.artifacts.get_json(self.artifacts.key_of(row.artifacts["status"]))
        return EpisodeOutcome(
            request=request,
            episode_id=row.id,
            attempt=row.attempt,
            status=row.status,
            status_record=status_record,
            artifacts=dict(row.artifacts),
            reused=reused,
        )

    def _one(self, request: EpisodeRequest) -> EpisodeOutcome:
        attempts = self._attempts(request)
        if attempts and attempts[-1].status in ("succeeded", "model_failure"):
            last = attempts[-1]
            if last.prompt_sha256 != request.prompt_sha256:
                raise ValueError(f"episode {request.unit.slug}: stored prompt differs from the requested prompt")
            return self._outcome(request, last, reused=True)
        plan = self.failures.get(request.unit.slug, FailurePlan())
        previous = attempts[-1] if attempts else None
        first = len(attempts) + 1
        for number in range(first, first + self.max_attempts):
            row = self._execute(request, number, plan, previous)
            if row.status != "infra_failure":
                break
            previous = row
        return self._outcome(request, row, reused=False)

    def _execute(self, request: EpisodeRequest, attempt: int, plan: FailurePlan, previous: Any) -> Any:
        unit = dataclasses.replace(request.unit, attempt=attempt)
        started = datetime.now(UTC)
        if self.on_episode is not None:
            self.on_episode(request)
        if self.latency_s:
            time.sleep(self.latency_s)
        if attempt <= plan.infra_attempts:
            status, failure = "infra_failure", {"subtype": "api_error_infra", "message": "Connection error"}
        elif plan.budget_exhausted:
            status, failure = "budget_exhausted", {"subtype": "budget_exhausted", "message": "task budget spent"}
        elif plan.model_failure:
            status, failure = "model_failure", {"subtype": "error_max_turns", "message": "the agent gave up"}
        else:
            status, failure = "succeeded", None
        task = self.ctx.catalogue.task(unit.task_id)
        status_record = {
            "started_at": started.isoformat(),
            "finished_at": datetime.now(UTC).isoformat(),
            "model": self.ctx.config.models.served_name,
            "seed": unit.seed,
            "exit_code": 0 if status != "model_failure" else 1,
            "trace_has_success_result": status == "succeeded",
            "failure": failure,
            "hiw": {"condition": request.condition, "mass": True},
        }
        artifacts: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="fake-episode-") as scratch:
            root = Path(scratch) / "workspace"
            for relative, content in self.workspace_files(request, task.task_text).items():
                path = root / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            artifacts["workspace"] = self.artifacts.put_dir(unit.artifact_key("workspace"), root).uri
        artifacts["prompt"] = self.artifacts.put_bytes(unit.artifact_key("prompt"), request.prompt.encode()).uri
        artifacts["status"] = self.artifacts.put_json(unit.artifact_key("status"), status_record).uri
        row = self.repo.record_episode(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            status=status,
            attempt=attempt,
            version=unit.version,
            candidate=unit.candidate,
            generation=request.generation,
            condition=request.condition,
            model=self.ctx.config.models.served_name,
            exit_code=status_record["exit_code"],
            failure=failure,
            prompt_sha256=request.prompt_sha256,
            started_at=started,
            finished_at=datetime.now(UTC),
            artifacts=artifacts,
            retry_of_id=previous.id if previous is not None else None,
        )
        with self._lock:
            self.executed.append(unit.key)
        return row


# -- the scripted policy -------------------------------------------------------------------------------------------


class ScriptedPolicy:
    """`ResearchTeamPolicy` with queued overrides: the next optimizer/judge requests get these replies instead."""

    def __init__(self, base: ResearchTeamPolicy | None = None) -> None:
        self.base = base or ResearchTeamPolicy()
        self.optimizer_replies: list[PolicyReply] = []
        self.judge_replies: list[PolicyReply] = []
        self.judge_winner: Callable[[ChatRequest], str] | None = None
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def respond(self, request: ChatRequest) -> PolicyReply:
        with self._lock:
            self.seen[request.kind.value] += 1
            if request.kind is RequestKind.OPTIMIZER and self.optimizer_replies:
                return self.optimizer_replies.pop(0)
            if request.kind is RequestKind.JUDGE and self.judge_replies:
                return self.judge_replies.pop(0)
        if request.kind is RequestKind.JUDGE and self.judge_winner is not None:
            winner = self.judge_winner(request)
            return PolicyReply(
                content=json.dumps({"winner": winner, "rationale": f"Workspace {winner} is missing less."})
            )
        return self.base.respond(request)


@contextlib.contextmanager
def serve_policy(policy: Any = None, **config: Any) -> Iterator[PolicyServer]:
    """The policy stand-in on 127.0.0.1 (ephemeral port), served from a background event loop."""
    with EventLoopThread() as loop:
        server = PolicyServer(PolicyServerConfig(**config), policy or ResearchTeamPolicy())
        loop.run(server.start())
        try:
            yield server
        finally:
            loop.run(server.stop())


def fast_client(config: CycleConfig) -> LLMClient:
    """A client for tests: transient failures retried without waiting."""
    return open_client(config, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.0))


# -- configs and cycles --------------------------------------------------------------------------------------------


def inner_loop_config(
    *,
    endpoint: str,
    metadata_url: str,
    artifact_url: str,
    tasks: Sequence[int] = (51, 202),
    iterations: int = 1,
    candidates: int = 4,
    train_ranks: int = 2,
    opponents: int = 2,
    require_beats_reference: bool = True,
    position_bias_sample: float = 0.0,
    scheduling_policy: str = "fcfs",
    **search: Any,
) -> CycleConfig:
    """The demo preset shrunk to the inner-loop test budgets, pointed at a policy server and the given stores.
    `scheduling_policy` "priority" makes the server a vLLM one that schedules by priority (the stand-in takes the
    field and ignores it)."""
    data = read_config_source("demo")
    data["name"] = "inner-loop-test"
    data["models"]["served_name"] = MODEL
    data["inference"]["endpoint"] = endpoint
    data["inference"]["max_output_tokens"] = 2048
    data["inference"]["max_concurrent_requests"] = 4
    if scheduling_policy != "fcfs":
        data["inference"]["backend"] = "vllm"
        data["inference"]["server"]["scheduling_policy"] = scheduling_policy
    data["tasks"].update(train_candidates=list(tasks), train=list(tasks), excluded=[])
    data["evaluation"]["tasks"] = [tasks[0], *data["tasks"]["test"]]
    # The demo preset carries designs forward on unusable optimizer output; tests get the paper behaviour unless
    # they ask for it.
    data["search"].update(iterations=iterations, on_invalid_proposal="fail")
    data["search"].update(search)
    data["collection"].update(
        candidates=candidates,
        train_ranks=train_ranks,
        validation_rank=train_ranks + 1,
        require_beats_reference=require_beats_reference,
    )
    data["ranking"].update(opponents_per_episode=opponents, bootstrap_samples=50)
    # The demo measures judge position bias with extra swapped calls; inner-loop tests count calls exactly, as the
    # paper preset makes them, unless they ask for the sample.
    data.setdefault("judge", {})["position_bias_sample"] = position_bias_sample
    data["storage"] = {"metadata_url": metadata_url, "artifact_url": artifact_url}
    return validate_config(data)


_TEMPLATE_LOCK = threading.Lock()
_TEMPLATES: dict[str, Path] = {}


def migrated_sqlite(path: Path) -> str:
    """A SQLite file at `path` with the schema already applied (copied from a per-process template: migrations take
    seconds, a copy milliseconds)."""
    with _TEMPLATE_LOCK:
        template = _TEMPLATES.get("sqlite")
        if template is None:
            template = Path(tempfile.mkdtemp(prefix="mass-schema-")) / "template.db"
            upgrade(f"sqlite:///{template}")
            _TEMPLATES["sqlite"] = template
    source = sqlite3.connect(template)
    target = sqlite3.connect(path)
    with target:
        source.backup(target)
    source.close()
    target.close()
    return f"sqlite:///{path}"


def open_test_cycle(config: CycleConfig) -> CycleContext:
    """Open the cycle; SQLite files made by `migrated_sqlite` skip the migration step."""
    migrated = config.storage.metadata_url.startswith("sqlite:///")
    return open_cycle(config, upgrade_schema=not migrated)


@dataclasses.dataclass
class InnerLoopEnv:
    """A policy server plus stores for one test; `open()` builds a cycle, a fake executor and a client on them."""

    tmp: Path
    server: PolicyServer
    policy: ScriptedPolicy
    metadata_url: str | None = None
    artifact_url: str | None = None
    clients: list[LLMClient] = dataclasses.field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"{self.server.base_url}/v1"

    def config(self, **overrides: Any) -> CycleConfig:
        if self.metadata_url is None:
            self.metadata_url = migrated_sqlite(self.tmp / "metadata.db")
        if self.artifact_url is None:
            self.artifact_url = str(self.tmp / "artifacts")
        return inner_loop_config(
            endpoint=self.endpoint, metadata_url=self.metadata_url, artifact_url=self.artifact_url, **overrides
        )

    def open(self, *, executor_options: dict[str, Any] | None = None, **overrides: Any) -> OpenCycle:
        config = self.config(**overrides)
        ctx = open_test_cycle(config)
        client = fast_client(config)
        self.clients.append(client)
        return OpenCycle(config, ctx, FakeExecutor(ctx, **(executor_options or {})), client)

    def judge_requests(self) -> list[dict[str, Any]]:
        return [body for body in self.server.requests if _kind(body) is RequestKind.JUDGE]

    def optimizer_requests(self) -> list[dict[str, Any]]:
        return [body for body in self.server.requests if _kind(body) is RequestKind.OPTIMIZER]

    def close(self) -> None:
        for client in self.clients:
            client.close()


@dataclasses.dataclass
class OpenCycle:
    config: CycleConfig
    ctx: CycleContext
    executor: FakeExecutor
    client: LLMClient


def _kind(body: dict[str, Any]) -> RequestKind:
    return classify_request(body)


@pytest.fixture(name="inner_loop")
def inner_loop_fixture(tmp_path: Path) -> Iterator[InnerLoopEnv]:
    """A scripted policy server and SQLite + local-folder stores (import this fixture into a test module)."""
    policy = ScriptedPolicy()
    with serve_policy(policy) as server:
        env = InnerLoopEnv(tmp_path, server, policy)
        try:
            yield env
        finally:
            env.close()


# -- child process of the crash-resume tests -------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]


def spawn_stage(stage: str, opened: OpenCycle, tmp: Path, latency: float) -> subprocess.Popen[str]:
    """Run `search` or `collect` of the opened cycle in a child process (`python -m tests.inner_loop_fakes`)."""
    config_file = tmp / f"{stage}-config.json"
    config_file.write_text(json.dumps(opened.config.model_dump(mode="json")))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "tests.inner_loop_fakes", stage, str(config_file), "--latency", str(latency)]
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def kill_when(process: subprocess.Popen[str], ready: Any, timeout_s: float = 60.0) -> None:
    """SIGKILL `process` as soon as `ready()` holds; fail if it finished or timed out first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the child finished before it could be killed:\n{process.stdout.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the child made no progress")
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL


def _child(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.inner_loop_fakes")
    parser.add_argument("stage", choices=["search", "collect"])
    parser.add_argument("config", type=Path)
    parser.add_argument("--latency", type=float, default=0.0)
    args = parser.parse_args(argv)
    config = validate_config(json.loads(args.config.read_text()))
    ctx = attach_cycle(config)
    executor = FakeExecutor(ctx, latency_s=args.latency, capacity=2)
    if args.stage == "search":
        from mass_ops.search import search_tasks

        with fast_client(config) as client:
            search_tasks(ctx, executor, client=client)
    else:
        from mass_ops.stages.collect import collect_batch

        collect_batch(ctx, executor)
    print("done", flush=True)


if __name__ == "__main__":
    _child()
