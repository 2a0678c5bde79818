"""Reading proxy logs: formats, the records rendering keeps, and replies as replayable messages."""

from __future__ import annotations

import gzip

import pytest

from mass_ops.render import RenderError, iter_proxy_records
from mass_ops.render.proxy_log import exchanges, is_chat_completion, replay_message
from tests.render.proxy_logs import WORKER_SYSTEM, Agent, Call, ProxyLog, Reply, completion, reassembled, sse_text


def small_log() -> ProxyLog:
    log = ProxyLog()
    agent = Agent(log, WORKER_SYSTEM, "Task.", None)
    agent.turn(Reply(reasoning="think", calls=[Call("c1", "run_shell_command", {"command": "ls"})]))
    agent.results(("c1", "a.txt"))
    agent.turn(Reply(content="done"), stream=False)
    return log


def test_plain_gzip_path_lines_and_records_read_the_same(tmp_path):
    log = small_log()
    plain = ("\n".join(log.lines()) + "\n\n").encode()
    path = tmp_path / "api_requests.jsonl.gz"
    path.write_bytes(log.gz())
    sources = [plain, log.gz(), path, str(path), log.lines(), log.records]
    read = [list(iter_proxy_records(source)) for source in sources]
    assert all(records == read[0] for records in read)
    assert [r["seq"] for r in read[0]] == [1, 2]


def test_only_successful_chat_completions_are_kept():
    log = small_log()
    models = {"path": "/v1/models", "seq": 10, "status": 200, "response": {"data": []}}
    failed = {**log.records[0], "seq": 11, "status": 502, "proxy_error": "ClientConnectorError"}
    empty = {**log.records[0], "seq": 12, "response": {"choices": []}}
    query = {**log.records[0], "seq": 13, "path": "/v1/chat/completions?x=1"}
    records = [*log.records, models, failed, empty, query]
    assert [is_chat_completion(r) for r in records] == [True, True, False, False, False, True]
    assert [e.seq for e in exchanges(records)] == [1, 2, 13]


def test_bad_lines_name_the_log_and_the_line():
    lines = [*small_log().lines(), '{"path": "/v1/chat', "[1, 2]"]
    with pytest.raises(RenderError, match=r"^episode e7: line 3: not JSON \("):
        list(iter_proxy_records(lines, where="episode e7"))
    with pytest.raises(RenderError, match=r"line 1 is a JSON list"):
        list(iter_proxy_records(b"[1, 2]\n", where="episode e7"))
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"  # past the parser's stack: one clear line, not a RecursionError
    with pytest.raises(RenderError, match=r"^episode e7: line 1: JSON nested deeper than the parser's stack$"):
        list(iter_proxy_records(deep, where="episode e7"))
    with pytest.raises(RenderError, match="unreadable compressed log"):
        list(iter_proxy_records(gzip.compress(b'{"a": 1}\n')[:-12], where="episode e7"))


def test_records_without_seq_or_request_are_refused():
    record = small_log().records[0]
    with pytest.raises(RenderError, match="no integer seq"):
        exchanges([{**record, "seq": None}], where="episode e")
    with pytest.raises(RenderError, match="seq=1 has no parsed request"):
        exchanges([{**record, "request": None, "request_raw": "{broken"}], where="episode e")


def test_streamed_and_plain_replies_replay_identically():
    reply = Reply(reasoning="plan", content=None, calls=[Call("c9", "write_file", {"file_path": "/a", "content": "é"})])
    streamed = replay_message(reassembled(reply)["choices"][0]["message"])
    plain = replay_message(completion(reply)["choices"][0]["message"])
    assert (
        streamed
        == plain
        == {
            "role": "assistant",
            "content": "",
            "reasoning_content": "plan",
            "tool_calls": [
                {
                    "id": "c9",
                    "type": "function",
                    "function": {"name": "write_file", "arguments": '{"file_path": "/a", "content": "é"}'},
                }
            ],
        }
    )


def test_reply_reasoning_falls_back_to_the_reasoning_field_and_arguments_become_text():
    message = {"content": "ok", "reasoning": "newer vLLM field",
               "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {"a": 1}}}]}  # fmt: skip
    replay = replay_message(message)
    assert replay["reasoning_content"] == "newer vLLM field"
    assert replay["tool_calls"][0] == {
        "id": "x",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    assert "reasoning_content" not in replay_message({"content": "plain"})


def test_the_proxys_own_reassembly_of_split_tool_call_fragments_replays_the_same():
    from mass_ops.runtime.sse import SSEAssembler

    reply = Reply(
        reasoning="check the files",
        content="Looking.",
        calls=[
            Call("c1", "run_shell_command", {"command": "ls -la /work/ws"}),
            Call("c2", "read_file", {"file_path": "/a"}),
        ],
    )
    assembler = SSEAssembler()
    raw = sse_text(reply).encode()
    for start in range(0, len(raw), 37):  # network reads cut anywhere
        assembler.feed(raw[start : start + 37])
    assembled = assembler.result()
    assert assembled["object"] == "chat.completion.reassembled"
    record = {
        "path": "/v1/chat/completions",
        "seq": 1,
        "status": 200,
        "request": {"messages": []},
        "response": assembled,
    }
    (exchange,) = exchanges([record])
    assert exchange.reply == replay_message(reassembled(reply)["choices"][0]["message"])
    assert exchange.reply["tool_calls"][0]["function"]["arguments"] == '{"command": "ls -la /work/ws"}'
    assert exchange.finish_reason == "tool_calls"


def test_a_log_line_over_its_cap_is_refused_without_reading_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracemalloc

    import mass_ops.render.proxy_log as proxy_log

    monkeypatch.setattr(proxy_log, "LOG_LINE_MAX_BYTES", 1 << 20)
    chunk = gzip.compress(b" " * (1 << 20), mtime=0)  # gzip members concatenate: 64 MiB of one line, ~64 KB here
    flood = gzip.compress(b'{"a": 1}\n{"pad": "', mtime=0) + chunk * 64
    tracemalloc.start()
    try:
        with pytest.raises(RenderError, match=r"^episode e7: line 2 is over the 1,048,576-byte limit$"):
            list(iter_proxy_records(flood, where="episode e7"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak:,} bytes"  # the capped line, not the 64 MiB one
