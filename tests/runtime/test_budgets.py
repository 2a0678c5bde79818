"""Budgets that hold (ISSUE #15.2) at the episode proxy: the request that would cross a budget is refused, the
episode ends `budget_exhausted`, the task's other units are not started, and a rerun with a raised budget continues
without repeating a finished unit. Prompt-cache hits (ISSUE #16.4) reach the proxy record and the episode row."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from mass_ops.runtime.episode import EpisodeOutcome
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.pool import BudgetStopError, EpisodePool
from mass_ops.runtime.proxy import BUDGET_ERROR_CODE, BUDGET_STATUS, EpisodeBudget, LoggingProxy
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from mass_ops.store.budgets import CYCLE_SCOPE, task_scope
from tests.support.runtime import TASK, PolicyHost, open_episode_cycle, request, runner_environ

MAX_OUTPUT = 256  # the agent's max_tokens per request: what each request may need beyond its prompt


def _pool(ctx: Any, install: QwenInstall, tmp: Path) -> EpisodePool:
    runner = EpisodeRunner(ctx, install=install, environ=runner_environ(), scratch_dir=tmp / "scratch")
    return EpisodePool(ctx, runner=runner, capacity=1, retry_backoff_s=0.01)


def _api_records(ctx: Any, outcome: EpisodeOutcome) -> list[dict[str, Any]]:
    unit = outcome.request.unit
    key = f"cycles/{unit.cycle}/episodes/{unit.slug}/a{outcome.attempt}/api_requests.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(ctx.artifacts.get_bytes(key)).decode().splitlines()]


def test_a_task_budget_stops_the_episode_that_would_cross_it_and_a_raised_budget_continues(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    budget = 4000
    with policy_host.serve() as server:
        endpoint = f"{server.base_url}/v1"
        options: dict[str, Any] = {"inference": {"episode_max_output_tokens": MAX_OUTPUT}}
        ctx = open_episode_cycle(tmp_path, endpoint, **options, budgets={"task_tokens": budget})
        # Three units of one task, run one at a time in order: a short one, one that keeps talking, a short one.
        prompts = ["Short.\n@agent requests=2", "Keep going.\n@agent requests=60", "Short again.\n@agent requests=2"]
        requests = [request(ctx, prompt, seed=100 + i) for i, prompt in enumerate(prompts)]
        with _pool(ctx, stand_in_install, tmp_path) as pool, pytest.raises(BudgetStopError) as stop:
            pool.run(requests)

        # The stage's one line says which budget, what happened to the units, and how to go on.
        message = str(stop.value)
        assert f"budget exhausted: task {TASK} has used" in message and "budgets.task_tokens = 4,000" in message
        assert "raise budgets.task_tokens" in message
        assert "1 episode(s) stopped by their proxy, 1 not started, 1 finished" in message
        first, talker, never = stop.value.outcomes
        assert first is not None and first.status == "succeeded"
        assert talker is not None and talker.status == "budget_exhausted" and never is None
        assert stop.value.not_started == [requests[2].unit.key]

        # The proxy refused the request that would have crossed the budget (never forwarded), with a 402 the
        # agent cannot take for an answer; the attempt's row and status document say budget_exhausted.
        records = _api_records(ctx, talker)
        refused = [r for r in records if r.get("budget_exhausted")]
        assert refused and all(r["status"] == BUDGET_STATUS for r in refused)
        assert refused[0]["response"]["error"]["code"] == BUDGET_ERROR_CODE
        assert refused[0]["budget_exhausted"]["scope"] == task_scope(TASK)
        forwarded = sum(1 for r in records if not r.get("budget_exhausted"))
        assert forwarded < 60
        rows = {row.unit_key: row for row in ctx.repo.episodes(ctx.cycle_id)}
        assert {row.status for row in rows.values()} == {"succeeded", "budget_exhausted"} and len(rows) == 2
        failure = talker.status_record["failure"]
        assert failure["subtype"] == "budget_exhausted" and failure["budget"]["setting"] == "budgets.task_tokens"

        # Spend is in the shared ledger: every token the task's responses reported, and no more than the budget.
        spend = ctx.repo.budget_spend(ctx.cycle_id)
        reported = sum(
            UsageTotals.from_records(_api_records(ctx, o)).prompt_tokens
            + UsageTotals.from_records(_api_records(ctx, o)).completion_tokens
            for o in (first, talker)
        )
        assert spend[task_scope(TASK)].tokens == spend[CYCLE_SCOPE].tokens == reported
        overshoot = spend[task_scope(TASK)].tokens - budget
        largest_need = max(r["budget_exhausted"]["need"] for r in refused)
        print(
            f"\nbudget {budget} tokens; spent {spend[task_scope(TASK)].tokens}; overshoot {max(overshoot, 0)} tokens "
            f"(bound: one request's need per concurrent request = {largest_need}; one request in flight here)"
        )
        assert overshoot <= 0

        # The same budget again: nothing runs (the task is exhausted), nothing is redone.
        with _pool(ctx, stand_in_install, tmp_path) as pool, pytest.raises(BudgetStopError) as again:
            pool.run(requests)
        assert again.value.not_started == [requests[1].unit.key, requests[2].unit.key]
        assert len(ctx.repo.episodes(ctx.cycle_id)) == 2

        # Raised: the same cycle continues; the finished unit is reused, the stopped one runs as its next attempt.
        storage = {"metadata_url": ctx.config.storage.metadata_url, "artifact_url": ctx.config.storage.artifact_url}
        ctx = open_episode_cycle(tmp_path, endpoint, **options, **storage, budgets={"task_tokens": 1_000_000})
        with _pool(ctx, stand_in_install, tmp_path) as pool:
            outcomes = pool.run(requests)
    assert [o.status for o in outcomes] == ["succeeded"] * 3
    assert outcomes[0].reused and outcomes[0].episode_id == first.episode_id
    assert (outcomes[1].attempt, outcomes[2].attempt) == (2, 1)
    by_unit: dict[str, list[str]] = {}
    for row in ctx.repo.episodes(ctx.cycle_id):
        by_unit.setdefault(row.unit_key.rsplit("/", 1)[0], []).append(row.status)
    assert sorted(by_unit.values()) == [["budget_exhausted", "succeeded"], ["succeeded"], ["succeeded"]]


def test_an_episode_budget_ends_only_that_episode(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve() as server:
        options: dict[str, Any] = {"inference": {"episode_max_output_tokens": MAX_OUTPUT}}
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", **options, budgets={"episode_tokens": 1500})
        requests = [
            request(ctx, "Talk.\n@agent requests=40", seed=1),
            request(ctx, "Brief.\n@agent requests=1", seed=2),
        ]
        with _pool(ctx, stand_in_install, tmp_path) as pool, pytest.raises(BudgetStopError) as stop:
            pool.run(requests)
    talker, brief = stop.value.outcomes
    assert talker is not None and talker.status == "budget_exhausted"
    assert talker.status_record["failure"]["budget"]["scope"] == "episode"
    # An episode's budget is that episode's: the task's next unit still ran.
    assert brief is not None and brief.status == "succeeded" and stop.value.not_started == []
    assert "budgets.episode_tokens = 1,500" in str(stop.value)


# --- prompt-cache hits (ISSUE #16.4) ------------------------------------------------------------------------------


async def _cached_upstream() -> web.AppRunner:
    """A stand-in server whose usage reports cached prompt tokens, as vLLM with prefix caching and OpenAI do."""

    async def chat(request: web.Request) -> web.Response:
        usage = {
            "prompt_tokens": 120,
            "completion_tokens": 8,
            "total_tokens": 128,
            "prompt_tokens_details": {"cached_tokens": 96},
        }
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        return web.json_response({"id": "c1", "object": "chat.completion", "choices": [choice], "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_cached_prompt_tokens_reach_the_proxy_record_and_the_usage_totals(tmp_path: Path) -> None:
    import aiohttp

    async def scenario() -> list[dict[str, Any]]:
        upstream = await _cached_upstream()
        port = upstream.addresses[0][1]
        budget = EpisodeBudget(episode_tokens=10_000, default_max_tokens=16)
        log = tmp_path / "api.jsonl"
        try:
            async with (
                LoggingProxy(f"http://127.0.0.1:{port}", log, budget=budget) as proxy,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client,
            ):
                for _ in range(2):
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
                    async with client.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
                        assert response.status == 200
        finally:
            await upstream.cleanup()
        assert budget.spent == 2 * 128 and budget.in_flight == 0
        return [json.loads(line) for line in log.read_text().splitlines()]

    records = asyncio.run(scenario())
    assert [r["cached_prompt_tokens"] for r in records] == [96, 96]
    totals = UsageTotals.from_records(records)
    assert (totals.prompt_tokens, totals.cached_prompt_tokens) == (240, 192)


# --- what the earlier requests used, not what they might have --------------------------------------------------


def test_the_next_request_is_admitted_on_what_the_last_one_used_however_slowly_its_record_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent sends its next request as soon as it reads an answer; the answer's record (which settles the held
    need to the tokens used) is written off the loop, here slowly. The second request fits only on what the first
    used (128 tokens), not on the need the first held (its 1,000-token cap): it must be admitted, every time."""
    import aiohttp

    from mass_ops.runtime import proxy_server
    from mass_ops.runtime.generation_request import prepare_generation
    from mass_ops.runtime.proxy_access import CHAT_ROUTE

    real_append = proxy_server.append_record

    def slow_append(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)  # in the recording thread: the answer has long reached the agent
        return real_append(*args, **kwargs)

    monkeypatch.setattr(proxy_server, "append_record", slow_append)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}
    need = prepare_generation(CHAT_ROUTE, json.dumps(body).encode(), default_max_tokens=16, priority=None).need
    assert need is not None and need > 1000

    async def scenario() -> tuple[list[int], EpisodeBudget]:
        upstream = await _cached_upstream()  # answers every request with 128 tokens of usage
        budget = EpisodeBudget(episode_tokens=need + 500, default_max_tokens=16)
        try:
            async with (
                LoggingProxy(
                    f"http://127.0.0.1:{upstream.addresses[0][1]}", tmp_path / "api.jsonl", budget=budget
                ) as proxy,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client,
            ):
                statuses = []
                for _ in range(2):
                    async with client.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
                        await response.read()
                        statuses.append(response.status)
        finally:
            await upstream.cleanup()
        return statuses, budget

    statuses, budget = asyncio.run(scenario())
    assert statuses == [200, 200], "the second request was judged on the first one's cap, not on what it used"
    assert budget.spent == 2 * 128 and budget.in_flight == 0
