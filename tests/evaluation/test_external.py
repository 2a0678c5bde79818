"""External judges: OpenAI-compatible (chat completions or the Responses API, reasoning effort passed through) and
Anthropic (streamed Messages with adaptive thinking and effort), keys only from the environment and never stored;
strict verdict reading on each route."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mass_ops.config import ExternalJudgeConfig
from mass_ops.evaluation.external import (
    AnthropicChatClient,
    ExternalJudgeError,
    external_judges,
    judge_presentation,
    open_external_judge,
    self_judge,
)
from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, build_bundle
from mass_ops.llm import LLMOutputError, LLMRequestError, LLMUnavailableError, RetryPolicy, SamplingParams
from mass_ops.llm.calls import CallLedger, CallUnit
from tests.evaluation.fakes import (
    CLAUDE_JUDGE,
    CLAUDE_KEY,
    CLAUDE_KEY_ENV,
    GPT_JUDGE,
    GPT_KEY,
    GPT_KEY_ENV,
    AnthropicStandIn,
    verdict_text,
)
from tests.llm.test_responses import response_document
from tests.test_llm import Reply, ScriptedServer

CLAUDE = ExternalJudgeConfig(
    name=CLAUDE_JUDGE, provider="anthropic", model="claude-stand-in", base_url="http://anthropic.stand-in",
    api_key_env=CLAUDE_KEY_ENV, reasoning_effort="max", max_tokens=32768,
)  # fmt: skip


def test_anthropic_client_streams_with_adaptive_thinking_and_effort(monkeypatch):
    monkeypatch.setenv(CLAUDE_KEY_ENV, CLAUDE_KEY)
    stand_in = AnthropicStandIn(lambda body: "Here is my verdict:\n```json\n" + verdict_text("B") + "\n```")
    judge = open_external_judge(CLAUDE, http_client=stand_in.client(), retry=RetryPolicy(max_attempts=1))
    records = []
    judge.client.recorder = records.append
    result = judge.client.chat("system text", "user text", purpose="external_judge",
                               sampling=judge.sampling(44), json_mode="json_object")  # fmt: skip
    assert result.parsed_json == {"winner": "B", "rationale": "Workspace B has the more complete deliverables."}
    assert result.reasoning_content == "Weigh." and result.provider == "anthropic"
    (body,) = stand_in.bodies
    assert body["stream"] is True
    assert body["thinking"] == {"type": "adaptive"} and body["output_config"] == {"effort": "max"}
    assert body["max_tokens"] == 32768 and body["system"] == "system text"
    assert body["messages"] == [{"role": "user", "content": "user text"}]
    assert "seed" not in body and "temperature" not in body
    # The key goes to the provider and nowhere else: not in the recorded request or response.
    assert CLAUDE_KEY in json.dumps(stand_in.headers[0])
    (record,) = records
    assert record.backend == "anthropic" and record.status == "ok" and record.seed is None
    assert record.usage["completion_tokens"] > 0 and record.usage["prompt_tokens"] > 0
    assert CLAUDE_KEY not in json.dumps([record.request, record.response, record.error], default=str)


def test_anthropic_failures_map_to_the_llm_errors(monkeypatch):
    monkeypatch.setenv(CLAUDE_KEY_ENV, CLAUDE_KEY)
    overloaded = AnthropicStandIn(lambda body: "", status=529)
    client = AnthropicChatClient(model="m", api_key_env=CLAUDE_KEY_ENV, judge="c", base_url="http://a.test",
                                 retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.0),
                                 http_client=overloaded.client())  # fmt: skip
    with pytest.raises(LLMUnavailableError, match="after 3 attempts"):
        client.chat("s", "u", purpose="p", sampling=SamplingParams(max_tokens=10))
    assert len(overloaded.bodies) == 3
    rejected = AnthropicStandIn(lambda body: "", status=400)
    client = AnthropicChatClient(model="m", api_key_env=CLAUDE_KEY_ENV, judge="c", http_client=rejected.client())
    with pytest.raises(LLMRequestError, match="HTTP 400"):
        client.chat("s", "u", purpose="p")
    assert len(rejected.bodies) == 1  # 4xx is never retried
    prose = AnthropicStandIn(lambda body: "I cannot decide.")
    client = AnthropicChatClient(model="m", api_key_env=CLAUDE_KEY_ENV, judge="c", http_client=prose.client())
    with pytest.raises(LLMOutputError, match="no JSON object"):
        client.chat("s", "u", purpose="p", json_mode="json_object")


def test_keys_come_only_from_the_environment(eval_env, monkeypatch):
    monkeypatch.delenv(GPT_KEY_ENV)
    missing = f"judge {GPT_JUDGE}: environment variable {GPT_KEY_ENV} is empty"
    with pytest.raises(ExternalJudgeError, match=missing), external_judges(eval_env.config):
        pass
    monkeypatch.setenv(GPT_KEY_ENV, "two words")
    with pytest.raises(ExternalJudgeError, match="contains whitespace"), external_judges(eval_env.config):
        pass
    unknown = r"judges \['nope'\] are not configured"
    with pytest.raises(ExternalJudgeError, match=unknown), external_judges(eval_env.config, names=["nope"]):
        pass
    with pytest.raises(ExternalJudgeError, match="reasoning_effort must be one of"):
        AnthropicChatClient(model="m", api_key_env=CLAUDE_KEY_ENV, judge="c", effort="extreme")


def test_openai_compatible_judge_sends_reasoning_effort_and_no_seed(eval_env):
    with external_judges(eval_env.config, names=[GPT_JUDGE]) as (judge,):
        eval_env.policy.judge_winner = lambda request: "A"
        system = "You are a senior research reviewer."
        result = judge.client.chat(system, "Compare A and B.", purpose="external_judge",
                                   sampling=judge.sampling(42), json_mode="json_object")  # fmt: skip
    assert result.parsed_json["winner"] == "A"
    (body,) = eval_env.judge_requests()
    assert body["reasoning_effort"] == "xhigh" and body["max_completion_tokens"] == 4096
    assert "max_tokens" not in body
    assert body["response_format"] == {"type": "json_object"}
    assert "seed" not in body and "chat_template_kwargs" not in body
    assert GPT_KEY not in json.dumps(body)


def test_self_judge_samples_like_an_in_loop_call(eval_env):
    judge = self_judge(eval_env.config, eval_env.client)
    sampling = judge.sampling(43)
    assert judge.name == "self" and judge.purpose == "self_judge"
    assert sampling.seed == 43 and sampling.temperature == 0.6 and sampling.top_k == 20
    assert judge.model == eval_env.config.models.served_name


def test_a_strict_anthropic_judge_reads_the_first_fence_as_the_reference(monkeypatch):
    monkeypatch.setenv(CLAUDE_KEY_ENV, CLAUDE_KEY)
    answer = 'First thought {"winner": "A", "rationale": "a"}; final: ```json {"winner": "B", "rationale": "b"} ```'
    stand_in = AnthropicStandIn(lambda body: answer)
    judge = open_external_judge(CLAUDE, http_client=stand_in.client(), retry=RetryPolicy(max_attempts=1))
    strict = judge.client.chat("s", "u", purpose="external_judge", sampling=judge.sampling(42),
                               json_mode="json_object", json_parsing="strict")  # fmt: skip
    assert strict.parsed_json == {"winner": "B", "rationale": "b"}
    with pytest.raises(LLMOutputError, match="no JSON object"):  # the lenient reading finds no object here
        judge.client.chat("s", "u", purpose="external_judge", sampling=judge.sampling(42), json_mode="json_object")


def _bundles(tmp_path: Path) -> list[EvidenceBundle]:
    bundles = []
    for side in ("a", "b"):
        root = tmp_path / side
        root.mkdir()
        (root / "research_report.md").write_text(f"Report {side}.")
        bundles.append(build_bundle(root, task_id=51, task_text="Study SPY.", location=side,
                                    caps=EvidenceCaps.local("q")))  # fmt: skip
    return bundles


STRICT_CASES = [(verdict_text("B"), "B", 1), ('{"winner": "b", "rationale": "r"}', "invalid", 3)]


@pytest.mark.parametrize(("answer", "verdict", "attempts"), STRICT_CASES)
def test_a_responses_judge_judges_a_pair_strictly_with_its_retries(eval_env, tmp_path, answer, verdict, attempts):
    server = ScriptedServer()
    try:
        server.push(*[Reply(200, response_document(answer))] * attempts)
        gpt = ExternalJudgeConfig(name="gpt-5.5", provider="openai-compatible", model="gpt-5.5", api="responses",
                                  base_url=server.url(), api_key_env=GPT_KEY_ENV, reasoning_effort="xhigh",
                                  max_tokens=None)  # fmt: skip
        judge = open_external_judge(gpt, retry=RetryPolicy(max_attempts=1))
        ledger = CallLedger(eval_env.ctx.repo, eval_env.ctx.artifacts, eval_env.ctx.cycle_id, eval_env.ctx.cycle_name)
        unit = CallUnit("eval/external/p1/gpt-5.5/42", judge.purpose, 51)
        bundle_a, bundle_b = _bundles(tmp_path)
        presented = judge_presentation(judge, ledger, unit, task_id=51, task_text="Study SPY.", bundle_a=bundle_a,
                                       bundle_b=bundle_b, seed=42, verdict_parsing="strict")  # fmt: skip
        judge.client.close()
    finally:
        server.close()
    assert presented.outcome.verdict == verdict
    rows = ledger.attempts(unit)
    assert len(rows) == len(server.posts) == attempts  # every unusable answer is a recorded attempt
    assert all(seen.path == "/v1/responses" and "max_output_tokens" not in seen.body for seen in server.posts)
    assert rows[0].prompt_tokens == 1200 and rows[0].completion_tokens == 900
    assert GPT_KEY not in json.dumps([seen.body for seen in server.posts])
