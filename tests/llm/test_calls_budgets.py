"""In-loop calls against a cycle budget (ISSUE #15.2): two processes share one `in_loop` budget through the metadata
store and together never exceed it by more than one call; the refusal is one line naming the budget; prompt-cache
hits are kept in the llm_calls rows (ISSUE #16.4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mass_ops.llm import LLMClient, LLMEndpoint, SamplingParams
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.store.budgets import CYCLE_SCOPE, IN_LOOP_SCOPE, BudgetExhaustedError, BudgetLimits, task_scope
from tests.policy_server import EventLoopThread, PolicyServer, PolicyServerConfig
from tests.support.runtime import MODEL, open_episode_cycle

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 64
PEER = """
import json, sys
from mass_ops.llm import LLMClient, LLMEndpoint, SamplingParams
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.budgets import BudgetExhaustedError, BudgetLimits
from mass_ops.store.repository import MetadataRepository

url, cycle_id, name, artifacts, endpoint, budget, tag, model, max_tokens = sys.argv[1:]
ledger = CallLedger(MetadataRepository.from_url(url), open_artifact_store(artifacts), int(cycle_id), name,
                    limits=BudgetLimits(in_loop_tokens=int(budget)))
client = ledger.bind(LLMClient(LLMEndpoint(base_url=endpoint, model=model, backend="openai-compatible",
                                           request_timeout_s=60.0)))
print("ready", flush=True)
sys.stdin.readline()  # both peers start calling together
calls = 0
try:
    for i in range(10_000):
        with ledger.attempt(CallUnit(f"{tag}/{i}", "judge")):
            sampling = SamplingParams(max_tokens=int(max_tokens))
            client.chat("Judge.", "Which is better? " * 30, purpose="judge", sampling=sampling)
        calls += 1
except BudgetExhaustedError as exc:
    print(json.dumps({"calls": calls, "refusal": str(exc)}), flush=True)
"""


@pytest.fixture()
def server() -> Any:
    with EventLoopThread() as loop:
        policy = PolicyServer(PolicyServerConfig(models=(MODEL,)))
        loop.run(policy.start())
        try:
            yield policy
        finally:
            loop.run(policy.stop())


def _peer(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PEER, *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_share_an_in_loop_budget_and_overshoot_it_by_at_most_one_call(
    server: PolicyServer, tmp_path: Path
) -> None:
    budget = 6000
    ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")  # the cycle and its store exist before the peers
    common = [ctx.config.storage.metadata_url, str(ctx.cycle_id), ctx.cycle_name, ctx.config.storage.artifact_url]
    peers = [
        _peer([*common, f"{server.base_url}/v1", str(budget), tag, MODEL, str(MAX_TOKENS)]) for tag in ("p1", "p2")
    ]
    try:
        for peer in peers:  # wait until both are ready; a peer that died says why
            assert peer.stdout is not None and peer.stdin is not None
            line = peer.stdout.readline()
            if line.strip() != "ready":
                pytest.fail(f"peer did not start: {line}{peer.communicate(timeout=60)[1][-2000:]}")
        for peer in peers:
            assert peer.stdin is not None
            peer.stdin.write("go\n")
            peer.stdin.flush()
        results = []
        for peer in peers:
            out, err = peer.communicate(timeout=300)
            assert peer.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
    assert all(r["calls"] > 0 for r in results)
    assert all("budget exhausted: in-loop has used" in r["refusal"] for r in results)
    assert all("raise budgets.in_loop_tokens in the config" in r["refusal"] for r in results)

    rows = ctx.repo.llm_calls(ctx.cycle_id)
    per_call = [(row.prompt_tokens or 0) + (row.completion_tokens or 0) for row in rows]
    assert len(rows) == sum(r["calls"] for r in results)
    spend = ctx.repo.budget_spend(ctx.cycle_id)
    assert spend[IN_LOOP_SCOPE].tokens == spend[CYCLE_SCOPE].tokens == sum(per_call)
    overshoot = sum(per_call) - budget
    print(
        f"\nin-loop budget {budget} tokens; two processes made {len(rows)} calls ({[r['calls'] for r in results]}) "
        f"spending {sum(per_call)} tokens; overshoot {max(overshoot, 0)} tokens (bound: one call, at most "
        f"{max(per_call)} tokens)"
    )
    assert overshoot <= max(per_call)


class _CachedUsageClient(LLMClient):
    """An LLMClient whose transport answers with usage that reports cached prompt tokens (no network)."""

    def _post_completion(self, sdk: Any, body: dict[str, Any]) -> Any:
        usage = {"prompt_tokens": 500, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 448}}
        document = {
            "id": "x",
            "model": self.endpoint.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}],
            "usage": usage,
        }
        return self._raw_response(200, content=json.dumps(document).encode())


def test_refused_calls_send_nothing_and_cached_tokens_are_recorded(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name, limits=BudgetLimits(task_tokens=700))
    client = ledger.bind(_CachedUsageClient(LLMEndpoint(base_url="http://127.0.0.1:9/v1", model=MODEL)))
    unit = CallUnit("task51/rhi/v1", "judge", task_id=51)
    with ledger.attempt(unit):
        result = client.chat("s", "u", purpose="judge", sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert result.cached_prompt_tokens == 448
    [row] = ctx.repo.llm_calls(ctx.cycle_id)
    assert row.cached_prompt_tokens == 448 and row.usage["prompt_tokens_details"] == {"cached_tokens": 448}
    assert ctx.repo.budget_spend(ctx.cycle_id)[task_scope(51)].tokens == 510
    # 510 spent + (estimate + 64) > 700: refused before anything is sent, and nothing is recorded for it.
    refused = r"task 51 has used 510 of budgets.task_tokens = 700"
    with (
        pytest.raises(BudgetExhaustedError, match=refused),
        ledger.attempt(CallUnit("task51/rhi/v2", "judge", task_id=51)),
    ):
        client.chat("s", "u" * 800, purpose="judge", sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert len(ctx.repo.llm_calls(ctx.cycle_id)) == 1
