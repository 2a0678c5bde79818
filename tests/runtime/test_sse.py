"""SSE reassembly: fragments, reasoning, usage, errors, bad chunks, and byte-split incremental feeding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mass_ops.runtime.sse import REASSEMBLED_OBJECT, SSEAssembler, assemble_sse


def _event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish}], **extra}


def _tool_call_stream() -> str:
    """Two tool calls whose argument JSON arrives in interleaved fragments, as vLLM streams parallel calls."""
    events = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "Plan: write "}),
        _chunk({"reasoning": "then run."}),
        _chunk({"content": "Working on it"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "write_file"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"file_path": "/w/r'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "run_shell"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'eport.md", "content": "é 😀'}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"command": "ls"}'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}),
        _chunk({}, finish="tool_calls"),
        {**_chunk({}), "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}},
    ]
    return "".join(_event(e) for e in events) + _event("[DONE]")


def test_tool_call_fragments_are_joined_by_index() -> None:
    result = assemble_sse(_tool_call_stream())
    assert result["object"] == REASSEMBLED_OBJECT
    assert (result["id"], result["model"], result["created"]) == ("chatcmpl-1", "m", 1700000000)
    (choice,) = result["choices"]
    calls = choice["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_a", "call_b"]
    assert [c["function"]["name"] for c in calls] == ["write_file", "run_shell"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"file_path": "/w/report.md", "content": "é 😀"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"command": "ls"}
    assert choice["finish_reason"] == "tool_calls"
    assert result["done"] is True and result["n_chunks"] == 12 and result["n_bad_chunks"] == 0


def test_reasoning_joined_from_both_field_names_and_details_kept() -> None:
    stream = (
        _event(_chunk({"role": "assistant", "reasoning": "a", "reasoning_details": [{"type": "reasoning.text"}]}))
        + _event(_chunk({"reasoning_content": "b", "reasoning_details": [{"type": "reasoning.summary"}]}))
        + _event(_chunk({"content": "answer"}, finish="stop"))
    )
    message = assemble_sse(stream)["choices"][0]["message"]
    assert message["reasoning_content"] == "ab"
    assert message["reasoning_details"] == [{"type": "reasoning.text"}, {"type": "reasoning.summary"}]
    assert message["content"] == "answer" and message["tool_calls"] is None


def test_absent_fields_are_none_not_empty_strings() -> None:
    message = assemble_sse(_event(_chunk({"role": "assistant"}, finish="stop")))["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "reasoning_details": None,
        "tool_calls": None,
    }


def test_usage_is_taken_from_the_last_chunk_carrying_it() -> None:
    stream = (
        _event({**_chunk({"content": "x"}), "usage": {"total_tokens": 1}})
        + _event({**_chunk({"content": "y"}), "usage": {"total_tokens": 2}})
        + _event({**_chunk({}, finish="stop"), "usage": None})
    )
    result = assemble_sse(stream)
    assert result["usage"] == {"total_tokens": 2}
    assert result["choices"][0]["message"]["content"] == "xy"


def test_error_chunk_bad_chunk_comments_and_missing_done() -> None:
    stream = (
        ": keep-alive\n\n"
        + _event(_chunk({"content": "partial"}))
        + "data: {not json\n\n"
        + _event("[1, 2]")
        + "event: error\n"
        + _event({"error": {"message": "upstream overloaded", "code": 503}})
        + _event({"error": {"message": "second error"}})
    )
    result = assemble_sse(stream)
    assert result["error"] == {"message": "upstream overloaded", "code": 503}
    assert result["n_bad_chunks"] == 2 and result["n_chunks"] == 3
    assert result["done"] is False
    assert result["choices"][0]["message"]["content"] == "partial"


def test_a_chunk_nested_past_the_parser_s_depth_is_a_bad_chunk_not_a_crash() -> None:
    depth = 100_000
    stream = _event(_chunk({"content": "kept"})) + "data: " + "[" * depth + "]" * depth + "\n\ndata: [DONE]\n\n"
    result = assemble_sse(stream)
    assert result["n_bad_chunks"] == 1 and result["n_chunks"] == 1 and result["done"] is True
    assert result["choices"][0]["message"]["content"] == "kept"


def test_stop_reason_and_several_choices() -> None:
    stream = (
        _event(_chunk({"content": "first"}, index=0))
        + _event(_chunk({"content": "second"}, index=1))
        + _event(
            {**_chunk({}, finish="stop", index=1), "choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]}
        )
        + _event(
            {**_chunk({}), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "</end>"}]}
        )
    )
    choices = assemble_sse(stream)["choices"]
    assert [c["message"]["content"] for c in choices] == ["first", "second"]
    assert choices[0]["stop_reason"] == "</end>" and choices[1]["stop_reason"] is None


def test_multiline_data_and_trailing_event_without_blank_line() -> None:
    payload = json.dumps(_chunk({"content": "multi"}), indent=1)  # spans several lines
    stream = (
        "".join(f"data: {line}\n" for line in payload.splitlines())
        + "\n"
        + f"data: {json.dumps(_chunk({'content': '!'}))}"
    )
    result = assemble_sse(stream)
    assert result["choices"][0]["message"]["content"] == "multi!"
    assert result["n_chunks"] == 2


def test_incremental_feed_in_any_split_matches_whole_text() -> None:
    raw = _tool_call_stream().replace("\n", "\r\n").encode("utf-8")
    whole = assemble_sse(raw)
    for size in (1, 2, 3, 7, 64):
        assembler = SSEAssembler()
        for start in range(0, len(raw), size):
            assembler.feed(raw[start : start + size])
            assembler.parse_pending()  # progressive parsing must not change the outcome
        assert assembler.result() == whole, f"split size {size}"
        assert bytes(assembler.raw) == raw
    assert json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["content"] == "é 😀"


def test_progressive_state_and_no_feed_after_result() -> None:
    assembler = SSEAssembler()
    assembler.feed(_event(_chunk({"content": "a"})).encode() + b'data: {"choices": [{"index": 0, "delta": {"cont')
    assembler.parse_pending()
    assert assembler.n_chunks == 1 and assembler.n_bad_chunks == 0  # the partial line is not parsed yet
    assembler.feed(b'ent": "b"}}]}\n\n')
    result = assembler.result()
    assert result["choices"][0]["message"]["content"] == "ab" and result["n_chunks"] == 2
    assert assembler.result() is result
    with pytest.raises(RuntimeError, match="after result"):
        assembler.feed(b"data: [DONE]\n\n")


def test_fed_bytes_are_kept_by_reference_and_joined_once_when_read() -> None:
    assembler = SSEAssembler()
    reused = bytearray(b'data: {"id": "a", "choices": []}\n\n')
    assembler.feed(reused)
    reused[:] = b"overwritten by the next network read!"  # a caller's buffer may be reused: the stream is unchanged
    assembler.feed(b"data: [DONE]\n\n")
    expected = b'data: {"id": "a", "choices": []}\n\ndata: [DONE]\n\n'
    assert b"".join(assembler.pieces()) == expected and assembler.size == len(expected)
    assert bytes(assembler.raw) == expected and assembler.pieces() == [expected]
    assert assembler.result()["id"] == "a" and assembler.result()["done"] is True
