"""One reconciled cost: the budget ledger's cycle spend is the sum of what the stage tables count. Episodes run
locally whose proxy has no shared budget to check (the demo sets only `budgets.episode_tokens`; the paper presets set
none) are charged whole when their row is recorded, so the cycle row counts every episode's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mass_ops.evaluation.report import build_blocks, collect_report_data
from mass_ops.llm import LLMClient, LLMEndpoint, SamplingParams
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.runtime.pool import EpisodePool
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from mass_ops.store.budgets import BudgetLimits, task_scope
from tests.policy_server import EventLoopThread, PolicyServer, PolicyServerConfig
from tests.support.runtime import MODEL, TASK, PolicyHost, open_episode_cycle, request, runner_environ


@pytest.mark.parametrize("budgets", [{"episode_tokens": 4_000_000}, {}], ids=["demo-budgets", "no-budget"])
def test_the_cycle_spend_counts_every_episode_and_matches_the_stage_tables(
    policy_host: PolicyHost,
    tmp_path: Path,
    stand_in_install: QwenInstall,
    budgets: dict[str, Any],
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1", budgets=budgets)
        prompts = ["Work.\n@agent requests=3", "Brief.\n@agent requests=1"]
        runner = EpisodeRunner(ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "s")
        with EpisodePool(ctx, runner=runner, capacity=1, retry_backoff_s=0.01) as pool:
            outcomes = pool.run([request(ctx, prompt, seed=10 + i) for i, prompt in enumerate(prompts)])
        assert [o.status for o in outcomes] == ["succeeded", "succeeded"]
        # An in-loop call: the call ledger records its spend as it is answered, with or without a limit.
        with EventLoopThread() as loop:
            judge = PolicyServer(PolicyServerConfig(models=(MODEL,)))
            loop.run(judge.start())
            try:
                limits = BudgetLimits.from_mapping(ctx.config.budgets.model_dump())
                ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name, limits=limits)
                endpoint = LLMEndpoint(base_url=f"{judge.base_url}/v1", model=MODEL, backend="openai-compatible",
                                       request_timeout_s=60.0)  # fmt: skip
                client = ledger.bind(LLMClient(endpoint))
                with ledger.attempt(CallUnit(f"task{TASK}/rhi/v0_vs_no_harness", "judge", TASK)):
                    client.chat("Judge.", "Which is better?", purpose="judge", sampling=SamplingParams(max_tokens=16))
            finally:
                loop.run(judge.stop())

    episodes = ctx.repo.episodes(ctx.cycle_id)
    agent_tokens = sum((e.prompt_tokens or 0) + (e.completion_tokens or 0) for e in episodes)
    assert len(episodes) == 2 and agent_tokens > 0
    spend = ctx.repo.budget_spend(ctx.cycle_id)
    [call] = ctx.repo.llm_calls(ctx.cycle_id)
    call_tokens = (call.prompt_tokens or 0) + (call.completion_tokens or 0)
    assert call_tokens > 0
    assert spend["cycle"].tokens == agent_tokens + call_tokens
    assert spend[task_scope(TASK)].tokens == agent_tokens + call_tokens
    # The report says so: one figure, and the headline's cost counts the same tokens.
    data = collect_report_data(ctx, environ={})
    assert data.total_tokens == spend["cycle"].tokens
    texts = [block.text for block in build_blocks(data)]
    assert any(
        text.startswith(f"Reconciled: the cycle's ledger spend, {spend['cycle'].tokens:,} tokens") for text in texts
    )
