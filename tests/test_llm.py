"""The chat client against a scripted OpenAI-compatible HTTP server on 127.0.0.1 (MASS_SPEC §3.3 LLM backend)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from mass_ops.llm import (
    CallRecord,
    ContextBudgetError,
    LLMClient,
    LLMConfigError,
    LLMEndpoint,
    LLMOutputError,
    LLMRequestError,
    LLMUnavailableError,
    RetryPolicy,
    SamplingParams,
    enforce_context_budget,
    estimate_input_tokens,
    extract_json_object,
    fenced_json_object,
    strict_json_object,
    whole_json_object,
)

SECRET = "sk-or-v1-test-secret-0123456789abcdef"
LM_STUDIO_400 = {"error": "'response_format.type' must be 'json_schema' or 'text'"}
QWEN_LOCAL = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=49152, seed=450051, enable_thinking=True)


@dataclass
class Reply:
    status: int
    body: Any
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


def _lower(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


class ScriptedServer:
    """Answers POSTs from a queue of scripted replies and GET /models from a model list; records every request."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Seen] = []
        self.model_ids = ["Qwen/Qwen3.6-27B-FP8"]
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, reply: Reply) -> None:
                time.sleep(reply.delay_s)
                payload = json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (timeout test)
                    pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                server.requests.append(Seen("POST", self.path, _lower(self.headers), json.loads(raw or b"null")))
                reply = server.replies.popleft() if server.replies else Reply(500, {"error": "script exhausted"})
                self._answer(reply)

            def do_GET(self) -> None:
                server.requests.append(Seen("GET", self.path, _lower(self.headers), None))
                data = [{"id": model_id, "object": "model"} for model_id in server.model_ids]
                self._answer(Reply(200, {"object": "list", "data": data}))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def url(self, prefix: str = "/v1") -> str:
        return f"http://127.0.0.1:{self.port}{prefix}"

    def push(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    @property
    def posts(self) -> list[Seen]:
        return [seen for seen in self.requests if seen.method == "POST"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(
    content: str | None,
    *,
    reasoning: str | None = None,
    reasoning_field: str = "reasoning_content",
    usage: dict[str, Any] | None = None,
    model: str = "Qwen/Qwen3.6-27B-FP8",
    finish: str = "stop",
    **extra: Any,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message[reasoning_field] = reasoning
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage or {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
        **extra,
    }


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


_OPEN_CLIENTS: list[LLMClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def records() -> list[CallRecord]:
    return []


def _client(
    endpoint: LLMEndpoint, records: list[CallRecord] | None = None, attempts: int = 3
) -> tuple[LLMClient, Sleeps]:
    sleeps = Sleeps()
    policy = RetryPolicy(max_attempts=attempts, initial_backoff_s=0.001, multiplier=2.0, max_backoff_s=1.0)
    recorder = records.append if records is not None else None
    client = LLMClient(endpoint, retry=policy, recorder=recorder, sleep=sleeps)
    _OPEN_CLIENTS.append(client)
    return client, sleeps


def _local(server: ScriptedServer, **kwargs: Any) -> LLMEndpoint:
    kwargs.setdefault("backend", "vllm")
    return LLMEndpoint(base_url=server.url(), model="Qwen/Qwen3.6-27B-FP8", **kwargs)


def _openrouter(server: ScriptedServer, **kwargs: Any) -> LLMEndpoint:
    return LLMEndpoint(
        base_url=server.url("/api/v1") + "/",
        model="openai/gpt-oss-120b:nitro",
        backend="openrouter",
        api_key_env="OPENROUTER_API_KEY",
        **kwargs,
    )


# --- request bodies per backend -----------------------------------------------------------------------------------


def test_local_json_call_sends_qwen_sampling_and_parses_the_object(
    server: ScriptedServer, records: list[CallRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    server.push(Reply(200, completion('{"winner": "B", "rationale": "better"}', reasoning="thinking...")))
    client, _ = _client(_local(server), records)
    result = client.chat("sys", "user", purpose="rank.judge", sampling=QWEN_LOCAL, json_mode="json_object")

    (seen,) = server.posts
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer EMPTY"
    assert seen.body["model"] == "Qwen/Qwen3.6-27B-FP8"
    assert seen.body["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "user"}]
    assert (seen.body["temperature"], seen.body["top_p"], seen.body["max_tokens"]) == (0.6, 0.95, 49152)
    assert seen.body["seed"] == 450051
    assert seen.body["top_k"] == 20
    assert seen.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert seen.body["response_format"] == {"type": "json_object"}
    assert "reasoning" not in seen.body

    assert result.parsed_json == {"winner": "B", "rationale": "better"}
    assert result.content == '{"winner": "B", "rationale": "better"}'
    assert result.reasoning_content == "thinking..."
    assert result.cost_usd == 0.0
    assert result.attempts == 1
    assert result.served_model == "Qwen/Qwen3.6-27B-FP8"
    assert result.usage["total_tokens"] == 19
    assert result.request["messages"][1]["content"] == "user"
    assert result.request["response_format_fallback"] is False

    (record,) = records
    assert (record.status, record.purpose, record.seed, record.attempts) == ("ok", "rank.judge", 450051, 1)
    assert record.response is not None and record.response["choices"][0]["message"]["content"] == result.content
    assert record.cost_usd == 0.0


def test_text_call_has_no_response_format_and_no_parsing(server: ScriptedServer) -> None:
    server.push(Reply(200, completion("plain words")))
    client, _ = _client(_local(server))
    result = client.chat("s", "u", purpose="probe", sampling=SamplingParams(max_tokens=10, enable_thinking=False))
    (seen,) = server.posts
    assert "response_format" not in seen.body
    assert seen.body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "top_k" not in seen.body and "seed" not in seen.body and "temperature" not in seen.body
    assert result.parsed_json is None and result.content == "plain words"


def test_json_schema_mode_sends_the_schema(server: ScriptedServer) -> None:
    schema = {"title": "PairwiseJudgeResult", "type": "object", "properties": {"winner": {"type": "string"}}}
    server.push(Reply(200, completion('{"winner": "tie"}')))
    client, _ = _client(_local(server, backend="openai-compatible"))
    result = client.chat("s", "u", purpose="judge", json_mode="json_schema", schema=schema)
    assert server.posts[0].body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "PairwiseJudgeResult", "schema": schema, "strict": True},
    }
    assert result.parsed_json == {"winner": "tie"}
    assert result.cost_usd is None  # openai-compatible servers without a reported cost: unknown, not free
    with pytest.raises(LLMConfigError, match="needs a non-empty schema"):
        client.chat("s", "u", purpose="judge", json_mode="json_schema")
    assert len(server.posts) == 1


def test_openrouter_sends_reasoning_effort_only_and_keeps_cost_and_provider(
    server: ScriptedServer, records: list[CallRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120, "cost": 0.012}
    server.push(
        Reply(
            200,
            completion(
                '{"ok": true}',
                reasoning="r",
                reasoning_field="reasoning",
                usage=usage,
                model="openai/gpt-oss-120b",
                provider="Groq",
            ),
        )
    )
    client, _ = _client(_openrouter(server), records)
    sampling = SamplingParams(max_tokens=8192, seed=7, top_k=20, enable_thinking=True, reasoning_effort="medium")
    result = client.chat("s", "u", purpose="search.optimizer", sampling=sampling, json_mode="json_object")

    (seen,) = server.posts
    assert seen.path == "/api/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {SECRET}"
    assert seen.body["model"] == "openai/gpt-oss-120b:nitro"
    assert seen.body["reasoning"] == {"effort": "medium"}
    assert "top_k" not in seen.body and "chat_template_kwargs" not in seen.body
    assert seen.body["response_format"] == {"type": "json_object"}
    assert result.cost_usd == 0.012
    assert result.provider == "Groq"
    assert result.served_model == "openai/gpt-oss-120b"
    assert result.reasoning_content == "r"
    assert records[0].cost_usd == 0.012

    # The key travels only in the Authorization header: never in results, records or representations.
    for text in (repr(result), repr(records[0]), json.dumps(asdict(records[0])), repr(client), repr(client.endpoint)):
        assert SECRET not in text
    assert SECRET not in json.dumps(result.request)


def test_openrouter_without_reported_cost_records_none(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    server.push(Reply(200, completion("hi")))
    client, _ = _client(_openrouter(server))
    assert client.chat("s", "u", purpose="p").cost_usd is None


def test_openrouter_needs_a_key_and_sends_nothing_without_it(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    client, _ = _client(_openrouter(server))
    with pytest.raises(LLMConfigError, match="OPENROUTER_API_KEY is empty or unset"):
        client.chat("s", "u", purpose="p")
    monkeypatch.setenv("OPENROUTER_API_KEY", "two words")
    with pytest.raises(LLMConfigError, match="contains whitespace") as caught:
        client.chat("s", "u", purpose="p")
    assert "two words" not in str(caught.value)
    assert server.requests == []


# --- LM Studio fallback and non-retryable errors -------------------------------------------------------------------


def test_lm_studio_rejection_falls_back_once_without_response_format(
    server: ScriptedServer, records: list[CallRecord]
) -> None:
    server.push(Reply(400, LM_STUDIO_400), Reply(200, completion('Sure: {"a": 1}')))
    client, sleeps = _client(_local(server, backend="openai-compatible"), records)
    result = client.chat("s", "u", purpose="judge", sampling=QWEN_LOCAL, json_mode="json_object")
    first, second = server.posts
    assert first.body["response_format"] == {"type": "json_object"}
    assert "response_format" not in second.body
    assert first.body["messages"] == second.body["messages"]
    assert {k: v for k, v in first.body.items() if k != "response_format"} == second.body
    assert result.parsed_json == {"a": 1}
    assert result.attempts == 2
    assert result.request["response_format_fallback"] is True
    assert "response_format" not in result.request
    assert sleeps == []
    assert [r.status for r in records] == ["ok"]


def test_fallback_is_bounded_and_a_list_answer_is_still_rejected(server: ScriptedServer) -> None:
    server.push(Reply(400, LM_STUDIO_400), Reply(400, LM_STUDIO_400))
    client, _ = _client(_local(server))
    with pytest.raises(LLMRequestError, match="HTTP 400") as caught:
        client.chat("s", "u", purpose="judge", json_mode="json_object")
    assert caught.value.status_code == 400
    assert len(server.posts) == 2

    server.push(Reply(400, LM_STUDIO_400), Reply(200, completion("[1, 2]")))
    with pytest.raises(LLMOutputError, match="must be a JSON object, got list"):
        client.chat("s", "u", purpose="judge", json_mode="json_object")
    assert len(server.posts) == 4


@pytest.mark.parametrize(
    ("backend", "json_mode", "body"),
    [
        ("vllm", "json_object", {"error": {"message": "This model's maximum context length is 4096 tokens"}}),
        ("vllm", None, LM_STUDIO_400),  # text calls never fall back
        ("openrouter", "json_object", LM_STUDIO_400),  # remote calls never fall back
    ],
)
def test_other_400s_are_neither_retried_nor_fallen_back(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch, backend: str, json_mode: str | None, body: Any
) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    server.push(Reply(400, body), Reply(200, completion("{}")))
    endpoint = _openrouter(server) if backend == "openrouter" else _local(server)
    client, sleeps = _client(endpoint)
    with pytest.raises(LLMRequestError, match="HTTP 400"):
        client.chat("s", "u", purpose="judge", json_mode=json_mode)  # type: ignore[arg-type]
    assert len(server.posts) == 1
    assert sleeps == []


@pytest.mark.parametrize("status", [401, 402, 404, 422, 429])
def test_4xx_is_never_retried(server: ScriptedServer, records: list[CallRecord], status: int) -> None:
    server.push(Reply(status, {"error": {"message": f"status {status}"}}), Reply(200, completion("{}")))
    client, sleeps = _client(_local(server), records)
    with pytest.raises(LLMRequestError) as caught:
        client.chat("s", "u", purpose="judge")
    assert caught.value.status_code == status
    assert len(server.posts) == 1 and sleeps == []
    (record,) = records
    assert record.status == "error" and record.attempts == 1 and f"HTTP {status}" in (record.error or "")


def test_redirects_are_not_followed(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    server.push(Reply(307, {}, headers={"Location": "http://127.0.0.1:9/elsewhere"}))
    client, _ = _client(_openrouter(server))
    with pytest.raises(LLMRequestError) as caught:
        client.chat("s", "u", purpose="p")
    assert caught.value.status_code == 307
    assert len(server.posts) == 1


# --- transient failures -------------------------------------------------------------------------------------------


def test_5xx_is_retried_with_exponential_backoff_then_succeeds(
    server: ScriptedServer, records: list[CallRecord]
) -> None:
    server.push(Reply(503, {"error": "busy"}), Reply(502, {"error": "gateway"}), Reply(200, completion("done")))
    client, sleeps = _client(_local(server), records, attempts=4)
    result = client.chat("s", "u", purpose="judge", sampling=QWEN_LOCAL)
    assert result.content == "done" and result.attempts == 3
    assert len(server.posts) == 3
    assert all(seen.body == server.posts[0].body for seen in server.posts)  # same request, same seed
    assert sleeps == [0.001, 0.002]
    assert records[0].attempts == 3


def test_persistent_5xx_fails_clearly_after_the_allowed_attempts(
    server: ScriptedServer, records: list[CallRecord]
) -> None:
    server.push(*[Reply(500, {"error": "boom"})] * 5)
    client, sleeps = _client(_local(server), records, attempts=3)
    with pytest.raises(LLMUnavailableError, match=r"judge failed after 3 attempts at http://127\.0\.0\.1") as caught:
        client.chat("s", "u", purpose="judge")
    assert caught.value.attempts == 3
    assert len(server.posts) == 3 and len(sleeps) == 2
    assert records[0].status == "error" and "HTTP 500" in (records[0].error or "")


def test_connection_refused_is_retried_then_fails_clearly(records: list[CallRecord]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before use: nothing listens there
    endpoint = LLMEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m", connect_timeout_s=2.0)
    client, sleeps = _client(endpoint, records, attempts=3)
    with pytest.raises(LLMUnavailableError, match=rf"failed after 3 attempts at http://127\.0\.0\.1:{port}/v1"):
        client.chat("s", "u", purpose="judge")
    assert len(sleeps) == 2
    assert records[0].attempts == 3 and records[0].response is None


def test_timeouts_are_retried(server: ScriptedServer) -> None:
    server.push(Reply(200, completion("late"), delay_s=1.5), Reply(200, completion("on time")))
    client, sleeps = _client(_local(server, request_timeout_s=0.3))
    result = client.chat("s", "u", purpose="judge")
    assert result.content == "on time" and result.attempts == 2
    assert len(sleeps) == 1


# --- context guard ------------------------------------------------------------------------------------------------


def test_context_guard_fires_before_any_request(server: ScriptedServer, records: list[CallRecord]) -> None:
    server.push(Reply(200, completion("{}")))
    client, _ = _client(_local(server, context_window_tokens=1000, context_safety_tokens=100), records)
    sampling = SamplingParams(max_tokens=800)
    with pytest.raises(
        ContextBudgetError,
        match=r"context guard failed for rank\.judge: estimated input 500 \+ max output 800 = 1300 tokens exceeds "
        r"context window 1000 - safety 100 = 900",
    ):
        client.chat("x" * 1000, "y" * 1000, purpose="rank.judge", sampling=sampling)
    with pytest.raises(ContextBudgetError, match="max_tokens must be set"):
        client.chat("s", "u", purpose="rank.judge")
    assert server.requests == [] and records == []
    # Just inside the budget: the call goes out.
    result = client.chat("x" * 200, "y" * 196, purpose="rank.judge", sampling=sampling, json_mode="json_object")
    assert result.parsed_json == {} and len(server.posts) == 1


def test_context_budget_arithmetic() -> None:
    assert estimate_input_tokens("", "") == 1
    assert estimate_input_tokens("abc", "d") == 1
    assert estimate_input_tokens("abcd", "e") == 2
    assert enforce_context_budget("a" * 400, "", 49152, 262144, 8192, "search.optimizer") == 100
    limit_input = (262144 - 8192 - 49152) * 4
    enforce_context_budget("a" * limit_input, "", 49152, 262144, 8192, "judge")
    with pytest.raises(ContextBudgetError, match="judge"):
        enforce_context_budget("a" * (limit_input + 1), "", 49152, 262144, 8192, "judge")


# --- output validation --------------------------------------------------------------------------------------------


def _refusal_completion(content: str, refusal: str) -> dict[str, Any]:
    body = completion(content)
    body["choices"][0]["message"]["refusal"] = refusal
    return body


def test_reasoning_only_answers_fail_with_the_ceiling_message(
    server: ScriptedServer, records: list[CallRecord]
) -> None:
    server.push(
        Reply(200, completion(None, reasoning="long thoughts", finish="length")),
        Reply(200, completion("   ")),
        Reply(200, _refusal_completion("x", "I cannot help with that")),
        Reply(200, {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": []}),
    )
    client, _ = _client(_local(server), records)
    with pytest.raises(LLMOutputError, match="output ceiling consumed by reasoning"):
        client.chat("s", "u", purpose="judge", json_mode="json_object")
    with pytest.raises(LLMOutputError, match=r"^empty final content$"):
        client.chat("s", "u", purpose="judge")
    with pytest.raises(LLMOutputError, match="model refused"):
        client.chat("s", "u", purpose="judge")
    with pytest.raises(LLMOutputError, match="no choices"):
        client.chat("s", "u", purpose="judge")
    assert [r.status for r in records] == ["error"] * 4
    assert records[0].response is not None and records[0].usage is not None
    assert len(server.posts) == 4  # output problems are not retried


def test_a_body_that_is_not_a_completion_object_is_an_output_error_on_record(
    server: ScriptedServer, records: list[CallRecord]
) -> None:
    server.push(Reply(200, ["not", "a", "completion"]), Reply(200, completion('{"ok": true}', extra_field=[1, 2])))
    client, _ = _client(_local(server), records)
    with pytest.raises(LLMOutputError, match="must be a JSON object, got list"):
        client.chat("s", "u", purpose="judge", json_mode="json_object")
    assert (records[0].status, records[0].response, records[0].attempts) == ("error", None, 1)
    # The recorded response is the server's document as sent, fields the SDK's models do not know included.
    result = client.chat("s", "u", purpose="judge", json_mode="json_object")
    assert result.parsed_json == {"ok": True}
    assert records[1].response is not None and records[1].response["extra_field"] == [1, 2]
    assert len(server.posts) == 2  # neither answer is retried


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"winner": "A", "rationale": "r"}', {"winner": "A", "rationale": "r"}),
        (
            'Verdict follows.\n{"winner": "B", "nested": {"x": [1, 2]}}\nThanks.',
            {"winner": "B", "nested": {"x": [1, 2]}},
        ),
        ('Notes {not json}\n```json\n{"winner": "tie"}\n```\n', {"winner": "tie"}),
        ('```\n{"a": 1}\n```', {"a": 1}),
    ],
)
def test_extract_json_object_accepts(text: str, expected: dict[str, Any]) -> None:
    assert extract_json_object(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "^empty final content$"),
        ("  \n", "^empty final content$"),
        (None, "^empty final content$"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"just a string"', "must be a JSON object, got str"),
        ("no json here", "contains no JSON object"),
        ("{broken: json}", "contains no JSON object"),
        # a degenerate answer nested past the parser's stack: an unusable answer, not a crash
        ('{"winner": ' + "[" * 100_000 + "]" * 100_000 + "}", "contains no JSON object"),
    ],
)
def test_extract_json_object_rejects(text: str | None, message: str) -> None:
    with pytest.raises(LLMOutputError, match=message):
        extract_json_object(text)


FENCE_IN_STRING = {"a": 1, "t": '```json {"b": 2} ```'}
STRICT_READINGS = [
    # (answer, chat route, Responses route, Anthropic route); None: no JSON object is read
    ('  {"a": 1}\n', {"a": 1}, {"a": 1}, {"a": 1}),
    ('Sure: {"a": 1} done', {"a": 1}, None, {"a": 1}),
    # The whole text first on chat; the first fence first on Anthropic, where the fence's escaped object is not JSON
    # and nothing else is tried.
    ('{"a": 1, "t": "```json {\\"b\\": 2} ```"}', FENCE_IN_STRING, FENCE_IN_STRING, None),
    # Only the first fenced block is ever tried; the lenient reading also tries the second.
    ('```json\n{"a": x}\n```\nthen\n```json\n{"b": 2}\n```', None, None, None),
    # A one-line fence (the lenient reading wants a newline after the tag) behind a stray closing brace.
    ('Here ```json {"a": 1} ``` }', {"a": 1}, None, {"a": 1}),
    # The fence tag is case-sensitive: "JSON" is no tag, so the block does not start with an object.
    ('```JSON\n{"a": 1}\n``` }', None, None, None),
    # A document that parses but is not an object has no fallback.
    ('[{"a": 1}]', None, None, {"a": 1}),
    # A lone surrogate escape: fine for the chat route's json.loads, refused by the JSON-mode routes.
    ('{"a": "\\ud800"}', {"a": "\ud800"}, None, None),
    ("", None, None, None),
]


@pytest.mark.parametrize(("text", "chat", "responses", "anthropic"), STRICT_READINGS)
def test_strict_json_readings_follow_the_reference_per_route(text: str, chat: Any, responses: Any, anthropic: Any):
    readers = ((strict_json_object, chat), (whole_json_object, responses), (fenced_json_object, anthropic))
    for reader, expected in readers:
        if expected is None:
            with pytest.raises(LLMOutputError):
                reader(text)
        else:
            assert reader(text) == expected, reader.__name__
    assert extract_json_object('```json\n{"a": x}\n```\nthen\n```json\n{"b": 2}\n```') == {"b": 2}


def test_a_strict_chat_call_reads_the_answer_as_the_reference(server: ScriptedServer) -> None:
    answer = '```json\n{"winner": A}\n```\nFinal:\n```json\n{"winner": "B", "rationale": "r"}\n```'
    server.push(Reply(200, completion(answer)), Reply(200, completion(answer)))
    client, _ = _client(_local(server))
    lenient = client.chat("s", "u", purpose="judge", json_mode="json_object")
    assert lenient.parsed_json == {"winner": "B", "rationale": "r"}
    with pytest.raises(LLMOutputError, match="contains no JSON object"):
        client.chat("s", "u", purpose="judge", json_mode="json_object", json_parsing="strict")
    with pytest.raises(LLMConfigError, match="json_parsing must be one of"):
        client.chat("s", "u", purpose="judge", json_mode="json_object", json_parsing="loose")  # type: ignore[arg-type]
    assert len(server.posts) == 2


# --- model discovery ----------------------------------------------------------------------------------------------


def test_verify_model_lists_models_and_strips_nitro(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    server.model_ids = ["openai/gpt-oss-120b", "other/model"]
    client, _ = _client(_openrouter(server))
    assert client.verify_model() == ["openai/gpt-oss-120b", "other/model"]
    (seen,) = server.requests
    assert (seen.method, seen.path) == ("GET", "/api/v1/models")
    assert seen.headers["authorization"] == f"Bearer {SECRET}"

    local, _ = _client(_local(server))
    with pytest.raises(LLMConfigError, match=r"model 'Qwen/Qwen3\.6-27B-FP8' is not served at .*listed: openai/"):
        local.verify_model()


# --- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_url": "ftp://host/v1"}, "http"),
        ({"base_url": "http://user:pw@127.0.0.1:8001/v1"}, "credentials"),
        ({"base_url": "http://127.0.0.1:8001/v1?key=abc"}, "query"),
        ({"api_key_env": SECRET}, "environment variable name"),
        ({"backend": "openai-responses"}, "backend"),
        ({"model": " "}, "model"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"context_window_tokens": True}, "context_window_tokens"),
        ({"context_safety_tokens": -1}, "context_safety_tokens"),
    ],
)
def test_bad_endpoints_are_refused(kwargs: dict[str, Any], message: str) -> None:
    base = {"base_url": "http://127.0.0.1:8001/v1", "model": "m"}
    with pytest.raises(LLMConfigError, match=message) as caught:
        LLMEndpoint(**{**base, **kwargs})
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"reasoning_effort": "xhigh"}, "reasoning_effort"),
        ({"enable_thinking": "yes"}, "enable_thinking"),
    ],
)
def test_bad_sampling_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LLMConfigError, match=message):
        SamplingParams(**kwargs)


def test_endpoint_normalises_the_url_and_reads_the_key_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = LLMEndpoint(
        base_url="https://openrouter.ai/api/v1/",
        model="a/b:nitro",
        backend="openrouter",
        api_key_env="OPENROUTER_API_KEY",
    )
    assert endpoint.base_url == "https://openrouter.ai/api/v1"
    assert endpoint.listed_model_id == "a/b"
    monkeypatch.setenv("OPENROUTER_API_KEY", "first")
    assert endpoint.read_api_key() == "first"
    monkeypatch.setenv("OPENROUTER_API_KEY", "second")
    assert endpoint.read_api_key() == "second"
    assert "second" not in repr(endpoint)
    assert LLMEndpoint(base_url="http://localhost:8001/v1", model="a/b:nitro").listed_model_id == "a/b:nitro"


def test_vllm_sampling_extensions_go_to_vllm_only() -> None:
    sampling = SamplingParams(temperature=0.6, top_k=20, repetition_penalty=1.0, enable_thinking=True, priority=3)
    vllm = LLMClient(LLMEndpoint("http://127.0.0.1:1/v1", "m", backend="vllm")).build_request("s", "u", sampling)
    plain = LLMClient(LLMEndpoint("http://127.0.0.1:1/v1", "m", backend="openai-compatible")).build_request(
        "s", "u", sampling
    )
    assert vllm["extra_body"]["top_k"] == 20 and vllm["extra_body"]["repetition_penalty"] == 1.0
    assert vllm["extra_body"]["priority"] == 3
    # transformers serve answers 422 to these fields.
    assert not {"top_k", "repetition_penalty", "priority"} & set(plain["extra_body"])
    assert plain["extra_body"]["chat_template_kwargs"] == {"enable_thinking": True}
