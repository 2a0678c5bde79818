"""EpisodePool: done units skipped, infrastructure failures retried as new attempts with the same seed, model
failures final, capacity and fairness across tasks, concurrent callers, cancellation (API and signals)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.runtime.pool import BudgetStopError, EpisodePool, EpisodePromptConflictError, FairScheduler, PoolEvent
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.store.budgets import CYCLE_SCOPE, Refusal, task_scope
from tests.policy_server import FaultRule
from tests.support.runtime import (
    PolicyHost,
    cli_process,
    open_episode_cycle,
    process_alive,
    request,
    runner_environ,
    write_config,
)


class ScriptedRunner:
    """An `AttemptRunner` without processes: records real rows and status artifacts, with scripted statuses."""

    def __init__(self, ctx: Any, statuses: dict[str, list[str]] | None = None, duration_s: float = 0.05) -> None:
        self.ctx = ctx
        self.statuses = statuses or {}
        self.duration_s = duration_s
        self.running = 0
        self.peak = 0
        self.started: list[str] = []

    async def preflight(self) -> None:
        return None

    async def run_attempt(
        self, request: EpisodeRequest, attempt: int, *, retry_of_id: int | None = None, **_: Any
    ) -> Any:
        unit = dataclasses.replace(request.unit, attempt=attempt)
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.started.append(unit.key)
        try:
            await asyncio.sleep(self.duration_s)
        finally:
            self.running -= 1
        script = self.statuses.get(unit.slug, [])
        status = script[attempt - 1] if attempt <= len(script) else "succeeded"
        record = {"status": status, "seed": unit.seed, "attempt": attempt}
        uri = self.ctx.artifacts.put_json(unit.artifact_key("status"), record).uri
        now = datetime.now(UTC)
        row = self.ctx.repo.record_episode(
            self.ctx.cycle_id,
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            status=status,
            attempt=attempt,
            prompt_sha256=request.prompt_sha256,
            started_at=now,
            finished_at=now,
            artifacts={"status": uri},
            retry_of_id=retry_of_id,
        )
        return EpisodeOutcome(request, row.id, attempt, status, record, {"status": uri})  # type: ignore[arg-type]


@pytest.fixture
def ctx(tmp_path: Path) -> Any:
    return open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", capacity=2, max_infra_attempts=3)


# --- scheduling -------------------------------------------------------------------------------------------------


def test_fair_scheduler_serves_the_task_with_fewest_running_first() -> None:
    async def scenario() -> list[int]:
        scheduler = FairScheduler(2)
        order: list[int] = []

        async def episode(task: int) -> None:
            await scheduler.acquire(task)
            order.append(task)
            await asyncio.sleep(0.01)
            scheduler.release(task)

        await asyncio.gather(*(episode(51) for _ in range(6)), *(episode(202) for _ in range(2)))
        assert scheduler.peak == 2 and scheduler.in_use == 0
        return order

    order = asyncio.run(scenario())
    assert order[:2] == [51, 51]  # free slots are taken at once
    # Then slots alternate towards the task with fewer running episodes, instead of draining task 51's queue
    # first (which would start task 202 only 7th and 8th).
    assert order == [51, 51, 202, 51, 202, 51, 51, 51]


def test_fair_scheduler_cancelled_waiter_gives_nothing_away() -> None:
    async def scenario() -> None:
        scheduler = FairScheduler(1)
        await scheduler.acquire(1)
        waiter = asyncio.ensure_future(scheduler.acquire(2))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        scheduler.release(1)
        assert scheduler.in_use == 0
        await asyncio.wait_for(scheduler.acquire(3), 1)

    asyncio.run(scenario())


def test_pool_respects_capacity_and_is_fair_across_tasks(ctx: Any) -> None:
    runner = ScriptedRunner(ctx)
    requests = [request(ctx, "p", task=51, seed=s) for s in range(6)] + [
        request(ctx, "p", task=60, seed=s) for s in range(2)
    ]
    with EpisodePool(ctx, runner=runner) as pool:
        outcomes = pool.run(requests)
    assert [o.request for o in outcomes] == requests  # request order
    assert runner.peak == pool.peak_concurrency == 2
    starts = [key.split("/")[1].split("-")[1] for key in runner.started]
    assert max(i for i, task in enumerate(starts) if task == "t60") <= 4  # FIFO would start them 7th and 8th


def test_concurrent_run_calls_share_the_capacity(ctx: Any) -> None:
    runner = ScriptedRunner(ctx, duration_s=0.1)
    with EpisodePool(ctx, runner=runner) as pool, concurrent.futures.ThreadPoolExecutor(3) as threads:
        batches = [[request(ctx, "p", task=task, seed=s) for s in range(3)] for task in (51, 202, 60)]
        results = list(threads.map(pool.run, batches))
    assert [len(r) for r in results] == [3, 3, 3]
    assert runner.peak == 2


def test_done_units_are_skipped_and_prompt_changes_refused_before_anything_runs(ctx: Any) -> None:
    runner = ScriptedRunner(ctx, statuses={"reference-t51-s2": ["model_failure"]})
    with EpisodePool(ctx, runner=runner) as pool:
        first = pool.run([request(ctx, "p", seed=1), request(ctx, "p", seed=2)])
        assert [o.status for o in first] == ["succeeded", "model_failure"]  # a model failure is final
        again = pool.run([request(ctx, "p", seed=1), request(ctx, "p", seed=2), request(ctx, "p", seed=3)])
        assert [o.reused for o in again] == [True, True, False]
        assert [o.episode_id for o in again[:2]] == [o.episode_id for o in first]
        assert again[1].status_record["status"] == "model_failure"
        assert len(runner.started) == 3

        with pytest.raises(EpisodePromptConflictError, match=r"reference-t51-s1: recorded with prompt sha256"):
            pool.run([request(ctx, "p", seed=4), request(ctx, "changed", seed=1)])
        assert len(runner.started) == 3  # seed 4 did not start either
        with pytest.raises(ValueError, match="requested twice"):
            pool.run([request(ctx, "p", seed=5), request(ctx, "p", seed=5)])


def test_infrastructure_failures_are_retried_with_the_same_seed_up_to_the_limit(ctx: Any) -> None:
    events: list[PoolEvent] = []
    runner = ScriptedRunner(
        ctx,
        statuses={
            "reference-t51-s1": ["infra_failure", "succeeded"],
            "reference-t51-s2": ["infra_failure"] * 5,
        },
    )
    with EpisodePool(ctx, runner=runner, retry_backoff_s=0, on_event=events.append) as pool:
        recovered, exhausted = pool.run([request(ctx, "p", seed=1), request(ctx, "p", seed=2)])
        assert (recovered.status, recovered.attempt) == ("succeeded", 2)
        assert (exhausted.status, exhausted.attempt) == ("infra_failure", 3)  # runtime.max_infra_attempts
        rows = ctx.repo.episode_attempts(ctx.cycle_id, task_id=51, kind="reference", seed=1)
        assert [(r.attempt, r.status) for r in rows] == [(1, "infra_failure"), (2, "succeeded")]
        assert rows[1].retry_of_id == rows[0].id and rows[0].artifacts  # the failed attempt's evidence stays
        assert [r.id for r in ctx.repo.completed_episodes(ctx.cycle_id, 51, "reference")] == [rows[1].id]

        # A later run continues the numbering (attempt k+1 after k failures) and links to the last failure.
        runner.statuses["reference-t51-s2"] = ["infra_failure"] * 3 + ["succeeded"]
        [resumed] = pool.run([request(ctx, "p", seed=2)])
    assert (resumed.status, resumed.attempt) == ("succeeded", 4)
    rows = ctx.repo.episode_attempts(ctx.cycle_id, task_id=51, kind="reference", seed=2)
    assert [r.status for r in rows] == ["infra_failure"] * 3 + ["succeeded"]
    assert [r.retry_of_id for r in rows] == [None, rows[0].id, rows[1].id, rows[2].id]
    assert {r.seed for r in rows} == {2}
    kinds = [e.kind for e in events if e.unit.seed == 1]
    assert kinds == ["queued", "started", "finished", "retrying", "started", "finished", "done"]


class BudgetStoppingRunner(ScriptedRunner):
    """The first attempt is stopped by the task's budget; its agent exits (`on_agent_exit`) well before its outcome
    is published, and the ledger does not show the scope as spent (what the proxy refused was a request's need)."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.refusal = Refusal(task_scope(51), "budgets.task_tokens", 4000, 3455, 882, "tokens")
        self.budgets = SimpleNamespace(
            limits=SimpleNamespace(limited=lambda scopes: list(scopes)), exhausted=lambda scopes: None
        )

    def budget_scopes(self, unit: Any) -> tuple[str, ...]:
        return (task_scope(unit.task_id), CYCLE_SCOPE)

    async def run_attempt(self, request: EpisodeRequest, attempt: int, **options: Any) -> Any:
        self.started.append(request.unit.key)
        if len(self.started) > 1:
            return await super().run_attempt(request, attempt)
        if options.get("on_agent_exit") is not None:
            options["on_agent_exit"]()
        await asyncio.sleep(0.3)  # publishing
        record = {"status": "budget_exhausted", "failure": {"budget": dataclasses.asdict(self.refusal)}}
        return EpisodeOutcome(request, 1, attempt, "budget_exhausted", record, {})  # type: ignore[arg-type]


def test_a_budget_stop_is_known_before_the_next_unit_of_its_scope_is_admitted(tmp_path: Path) -> None:
    """Capacity 1, two units of one task: the first is stopped by the task budget; the second must not start in the
    gap between the first's agent exit and its published outcome."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", capacity=1, max_infra_attempts=1)
    runner = BudgetStoppingRunner(ctx)
    requests = [request(ctx, "p", seed=1, task=51), request(ctx, "p", seed=2, task=51)]
    with EpisodePool(ctx, runner=runner) as pool, pytest.raises(BudgetStopError) as stop:
        pool.run(requests)
    assert runner.started == [requests[0].unit.key]
    assert stop.value.not_started == [requests[1].unit.key]


# --- with the real runner and the stand-in agent -----------------------------------------------------------------


def test_real_runner_retries_a_503_and_keeps_the_failed_attempts_evidence(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve(faults=[FaultRule.parse("http_503:requests=1")]) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        with EpisodePool(
            ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "s", retry_backoff_s=0
        ) as pool:
            [outcome] = pool.run([request(ctx, "go\n@agent requests=2", seed=5)])
    assert (outcome.status, outcome.attempt) == ("succeeded", 2)
    first, second = ctx.repo.episode_attempts(ctx.cycle_id, task_id=51, kind="reference", seed=5)
    assert first.status == "infra_failure" and second.retry_of_id == first.id
    assert first.failure["subtype"] == "api_error_infra" and first.failure["message"].startswith("[API Error: 503")
    failed = ctx.artifacts.get_json("cycles/episode-test/episodes/reference-t51-s5/a1/status.json")
    assert failed["proxy_failures"][0]["status"] == 503 and failed["seed"] == 5
    retried = json.loads(ctx.artifacts.get_bytes("cycles/episode-test/episodes/reference-t51-s5/a2/settings.json"))
    assert retried["modelProviders"]["openai"][0]["generationConfig"]["samplingParams"]["seed"] == 5


def test_cancel_stops_agents_and_records_nothing(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    started = threading.Event()
    events: list[PoolEvent] = []

    def on_event(event: PoolEvent) -> None:
        events.append(event)
        if sum(e.kind == "started" for e in events) == 2:
            started.set()

    with policy_host.serve() as server:
        # The test signals the agent's pids from the host: a plain process (host pids, not a sandbox's).
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", sandbox="none", allow_unsandboxed_agent=True)
        scratch = tmp_path / "scratch"
        pool = EpisodePool(
            ctx,
            install=stand_in_install,
            environ=runner_environ(),
            scratch_dir=scratch,
            keep_scratch=True,
            kill_grace_s=1.0,
            on_event=on_event,
        )
        with pool, concurrent.futures.ThreadPoolExecutor(1) as caller:
            future = caller.submit(pool.run, [request(ctx, "@agent requests=1 sleep=60", seed=s) for s in (1, 2)])
            assert started.wait(30)
            pid_files = [scratch / ctx.cycle_name / f"reference-t51-s{s}-a1" / "workspace" / "pids.txt" for s in (1, 2)]
            deadline = time.monotonic() + 30
            while not all(p.exists() and p.read_text().count("\n") == 2 for p in pid_files):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            began = time.monotonic()
            pool.cancel()
            with pytest.raises(concurrent.futures.CancelledError):
                future.result(timeout=30)
            assert time.monotonic() - began < 15
    pids = [int(pid) for p in pid_files for pid in p.read_text().split()]
    assert len(pids) == 4
    # A signal is delivered asynchronously: on a loaded machine the killed agents take a moment to be gone (they
    # sleep 60 s, so only the cancel can end them within this wait).
    deadline = time.monotonic() + 5
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(pid) for pid in pids)
    assert ctx.repo.episodes(ctx.cycle_id) == []
    assert ctx.artifacts.list("cycles/") == []
    assert not any(e.kind == "done" for e in events)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_cli_signal_stops_agents_and_records_nothing(
    policy_host: PolicyHost, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    with policy_host.serve() as server:
        # The test signals the agent's pids from the host: a plain process (host pids, not a sandbox's).
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", sandbox="none", allow_unsandboxed_agent=True)
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("@agent requests=1 sleep=60")
        scratch = tmp_path / "scratch"
        args = ["run", "--config", str(write_config(ctx, tmp_path)), "--task", "51", "--kind", "reference"]
        args += ["--seed", "1", "--prompt-file", str(prompt), "--scratch-dir", str(scratch), "--keep-scratch"]
        process = cli_process(args, tmp_path)
        pid_file = scratch / ctx.cycle_name / "reference-t51-s1-a1" / "workspace" / "pids.txt"
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().count("\n") == 2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == code, stderr
    assert "nothing was recorded" in stderr
    assert not any(process_alive(int(pid)) for pid in pid_file.read_text().split())
    assert ctx.repo.episodes(ctx.cycle_id) == []
