"""Threads keyed by system + first user message, cut into conversations at prefix breaks."""

from __future__ import annotations

import hashlib
import json

from mass_ops.render.proxy_log import exchanges
from mass_ops.render.threads import conversations, extends, thread_key
from tests.render.proxy_logs import WORKER_SYSTEM, WORKER_TOOLS, Agent, Call, ProxyLog, Reply


def test_thread_key_is_md5_of_system_nul_and_json_first_user():
    parts = [{"type": "text", "text": "reminder"}, {"type": "text", "text": "Do the task."}]
    messages = [{"role": "system", "content": "You are X."}, {"role": "user", "content": parts}]
    expected = hashlib.md5(("You are X." + "\0" + json.dumps(parts)).encode()).hexdigest()[:10]
    assert thread_key(messages) == expected
    assert thread_key([*messages, {"role": "assistant", "content": "ok"}]) == expected
    assert thread_key([{"role": "user", "content": "x"}]) != thread_key([{"role": "user", "content": "y"}])


def test_extends_ignores_key_order_but_not_values():
    a = [{"role": "user", "content": "hi"}]
    assert extends(a, [{"content": "hi", "role": "user"}, {"role": "assistant", "content": ""}])
    assert extends(a, a)
    assert not extends(a, [{"role": "user", "content": "hi!"}])
    assert not extends([*a, {"role": "assistant", "content": ""}], a)


def two_workers() -> ProxyLog:
    """Two workers with the same system prompt but different tasks, interleaved in time."""
    log = ProxyLog()
    first = Agent(log, WORKER_SYSTEM, "Task one.", WORKER_TOOLS)
    second = Agent(log, WORKER_SYSTEM, "Task two.", WORKER_TOOLS)
    first.turn(Reply(reasoning="r", calls=[Call("c1", "run_shell_command", {"command": "ls"})]))
    second.turn(Reply(reasoning="r", calls=[Call("c2", "run_shell_command", {"command": "pwd"})]))
    first.results(("c1", "a.txt"))
    second.results(("c2", "/work"))
    first.turn(Reply(reasoning="r", content="one done"))
    second.turn(Reply(reasoning="r", content="two done", finish_reason="length"))
    return log


def test_interleaved_threads_are_separated_and_ordered_by_first_seq():
    found = conversations(exchanges(two_workers().records))
    assert [c.n_requests for c in found] == [2, 2]
    assert [c.first_seq for c in found] == [1, 2]
    assert [c.index for c in found] == [0, 0]
    assert found[0].key != found[1].key
    assert found[0].messages[-1] == {"role": "assistant", "content": "one done", "reasoning_content": "r"}


def test_truncated_final_reply_is_dropped_unless_kept():
    dropped, kept = (conversations(exchanges(two_workers().records), keep_truncated_final=k)[1] for k in (False, True))
    assert dropped.final_truncated and kept.final_truncated
    assert dropped.messages[-1]["role"] == "tool"
    assert kept.messages[-1]["content"] == "two done"


def test_prefix_break_starts_a_new_conversation_and_retries_do_not():
    log = ProxyLog()
    agent = Agent(log, WORKER_SYSTEM, "Task.", WORKER_TOOLS)
    agent.turn(Reply(reasoning="r", calls=[Call("c1", "run_shell_command", {"command": "ls"})]))
    agent.results(("c1", "big output"))
    retry = agent.messages
    log.chat(retry, agent.tools, Reply(content="first try"))  # same messages again: a retry
    agent.turn(Reply(reasoning="r", calls=[Call("c2", "run_shell_command", {"command": "ls -l"})]))
    agent.results(("c2", "x"))
    agent.messages[3]["content"] = [{"type": "text", "text": "[cleared]"}]  # history rewritten in place
    agent.turn(Reply(content="done"))
    found = conversations(exchanges(log.records))
    assert [(c.key, c.index, c.n_requests) for c in found] == [(found[0].key, 0, 3), (found[0].key, 1, 1)]
    assert found[0].thread_id == f"{found[0].key}.0" and found[1].thread_id == f"{found[0].key}.1"
    assert found[1].messages[3]["content"][0]["text"] == "[cleared]"
    assert found[1].messages[-1]["content"] == "done"
