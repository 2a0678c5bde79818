"""Outcome classification exactly as MASS_SPEC §4, token totals from the proxy log, and the status record."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mass_ops.runtime.outcome import (
    INFRA_ERROR_MARKERS,
    PROXY_FAILURE_MESSAGE,
    StatusContext,
    Transcript,
    UsageTotals,
    classify,
    proxy_failures,
    status_record,
)


def _assistant(*blocks: dict[str, Any]) -> str:
    return json.dumps({"type": "assistant", "message": {"role": "assistant", "content": list(blocks)}})


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"call-{name}", "name": name, "input": arguments}


def _result(subtype: str = "success", is_error: bool = False, **extra: Any) -> str:
    return json.dumps({"type": "result", "subtype": subtype, "is_error": is_error, **extra})


def _transcript(*lines: str) -> Transcript:
    return Transcript.parse("\n".join(lines) + "\n")


def _ok_record(seq: int, prompt: int, completion: int, **extra: Any) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {
        "seq": seq,
        "path": "/v1/chat/completions",
        "status": 200,
        "response": {"usage": usage, "error": None},
        **extra,
    }


def test_success_needs_a_success_result_without_error() -> None:
    good = _transcript(_assistant(_text("Done.")), _result())
    verdict = classify(good, [_ok_record(1, 10, 2)], backend="vllm")
    assert verdict.status == "succeeded" and verdict.success and verdict.failure is None

    flagged = _transcript(_assistant(_text("Done.")), _result("success", is_error=True, result="half"))
    assert classify(flagged, [], backend="vllm").status == "model_failure"


@pytest.mark.parametrize("marker", INFRA_ERROR_MARKERS)
def test_api_error_text_with_an_infra_marker_is_an_infrastructure_failure(marker: str) -> None:
    text = f"[API Error: request failed: {marker} while streaming]"
    # qwen-code reports the failed request as text and still emits a *success* result.
    verdict = classify(_transcript(_assistant(_text(text)), _result()), [], backend="vllm")
    assert verdict.status == "infra_failure" and not verdict.success
    assert verdict.failure == {"subtype": "api_error_infra", "message": text}


def test_api_error_message_is_cut_to_300_chars() -> None:
    text = "[API Error: Connection error " + "x" * 600 + "]"
    verdict = classify(_transcript(_assistant(_text(text)), _result()), [], backend="vllm")
    assert verdict.failure is not None and verdict.failure["message"] == text[:300]


def test_other_api_errors_are_infra_only_on_openrouter() -> None:
    text = "[API Error: 400 context length exceeded]"
    transcript = _transcript(_assistant(_text(text)), _result())
    assert classify(transcript, [], backend="openrouter").status == "infra_failure"
    # Locally the trace decides (here a success result); the proxy rule would still catch a 400 in the log.
    assert classify(transcript, [], backend="vllm").status == "succeeded"


def test_only_the_last_assistant_text_counts() -> None:
    transcript = _transcript(
        _assistant(_text("[API Error: Connection error]")),
        _assistant(_text("Recovered and finished.")),
        _result(),
    )
    assert classify(transcript, [], backend="vllm").status == "succeeded"


def test_error_result_is_a_model_failure_with_subtype_message_and_last_five_tool_calls() -> None:
    calls = [_assistant(_tool("run_shell_command", command=f"step {i}", padding="p" * 300)) for i in range(7)]
    message = "Reached the maximum number of turns. " + "m" * 2000
    transcript = _transcript(*calls, _result("error_max_turns", is_error=True, error={"message": message}))
    verdict = classify(transcript, [_ok_record(1, 5, 5)], backend="vllm")

    assert verdict.status == "model_failure" and not verdict.success
    failure = verdict.failure
    assert failure is not None
    assert failure["subtype"] == "error_max_turns"
    assert failure["message"] == message[:1500]
    recent = failure["last_tool_calls_most_recent_first"]
    assert [c["name"] for c in recent] == ["run_shell_command"] * 5
    assert [c["args"][: len('{"command": "step 6"')] for c in recent] == [
        f'{{"command": "step {i}"' for i in (6, 5, 4, 3, 2)
    ]
    assert all(len(c["args"]) == 200 for c in recent)


def test_error_result_message_falls_back_to_the_result_text() -> None:
    transcript = _transcript(_result("error_during_execution", is_error=True, result="tool crashed"))
    failure = classify(transcript, [], backend="vllm").failure
    assert failure is not None and failure["message"] == "tool crashed"
    assert failure["last_tool_calls_most_recent_first"] == []


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"proxy_error": "ClientOSError", "status": 502, "response": None}, "proxy error"),
        ({"status": 503, "response": {"error": {"message": "overloaded"}}}, "HTTP 503 with error body"),
        ({"status": 429, "response": None}, "HTTP 429"),
        ({"status": 200, "response": {"usage": None, "error": {"message": "mid-stream error"}}}, "error chunk"),
        ({"status": 200, "proxy_error": "ClientPayloadError", "response": {"usage": None}}, "stream cut"),
    ],
)
def test_any_failed_proxy_record_overrides_a_successful_trace(record: dict[str, Any], why: str) -> None:
    records = [_ok_record(1, 10, 1), {"seq": 2, "path": "/v1/chat/completions", **record}, _ok_record(3, 12, 1)]
    verdict = classify(_transcript(_assistant(_text("Done.")), _result()), records, backend="vllm")
    assert verdict.status == "infra_failure", why
    assert verdict.failure is not None
    assert verdict.failure["subtype"] == "api_error_infra"
    assert verdict.failure["message"] == PROXY_FAILURE_MESSAGE
    assert [f["seq"] for f in verdict.failure["proxy_failures"]] == [2]
    assert [f["seq"] for f in verdict.proxy_failures] == [2]


def test_proxy_failure_turns_a_model_failure_into_an_infrastructure_failure() -> None:
    transcript = _transcript(_result("error_max_turns", is_error=True, error={"message": "gave up"}))
    records = [{"seq": 1, "path": "/v1/chat/completions", "status": 503, "response": None}]
    assert classify(transcript, records, backend="vllm").status == "infra_failure"


def test_api_error_text_keeps_its_message_when_the_proxy_log_also_failed() -> None:
    text = "[API Error: 503 Service Unavailable]"
    records = [{"seq": 4, "path": "/v1/chat/completions", "status": 503, "response": None}]
    failure = classify(_transcript(_assistant(_text(text)), _result()), records, backend="vllm").failure
    assert failure is not None and failure["message"] == text and failure["proxy_failures"][0]["status"] == 503


def test_no_result_event_is_a_model_failure_naming_why() -> None:
    transcript = _transcript(_assistant(_tool("write_file", file_path="/w/a.py", content="x")))
    killed = classify(transcript, [], backend="vllm", terminated_by="wall_clock", wall_clock_s=60)
    assert killed.status == "model_failure"
    assert killed.failure is not None and killed.failure["subtype"] == "wall_clock_limit"
    assert "60 s" in killed.failure["message"]
    assert killed.failure["last_tool_calls_most_recent_first"][0]["name"] == "write_file"
    crashed = classify(transcript, [], backend="vllm")
    assert crashed.failure is not None and crashed.failure["subtype"] == "no_result"


def test_transcript_tolerates_broken_lines_and_string_content() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # nested past the parser's stack
    text = f'{{"type": "assistant", "message": {{"content": "plain text"}}}}\nnot json\n[1, 2]\n{deep}\n{{"type": "res'
    transcript = Transcript.parse(text)
    assert transcript.bad_lines == 4
    assert transcript.last_assistant_text() == "plain text"


def test_usage_totals_count_every_chat_request_including_failed_ones() -> None:
    records = [
        _ok_record(1, 8000, 120),
        {"seq": 2, "path": "/v1/models", "status": 200, "response": None},
        _ok_record(3, 9100, 40),
        {"seq": 4, "path": "/v1/chat/completions", "status": 503, "response": {"error": {"message": "x"}}},
        _ok_record(5, 3000, 7),
    ]
    totals = UsageTotals.from_records(records)
    assert totals == UsageTotals(prompt_tokens=20100, completion_tokens=167, requests=4, max_prompt_tokens=9100)
    assert len(proxy_failures(records)) == 1


def test_status_record_has_every_reference_field_and_the_additions() -> None:
    started = datetime(2026, 1, 1, tzinfo=UTC)
    context = StatusContext(
        unit_key="c/reference-t51-s450051/a2",
        attempt=2,
        condition="t51_bare",
        seed=450051,
        model="m",
        endpoint="http://127.0.0.1:8001/v1",
        client_endpoint="http://127.0.0.1:40000/v1",
        qwen_code_version="0.21.10",
        exit_code=0,
        started_at=started,
        finished_at=started + timedelta(seconds=90),
        prompt_source="s3://b/p/prompt.txt",
        api_log="s3://b/p/api_requests.jsonl.gz",
        api_requests=3,
        env_policy="allow-listed",
        operational_limits={"http_response_timeout_ms": 1800000},
        durations={"agent_s": 88.123456, "total_s": 90.0},
    )
    verdict = classify(_transcript(_assistant(_text("ok")), _result()), [_ok_record(1, 100, 5)], backend="vllm")
    record = status_record(context, verdict, UsageTotals(100, 5, 1, 100))
    reference_fields = {
        "started_at",
        "finished_at",
        "model",
        "endpoint",
        "seed",
        "qwen_code_version",
        "exit_code",
        "trace_has_success_result",
        "failure",
        "execution_mode",
        "operational_limits",
        "hiw",
    }
    assert reference_fields <= set(record)
    assert record["hiw"] == {
        "condition": "t51_bare",
        "prompt_source": "s3://b/p/prompt.txt",
        "client_endpoint": "http://127.0.0.1:40000/v1",
        "api_log": "s3://b/p/api_requests.jsonl.gz",
        "api_requests": 3,
        "mass": True,
        "env_policy": "allow-listed",
    }
    assert record["execution_mode"] == "headless_host_visible_yolo"
    assert record["trace_has_success_result"] is True and record["status"] == "succeeded"
    assert record["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "requests": 1,
        "max_prompt_tokens": 100,
        "cached_prompt_tokens": 0,
    }
    assert record["durations"] == {"agent_s": 88.123, "total_s": 90.0}
    assert record["attempt"] == 2 and record["unit"] == "c/reference-t51-s450051/a2"
    json.dumps(record)  # a JSON document


def test_what_the_proxy_refused_on_purpose_is_not_an_api_failure() -> None:
    """A route, body or token the proxy refused is the agent's doing: it must not make the attempt an infrastructure
    failure (the agent could otherwise force retries), while a server's own 4xx/5xx still does."""
    refused = [
        {"seq": seq, "path": path, "status": status, "rejected": reason, "response": {"error": {"message": "no"}}}
        for seq, path, status, reason in (
            (1, "/admin", 403, "route_not_allowed"),
            (2, "/v1/chat/completions", 413, "body_too_large"),
            (3, "http://evil/", 400, "bad_request_target"),
            (4, "/v1/chat/completions", 401, "wrong_token"),
        )
    ]
    server_error = {"seq": 5, "path": "/v1/chat/completions", "status": 500, "response": {"error": {"message": "x"}}}
    assert proxy_failures(refused) == []
    assert [failure["seq"] for failure in proxy_failures([*refused, server_error])] == [5]
