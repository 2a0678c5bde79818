"""What the external judges' clients put on the wire and in the ledger: request bodies, headers, timeouts, transient
retries with their backoff, give-up on permanent failures, and the call records and ledger rows (ISSUE #27.4).

These pin the behaviour of every report judge route (Anthropic Messages, OpenAI chat completions, OpenAI Responses)
so that one client and one retry policy (`mass_ops.llm`) serve them all without changing what they send or record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import ExternalJudgeConfig
from mass_ops.evaluation.external import AnthropicChatClient, judge_presentation, open_external_judge
from mass_ops.judge.evidence import EvidenceCaps, build_bundle
from mass_ops.llm import (
    CallRecord,
    LLMOutputError,
    LLMRequestError,
    LLMUnavailableError,
    RetryPolicy,
    SamplingParams,
)
from mass_ops.llm.calls import CallLedger, CallUnit
from tests.evaluation.fakes import CLAUDE_KEY, CLAUDE_KEY_ENV, GPT_KEY, GPT_KEY_ENV, AnthropicStandIn, verdict_text
from tests.llm.test_responses import response_document
from tests.test_llm import Reply, ScriptedServer, completion

VERDICT = verdict_text("A")
SEND_ONCE = RetryPolicy(max_attempts=1)


class ScriptedStandIn(AnthropicStandIn):
    """The Anthropic stand-in answering with one scripted status per request (200 once the script is spent);
    `cut` requests break their stream mid-message, `refuse` requests fail to connect."""

    def __init__(self, *statuses: int | str, answer: str = VERDICT) -> None:
        super().__init__(lambda body: answer)
        self.script = list(statuses)

    def __call__(self, request: Any) -> Any:
        import httpx2

        step = self.script.pop(0) if self.script else 200
        if step == "refuse":
            self.bodies.append(json.loads(request.content))
            raise httpx2.ConnectError("scripted refusal", request=request)
        self.status = 200 if step == "cut" else int(step)
        response = super().__call__(request)
        if step == "cut":
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=_CutStream())
        return response


class _CutStream:
    """A response stream that breaks after its first event, as a dropped connection does."""

    def __iter__(self) -> Any:
        import httpx2

        yield b'event: ping\ndata: {"type": "ping"}\n\n'
        raise httpx2.ReadError("connection cut mid-message")

    def close(self) -> None:
        pass


def _anthropic(
    stand_in: AnthropicStandIn, *, base_url: str | None = "http://a.test", attempts: int = 4
) -> tuple[AnthropicChatClient, list[float], list[CallRecord]]:
    sleeps: list[float] = []
    records: list[CallRecord] = []
    client = AnthropicChatClient(model="claude-m", api_key_env=CLAUDE_KEY_ENV, judge="claude", base_url=base_url,
                                 effort="high", retry=RetryPolicy(max_attempts=attempts),
                                 http_client=stand_in.client(), sleep=sleeps.append)  # fmt: skip
    client.recorder = records.append
    return client, sleeps, records


@pytest.fixture
def claude_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLAUDE_KEY_ENV, CLAUDE_KEY)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)


# -- Anthropic Messages ----------------------------------------------------------------------------------------------


def test_anthropic_request_headers_result_and_record(claude_key: None) -> None:
    stand_in = ScriptedStandIn()
    client, sleeps, records = _anthropic(stand_in)
    result = client.chat("sys", "usr", purpose="external_judge", sampling=SamplingParams(max_tokens=100, seed=7),
                         json_mode="json_object")  # fmt: skip
    sent = {"model": "claude-m", "max_tokens": 100, "system": "sys", "messages": [{"role": "user", "content": "usr"}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}  # fmt: skip
    assert stand_in.bodies == [{**sent, "stream": True}]
    headers = stand_in.headers[0]
    assert headers["authorization"] == f"Bearer {CLAUDE_KEY}" and headers["host"] == "a.test"
    assert headers["x-stainless-read-timeout"] == "3600.0" and headers["x-stainless-retry-count"] == "0"
    assert headers["x-stainless-helper-method"] == "stream" and "anthropic-version" in headers
    assert sleeps == []
    (record,) = records
    usage = record.usage or {}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (record.purpose, record.backend, record.base_url, record.model) == (
        "external_judge", "anthropic", "http://a.test", "claude-m"
    )  # fmt: skip
    assert (record.seed, record.status, record.attempts, record.cost_usd, record.error) == (None, "ok", 1, None, None)
    assert record.request == sent  # exactly what was sent, without the SDK's stream switch
    assert record.response is not None and record.response["id"] == "msg_1"
    assert record.response["content"][1] == {"citations": None, "text": VERDICT, "type": "text"}
    assert (result.content, result.reasoning_content, result.parsed_json) == (VERDICT, "Weigh.", json.loads(VERDICT))
    assert (result.provider, result.model, result.served_model) == ("anthropic", "claude-m", "claude-m")
    assert (result.finish_reason, result.response_id, result.attempts) == ("end_turn", "msg_1", 1)
    assert result.cost_usd is None
    assert result.usage == usage and result.request == sent
    assert CLAUDE_KEY not in json.dumps([record.request, record.response, record.error], default=str)


def test_anthropic_without_a_base_url_calls_and_records_the_anthropic_api(claude_key: None) -> None:
    stand_in = ScriptedStandIn()
    client, _, records = _anthropic(stand_in, base_url=None)
    client.chat("s", "u", purpose="external_judge")
    assert stand_in.headers[0]["host"] == "api.anthropic.com"
    assert stand_in.bodies[0]["max_tokens"] == 4096 and "output_config" in stand_in.bodies[0]
    assert records[0].base_url == "https://api.anthropic.com"


@pytest.mark.parametrize("failures", [["529"], ["500", "503", "refuse"], ["cut", "502"]])
def test_anthropic_transient_failures_are_retried_with_backoff(claude_key: None, failures: list[str]) -> None:
    stand_in = ScriptedStandIn(*failures)
    client, sleeps, records = _anthropic(stand_in)
    result = client.chat("s", "u", purpose="external_judge", json_mode="json_object")
    attempts = len(failures) + 1
    assert len(stand_in.bodies) == attempts and result.attempts == attempts
    assert sleeps == [2.0, 4.0, 8.0][: len(failures)]  # the default policy: 2 s, doubling
    assert records[0].status == "ok" and records[0].attempts == attempts


def test_anthropic_gives_up_when_transient_failures_persist(claude_key: None) -> None:
    stand_in = ScriptedStandIn(*["529"] * 5)
    client, sleeps, records = _anthropic(stand_in)
    with pytest.raises(LLMUnavailableError) as caught:
        client.chat("s", "u", purpose="external_judge")
    assert caught.value.attempts == 4 and len(stand_in.bodies) == 4 and sleeps == [2.0, 4.0, 8.0]
    assert str(caught.value).startswith("external_judge failed after 4 attempts at http://a.test: HTTP 529")
    (record,) = records
    assert (record.status, record.attempts, record.usage, record.response) == ("error", 4, None, None)
    assert record.error == str(caught.value)


def test_anthropic_gives_up_at_once_on_a_rejected_request(claude_key: None) -> None:
    stand_in = ScriptedStandIn("400")
    client, sleeps, records = _anthropic(stand_in)
    with pytest.raises(LLMRequestError) as caught:
        client.chat("s", "u", purpose="external_judge")
    body = {"type": "error", "error": {"type": "overloaded_error", "message": "scripted failure"}}
    assert str(caught.value) == f"external_judge rejected: HTTP 400: {json.dumps(body)}"
    assert caught.value.status_code == 400 and len(stand_in.bodies) == 1 and sleeps == []
    (record,) = records
    assert (record.status, record.attempts, record.error) == ("error", 1, str(caught.value))


def test_anthropic_rate_limits_follow_the_one_retry_policy(claude_key: None) -> None:
    """Rate-limited (429) requests are a client error like any other 4xx: not retried, as for every LLM client."""
    stand_in = ScriptedStandIn("429")
    client, sleeps, records = _anthropic(stand_in)
    with pytest.raises(LLMRequestError, match="HTTP 429"):
        client.chat("s", "u", purpose="external_judge")
    assert len(stand_in.bodies) == 1 and sleeps == [] and records[0].attempts == 1


def test_anthropic_unusable_answers_are_recorded_with_their_usage(claude_key: None) -> None:
    stand_in = ScriptedStandIn(answer="")
    client, _, records = _anthropic(stand_in)
    with pytest.raises(LLMOutputError) as caught:
        client.chat("s", "u", purpose="external_judge")
    assert str(caught.value) == "empty final content: output ceiling consumed by thinking (stop_reason end_turn)"
    (record,) = records
    assert record.status == "error" and record.error == str(caught.value) and record.attempts == 1
    assert record.usage and record.usage["prompt_tokens"] > 0 and record.response is not None


def test_anthropic_judge_ledger_rows(eval_env: Any, claude_key: None, tmp_path: Path) -> None:
    stand_in = ScriptedStandIn("503", answer=VERDICT)
    config = ExternalJudgeConfig(name="claude", provider="anthropic", model="claude-m", base_url="http://a.test",
                                 api_key_env=CLAUDE_KEY_ENV, reasoning_effort="max", max_tokens=2000)  # fmt: skip
    judge = open_external_judge(config, http_client=stand_in.client(), retry=RetryPolicy(initial_backoff_s=0.0))
    ledger, unit = _ledger(eval_env), CallUnit("eval/external/p1/claude/42", "external_judge", 51)
    presented = _judge(judge, ledger, unit, tmp_path)
    judge.client.close()
    assert presented.outcome.verdict in ("A", "B") and len(stand_in.bodies) == 2
    (row,) = ledger.attempts(unit)
    assert (row.status, row.provider, row.model, row.seed, row.cost_usd) == ("succeeded", "anthropic", "claude-m",
                                                                             None, None)  # fmt: skip
    assert row.prompt_tokens and row.completion_tokens and row.error is None and row.purpose == "external_judge"
    prompt = ledger.artifacts.get_json(ledger.prompt_key(row.unit_key))
    body = {k: v for k, v in stand_in.bodies[-1].items() if k != "stream"}
    assert prompt["request"] == body and prompt["base_url"] == "http://a.test" and prompt["backend"] == "anthropic"
    result = ledger.artifacts.get_json(ledger.result_key(row.unit_key))
    assert result["attempts"] == 2 and result["status"] == "succeeded" and result["cost_usd"] is None
    assert CLAUDE_KEY not in json.dumps([prompt, result])


# -- OpenAI-compatible: chat completions and the Responses API -------------------------------------------------------


def _openai_judge(server: ScriptedServer, api: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(GPT_KEY_ENV, GPT_KEY)
    config = ExternalJudgeConfig(name="gpt", provider="openai-compatible", model="gpt-m", api=api,
                                 base_url=server.url(), api_key_env=GPT_KEY_ENV, reasoning_effort="xhigh",
                                 max_tokens=3000)  # fmt: skip
    judge = open_external_judge(config, retry=RetryPolicy(max_attempts=3))
    sleeps: list[float] = []
    judge.client._sleep = sleeps.append
    records: list[CallRecord] = []
    judge.client.recorder = records.append
    return judge, sleeps, records


@pytest.fixture
def scripted() -> Any:
    server = ScriptedServer()
    yield server
    server.close()


def test_openai_chat_judge_request_headers_and_record(scripted: ScriptedServer, monkeypatch: Any) -> None:
    judge, sleeps, records = _openai_judge(scripted, "chat", monkeypatch)
    scripted.push(Reply(500, {"error": "busy"}), Reply(200, completion(VERDICT, model="gpt-m-2026")))
    result = judge.client.chat("sys", "usr", purpose="external_judge", sampling=judge.sampling(42),
                               json_mode="json_object")  # fmt: skip
    judge.client.close()
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "usr"}]
    sent = {"model": "gpt-m", "messages": messages, "max_completion_tokens": 3000, "reasoning_effort": "xhigh",
            "response_format": {"type": "json_object"}}  # fmt: skip
    assert [seen.body for seen in scripted.posts] == [sent, sent] and sleeps == [2.0]
    headers = scripted.posts[0].headers
    assert headers["authorization"] == f"Bearer {GPT_KEY}" and headers["x-stainless-read-timeout"] == "3600.0"
    (record,) = records
    assert (record.backend, record.base_url, record.seed, record.attempts, record.cost_usd) == (
        "openai-compatible", scripted.url(), None, 2, None
    )  # fmt: skip
    assert record.request == {**sent, "response_format_fallback": False}
    assert result.parsed_json == json.loads(VERDICT) and result.served_model == "gpt-m-2026"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_judges_give_up_on_4xx_at_once_and_on_5xx_after_the_policy(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    judge, sleeps, records = _openai_judge(scripted, api, monkeypatch)
    scripted.push(Reply(429, {"error": "slow down"}))
    with pytest.raises(LLMRequestError, match="HTTP 429"):
        judge.client.chat("s", "u", purpose="external_judge", sampling=judge.sampling(1))
    assert len(scripted.posts) == 1 and sleeps == []
    scripted.push(*[Reply(503, {"error": "down"})] * 3)
    with pytest.raises(LLMUnavailableError, match="after 3 attempts") as caught:
        judge.client.chat("s", "u", purpose="external_judge", sampling=judge.sampling(1))
    judge.client.close()
    assert str(caught.value).endswith('HTTP 503: "down"')
    assert len(scripted.posts) == 4 and sleeps == [2.0, 4.0]
    assert [(r.status, r.attempts) for r in records] == [("error", 1), ("error", 3)]


def test_responses_judge_request_and_record(scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    judge, _, records = _openai_judge(scripted, "responses", monkeypatch)
    scripted.push(Reply(200, response_document(VERDICT)))
    result = judge.client.chat("sys", "usr", purpose="external_judge", sampling=judge.sampling(42),
                               json_mode="json_object")  # fmt: skip
    judge.client.close()
    sent = {"model": "gpt-m", "instructions": "sys", "input": "usr", "text": {"format": {"type": "json_object"}},
            "reasoning": {"effort": "xhigh"}, "max_output_tokens": 3000}  # fmt: skip
    assert [seen.body for seen in scripted.posts] == [sent] and scripted.posts[0].path == "/v1/responses"
    (record,) = records
    assert record.request == {**sent, "dropped_parameters": []} and record.seed is None and record.cost_usd is None
    assert record.usage and record.usage["prompt_tokens"] == 1200 and result.provider is None


# -- helpers ---------------------------------------------------------------------------------------------------------


def _ledger(eval_env: Any) -> CallLedger:
    ctx = eval_env.ctx
    return CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)


def _judge(judge: Any, ledger: CallLedger, unit: CallUnit, tmp_path: Path) -> Any:
    bundles = []
    for side in ("a", "b"):
        root = tmp_path / side
        root.mkdir()
        (root / "research_report.md").write_text(f"Report {side}.")
        bundles.append(build_bundle(root, task_id=51, task_text="Study SPY.", location=side,
                                    caps=EvidenceCaps.local("q")))  # fmt: skip
    return judge_presentation(judge, ledger, unit, task_id=51, task_text="Study SPY.", bundle_a=bundles[0],
                              bundle_b=bundles[1], seed=42)  # fmt: skip
