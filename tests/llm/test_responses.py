"""`ResponsesClient` against a scripted HTTP stand-in of the OpenAI Responses API on 127.0.0.1: the request the
reference's gpt-5.5 judge sends, the answer, usage, the parameter fallback, retries and the key kept out of records."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from mass_ops.config import ExternalJudgeConfig, load_config
from mass_ops.evaluation.external import ReasoningEffortClient, open_external_judge
from mass_ops.llm import (
    CallRecord,
    LLMEndpoint,
    LLMOutputError,
    LLMRequestError,
    LLMUnavailableError,
    ResponsesClient,
    RetryPolicy,
    SamplingParams,
)
from tests.test_llm import Reply, ScriptedServer

KEY_ENV = "MASS_TEST_RESPONSES_KEY"
KEY = "sk-test-responses-0123456789abcdef"
VERDICT = '{"winner": "B", "rationale": "B reports its validation."}'


def response_document(
    text: str | None = VERDICT,
    *,
    status: str = "completed",
    usage: dict[str, Any] | None = None,
    extra_output: list[dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A Responses-API body: a reasoning item with a summary, then one message with `text` in two parts."""
    output: list[dict[str, Any]] = [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Compared both."}]}
    ]
    if text is not None:
        half = len(text) // 2
        parts = [{"type": "output_text", "text": text[:half], "annotations": []}]
        parts.append({"type": "output_text", "text": text[half:], "annotations": []})
        output.append({"type": "message", "id": "msg_1", "role": "assistant", "status": status, "content": parts})
    output.extend(extra_output or [])
    return {
        "id": "resp_test",
        "object": "response",
        "model": "gpt-5.5-2026-01-01",
        "status": status,
        "output": output,
        "usage": usage
        or {
            "input_tokens": 1200,
            "input_tokens_details": {"cached_tokens": 200},
            "output_tokens": 900,
            "output_tokens_details": {"reasoning_tokens": 850},
            "total_tokens": 2100,
        },
        **fields,
    }


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


def _client(
    server: ScriptedServer, records: list[CallRecord], *, effort: str | None = "xhigh", attempts: int = 3
) -> ResponsesClient:
    endpoint = LLMEndpoint(base_url=server.url(), model="gpt-5.5", api_key_env=KEY_ENV, backend="openai-compatible")
    retry = RetryPolicy(max_attempts=attempts, initial_backoff_s=0.0)
    return ResponsesClient(endpoint, reasoning_effort=effort, retry=retry, recorder=records.append, sleep=_no_wait)


def _no_wait(seconds: float) -> None:
    pass


def test_a_json_call_sends_the_references_request_and_reads_text_and_usage(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    server.push(Reply(200, response_document()))
    records: list[CallRecord] = []
    with _client(server, records) as client:
        result = client.chat("system text", "user text", purpose="external_judge", json_mode="json_object",
                             json_parsing="strict")  # fmt: skip
    (seen,) = server.posts
    assert seen.path == "/v1/responses"
    assert seen.body == {
        "model": "gpt-5.5",
        "instructions": "system text",
        "input": "user text",
        "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "xhigh"},
    }  # no output cap, no seed, no temperature
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert result.content == VERDICT and result.parsed_json == json.loads(VERDICT)
    assert result.reasoning_content == "Compared both." and result.finish_reason == "completed"
    assert (result.usage["prompt_tokens"], result.usage["completion_tokens"], result.usage["total_tokens"]) == (
        1200,
        900,
        2100,
    )
    assert result.cached_prompt_tokens == 200
    assert result.usage["completion_tokens_details"] == {"reasoning_tokens": 850}
    assert result.served_model == "gpt-5.5-2026-01-01" and result.response_id == "resp_test"
    (record,) = records
    assert record.status == "ok" and record.request["dropped_parameters"] == []
    assert KEY not in json.dumps([record.request, record.response, record.error], default=str)


def test_the_output_cap_and_sampling_are_sent_only_when_set(server: ScriptedServer, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    server.push(Reply(200, response_document("plain words")))
    with _client(server, [], effort=None) as client:
        result = client.chat("s", "u", purpose="probe", sampling=SamplingParams(max_tokens=16000, temperature=0.2,
                                                                                   seed=42, top_k=20))  # fmt: skip
    body = server.posts[0].body
    assert body["max_output_tokens"] == 16000 and body["temperature"] == 0.2
    assert not {"reasoning", "text", "seed", "top_k", "max_tokens", "messages"} & set(body)
    assert result.parsed_json is None and result.content == "plain words"


def test_a_strict_call_reads_only_a_whole_json_answer(server: ScriptedServer, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    fenced = f"```json\n{VERDICT}\n```"
    server.push(Reply(200, response_document(fenced)), Reply(200, response_document(fenced)))
    records: list[CallRecord] = []
    with _client(server, records) as client:
        lenient = client.chat("s", "u", purpose="external_judge", json_mode="json_object")
        assert lenient.parsed_json == json.loads(VERDICT)
        with pytest.raises(LLMOutputError, match="not one JSON document"):
            client.chat("s", "u", purpose="external_judge", json_mode="json_object", json_parsing="strict")
    assert [record.status for record in records] == ["ok", "error"]


def test_a_rejected_reasoning_parameter_is_dropped_once_and_recorded(server: ScriptedServer, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    rejected = {"error": {"message": "Unsupported parameter: 'reasoning.effort' is not supported with this model."}}
    server.push(Reply(400, rejected), Reply(200, response_document()))
    records: list[CallRecord] = []
    with _client(server, records) as client:
        result = client.chat("s", "u", purpose="external_judge", json_mode="json_object")
    first, second = server.posts
    assert first.body["reasoning"] == {"effort": "xhigh"} and "reasoning" not in second.body
    assert result.request["dropped_parameters"] == ["reasoning"] and result.attempts == 2
    # Any other 400 is final, and so is a second one naming a parameter already dropped.
    server.push(Reply(400, {"error": {"message": "input too long"}}))
    with _client(server, records) as client, pytest.raises(LLMRequestError, match="HTTP 400"):
        client.chat("s", "u", purpose="external_judge")
    assert len(server.posts) == 3


def test_transient_failures_are_retried_then_fail_clearly(server: ScriptedServer, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    server.push(Reply(503, {"error": "busy"}), Reply(200, response_document()))
    with _client(server, []) as client:
        assert client.chat("s", "u", purpose="external_judge").attempts == 2
    server.push(*[Reply(500, {"error": "boom"})] * 3)
    with _client(server, []) as client, pytest.raises(LLMUnavailableError, match="after 3 attempts"):
        client.chat("s", "u", purpose="external_judge")


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (response_document(None, status="incomplete", incomplete_details={"reason": "max_output_tokens"}),
         r"empty final content \(incomplete: .*max_output_tokens"),
        (response_document(None, extra_output=[{"type": "message", "content": [{"type": "refusal",
                                                                                  "refusal": "No."}]}]),
         "model refused: No."),
        (response_document("   "), "^empty final content$"),
        (response_document(status="failed", error={"code": "server_error"}), "response carries an error"),
    ],
)  # fmt: skip
def test_unusable_answers_are_output_errors(server: ScriptedServer, monkeypatch, document, message) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    server.push(Reply(200, document))
    records: list[CallRecord] = []
    with _client(server, records) as client, pytest.raises(LLMOutputError, match=message):
        client.chat("s", "u", purpose="external_judge", json_mode="json_object")
    assert records[0].status == "error"


def test_the_judge_config_chooses_the_api_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    common = {"name": "gpt", "provider": "openai-compatible", "model": "gpt-5.5", "base_url": "http://127.0.0.1:9/v1",
              "api_key_env": KEY_ENV, "reasoning_effort": "xhigh"}  # fmt: skip
    responses = open_external_judge(ExternalJudgeConfig(**common, api="responses", max_tokens=None))
    chat = open_external_judge(ExternalJudgeConfig(**common))
    try:
        assert isinstance(responses.client, ResponsesClient) and responses.sampling(42).max_tokens is None
        assert isinstance(chat.client, ReasoningEffortClient) and chat.sampling(42).max_tokens == 32768
    finally:
        responses.client.close()
        chat.client.close()
    with pytest.raises(ValueError, match="applies to openai-compatible judges only"):
        ExternalJudgeConfig(**{**common, "provider": "anthropic"}, api="responses")


@pytest.mark.parametrize("preset", ["paper", "cycle2"])
def test_the_reference_presets_call_gpt_5_5_like_the_reference(preset: str) -> None:
    config = load_config(preset, environ={})
    judges = {judge.name: judge for judge in config.evaluation.judges}
    gpt, claude = judges["gpt-5.5"], judges["claude-opus-4-8"]
    assert (gpt.api, gpt.reasoning_effort, gpt.max_tokens) == ("responses", "xhigh", None)
    assert (claude.provider, claude.reasoning_effort, claude.max_tokens) == ("anthropic", "max", 32768)
    assert config.judge.verdict_parsing == "strict"
    assert load_config("demo", environ={}).judge.verdict_parsing == "lenient"
