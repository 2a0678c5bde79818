"""A generation request as the proxy forwards it: what it may spend, its priority, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mass_ops.runtime.generation_request import GenerationRequestError, prepare_generation
from mass_ops.runtime.proxy_access import CHAT_ROUTE, COMPLETIONS_ROUTE


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
        b"{}",
        b"{ \n}",
        b' \n{ "model" : "m" }\n',
        # "priority" only inside a string
        json.dumps({"messages": [{"role": "user", "content": 'set "priority" to high'}]}).encode(),
    ],
)
def test_a_priority_is_added_to_a_json_object_body_and_nothing_else_changes(body: bytes) -> None:
    stamped = prepare_generation(CHAT_ROUTE, body, default_max_tokens=None, priority=7).body
    document = json.loads(stamped)
    assert document.pop("priority") == 7
    assert document == json.loads(body)


def test_the_agent_s_own_priority_is_replaced_and_nested_keys_are_kept() -> None:
    # qwen-code's tools can have a property named priority (a todo list's): only the top-level field is the server's.
    body = {
        "priority": -100,
        "model": "m",
        "tools": [{"function": {"parameters": {"properties": {"priority": {"type": "string"}}}}}],
        "messages": [{"role": "user", "content": "ünïcode stays"}],
    }
    stamped = prepare_generation(CHAT_ROUTE, json.dumps(body).encode(), default_max_tokens=None, priority=7).body
    assert json.loads(stamped) == {**body, "priority": 7}


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'{"model": ', b"not json", b'"text"', b'{"a": 1} trailing'])
def test_a_generation_body_that_is_no_json_object_is_refused(body: bytes) -> None:
    with pytest.raises(GenerationRequestError, match=r"not JSON|not a JSON object"):
        prepare_generation(CHAT_ROUTE, body, default_max_tokens=None, priority=7)


@pytest.mark.parametrize(
    ("fields", "expected_output"),
    [
        ({"max_tokens": 100}, 100),
        ({"max_tokens": 100.0}, 100),
        ({"max_tokens": 99.2}, 100),
        ({"max_tokens": " 100 "}, 100),
        ({"max_tokens": "1e2"}, 100),
        ({"max_tokens": 10, "max_completion_tokens": 100}, 100),  # a server may read either: the larger counts
        ({"max_tokens": 100, "n": 3}, 300),
        ({"max_tokens": 100, "n": "2", "best_of": 4}, 400),
        ({}, 512),
        ({"max_tokens": None}, 512),
    ],
)
def test_the_need_reads_every_cap_and_multiplier(fields: dict[str, Any], expected_output: int) -> None:
    body = json.dumps({"model": "m", "messages": [], **fields}).encode()
    prepared = prepare_generation(CHAT_ROUTE, body, default_max_tokens=512, priority=None)
    assert prepared.need == -(-len(prepared.body) // 4) + expected_output
    if not any(fields.get(name) is not None for name in ("max_tokens", "max_completion_tokens")):
        assert json.loads(prepared.body)["max_tokens"] == 512, "the server is held to the allowance"


def test_a_completions_batch_multiplies_the_need_and_duplicate_keys_cannot_hide_a_cap() -> None:
    body = b'{"prompt": ["a", "b", "c"], "max_tokens": 7, "max_tokens": 100, "best_of": 2}'
    prepared = prepare_generation(COMPLETIONS_ROUTE, body, default_max_tokens=5, priority=3)
    forwarded = json.loads(prepared.body)
    assert prepared.body.count(b"max_tokens") == 1 and forwarded["max_tokens"] == 100 and forwarded["priority"] == 3
    assert prepared.need == -(-len(prepared.body) // 4) + 3 * 2 * 100


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": "lots"},
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_completion_tokens": "0.0"},
        {"max_tokens": True},
        {"n": [2]},
        {"max_tokens": "inf"},
        {"n": {}},
        {"n": -2},
    ],
)
def test_an_unreadable_count_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(GenerationRequestError, match="must be a number of at least"):
        prepare_generation(CHAT_ROUTE, json.dumps(fields).encode(), default_max_tokens=None, priority=None)
