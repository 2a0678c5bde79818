"""Fault injection through the policy stand-in, with the real qwen-code: each fault is classified as MASS_SPEC §4
says, infrastructure failures are retried as new attempts with their evidence kept, and nothing is recorded as done
that is not.

The four agent faults run at once (one server, cycle and pool each) to keep the wall time near the slowest case.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mass_ops.runtime.episode import EpisodeOutcome
from mass_ops.runtime.outcome import PROXY_FAILURE_MESSAGE
from mass_ops.runtime.pool import EpisodePool
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import ModelNotListedError
from tests.policy_server import FaultRule
from tests.support.runtime import PolicyHost, open_episode_cycle, request, runner_environ


@dataclass(frozen=True)
class FaultCase:
    name: str
    rule: str
    # How attempt 1 must be explained: by qwen-code's "[API Error …" text (it gave up) or by the proxy log
    # (qwen-code retried internally and finished, but a request failed on the wire).
    evidence: str
    text: str | None = None
    runtime: tuple[tuple[str, Any], ...] = ()


CASES = (
    FaultCase("http_503", "http_503:requests=2", evidence="proxy"),
    FaultCase("connection_reset", "connection_reset:requests=1", evidence="proxy"),
    FaultCase("stream_cut", "stream_cut:requests=1+2+3,after_chunks=4", evidence="text", text="terminated"),
    FaultCase(
        "stall",
        "stall:kind=orchestrator,times=3,after_chunks=3,stall_s=60",
        evidence="text",
        text="No stream activity",
        runtime=(("stream_idle_timeout_ms", 1000),),
    ),
)


def _run_case(case: FaultCase, host: PolicyHost, tmp: Path, install: QwenInstall) -> dict[str, Any]:
    with host.serve(faults=[FaultRule.parse(case.rule)]) as server:
        ctx = open_episode_cycle(tmp, f"{server.base_url}/v1", max_infra_attempts=2, **dict(case.runtime))
        with EpisodePool(
            ctx, install=install, environ=runner_environ(), scratch_dir=tmp / "scratch", retry_backoff_s=0
        ) as pool:
            [outcome] = pool.run([request(ctx, "Produce research_report.md and results/metrics.json.", seed=77)])
        return {"ctx": ctx, "outcome": outcome, "faults": dict(server.stats.faults_fired)}


@pytest.fixture(scope="module")
def fault_runs(
    policy_host: PolicyHost, tmp_path_factory: pytest.TempPathFactory, qwen_install: QwenInstall
) -> dict[str, dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as threads:
        futures = {
            case.name: threads.submit(_run_case, case, policy_host, tmp_path_factory.mktemp(case.name), qwen_install)
            for case in CASES
        }
        return {name: future.result(timeout=400) for name, future in futures.items()}


@pytest.mark.slow(seconds=5)  # per case: the cases run together in the module fixture
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_is_an_infrastructure_failure_retried_with_evidence_kept(
    case: FaultCase, fault_runs: dict[str, dict[str, Any]]
) -> None:
    run = fault_runs[case.name]
    ctx, outcome = run["ctx"], run["outcome"]
    assert run["faults"].get(case.name, 0) >= 1  # the fault really fired

    # The retry (attempt 2, same seed) succeeded; the failed attempt is kept and linked.
    assert (outcome.status, outcome.attempt) == ("succeeded", 2), outcome.status_record["failure"]
    first, second = ctx.repo.episode_attempts(ctx.cycle_id, task_id=51, kind="reference", seed=77)
    assert (first.attempt, first.status, second.attempt, second.status) == (1, "infra_failure", 2, "succeeded")
    assert second.retry_of_id == first.id and first.seed == second.seed == 77

    failure = first.failure
    assert failure["subtype"] == "api_error_infra"
    if case.evidence == "text":
        assert failure["message"].startswith("[API Error") and case.text in failure["message"]
    else:
        assert failure["message"] == PROXY_FAILURE_MESSAGE and failure["proxy_failures"]

    # Evidence of the failed attempt: every artifact published, its status says why, its proxy log shows the fault.
    prefix = "cycles/episode-test/episodes/reference-t51-s77/a1"
    assert set(first.artifacts) == {"workspace", "api_log", "stream", "stderr", "status", "prompt", "settings"}
    status = ctx.artifacts.get_json(f"{prefix}/status.json")
    assert status["status"] == "infra_failure" and status["trace_has_success_result"] is False
    assert status["failure"] == failure
    if case.evidence == "proxy":
        records = [
            json.loads(line)
            for line in gzip.decompress(ctx.artifacts.get_bytes(f"{prefix}/api_requests.jsonl.gz")).splitlines()
        ]
        broken = [r for r in records if r.get("proxy_error") or (r["status"] or 0) >= 400]
        assert broken and broken[0]["seq"] == failure["proxy_failures"][0]["seq"]
    else:
        stream = ctx.artifacts.get_bytes(f"{prefix}/stream.jsonl").decode()
        assert case.text in stream

    _assert_only_true_successes_are_done(ctx, outcome)


def _assert_only_true_successes_are_done(ctx: Any, outcome: EpisodeOutcome) -> None:
    done = ctx.repo.completed_episodes(ctx.cycle_id, 51, "reference")
    assert [row.id for row in done] == [outcome.episode_id]
    for row in done:
        status = ctx.artifacts.get_json(f"cycles/episode-test/episodes/reference-t51-s77/a{row.attempt}/status.json")
        assert status["trace_has_success_result"] is True and status["proxy_failures"] == []


def test_endpoint_without_the_model_fails_before_anything_runs(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall
) -> None:
    with policy_host.serve(faults=[FaultRule.parse("model_not_listed")]) as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        with (
            EpisodePool(ctx, install=stand_in_install, environ=runner_environ(), scratch_dir=tmp_path / "s") as pool,
            pytest.raises(ModelNotListedError, match=r"does not serve model 'policy-stand-in' \(it lists: none\)"),
        ):
            pool.run([request(ctx, "hi", seed=s) for s in (1, 2)])
        assert server.stats.chat_requests == 0 and server.stats.models_requests == 1
    assert not (tmp_path / "s").exists()
    assert ctx.artifacts.list("cycles/") == [] and ctx.repo.episodes(ctx.cycle_id) == []
