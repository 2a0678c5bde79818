"""Budgets hold on every generation path (ISSUE #25.1): a hostile agent run through the real runner and proxy tries
each way to spend past a task budget, and the platform's records — the cycle's budget ledger in the metadata store
and the published API log — are checked against what the metered upstream really served."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mass_ops.runtime.generation_request import prepare_generation
from mass_ops.runtime.proxy_access import CHAT_ROUTE, RESPONSES_ROUTE
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.sse import UsageChunkFilter, assemble_sse
from tests.support.proxy import run_hostile_episode

BUDGET = 3000  # the task's tokens
MAX_OUTPUT = 128  # inference.episode_max_output_tokens: what the proxy holds for a request that sets no cap
SERVER_DEFAULT = 16 * MAX_OUTPUT  # what the upstream generates for a request without a cap

# Spend until refused: the attack sends `body(i)` to `route` until the proxy answers anything but 200.
SPEND_UNTIL_REFUSED = """
    import json
    statuses, usage_seen = [], False
    for i in range(200):
        status, _headers, raw = http("POST", base_url + ROUTE, BODY(i), {"Authorization": f"Bearer {token}"})
        statuses.append(status)
        usage_seen = usage_seen or b'"usage": {' in raw or b'"usage":{' in raw
        if status != 200:
            break
    report(statuses=statuses, usage_seen=usage_seen, last=raw[:300].decode(errors="replace"))
"""


def _spend(route: str, body: str) -> str:
    """The attack source: spend with `body` (a Python expression of `i`) on `route` (under the client path)."""
    return f"ROUTE = {route!r}\nBODY = lambda i: {body}\n" + textwrap.dedent(SPEND_UNTIL_REFUSED)


def _run_hostile(tmp_path: Path, install: QwenInstall, attack: str) -> tuple[dict[str, Any], int, int, list[Any]]:
    """Run `attack` as the agent of one episode against a metered upstream under a task budget. Returns the agent's
    findings, the tokens the upstream served, the tokens the ledger counted, and the published API log's records."""
    episode = run_hostile_episode(
        tmp_path,
        install,
        attack,
        server_default_tokens=SERVER_DEFAULT,
        budgets={"task_tokens": BUDGET},
        inference={"episode_max_output_tokens": MAX_OUTPUT},
    )
    return episode.findings, episode.served, episode.task_tokens, episode.records


def _allowance(route: str, body: dict[str, Any]) -> int:
    need = prepare_generation(route, json.dumps(body).encode(), default_max_tokens=MAX_OUTPUT, priority=None).need
    assert need is not None
    return need


def test_streams_without_include_usage_are_counted_and_stopped_at_the_budget(
    tmp_path: Path, hostile_install: QwenInstall
) -> None:
    body = (
        '{"model": "metered", "stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": f"go {i}"}]}'
    )
    found, served, counted, records = _run_hostile(tmp_path, hostile_install, _spend("/chat/completions", body))
    statuses = found["statuses"]
    assert statuses[-1] == 402 and set(statuses[:-1]) == {200} and len(statuses) > 5, found
    assert counted >= served > 0, "every stream the server served is in the ledger, none counted as 0"
    allowance = _allowance(CHAT_ROUTE, {"model": "metered", "stream": True, "max_tokens": 100, "messages": []}) + 8
    assert served <= BUDGET + allowance
    assert found["usage_seen"] is False, "the agent got the stream it asked for: no usage chunk added"
    streams = [r for r in records if r["path"] == "/v1/chat/completions" and r["status"] == 200]
    assert streams and all(r["proxy_added_usage"] and r["response"]["usage"]["completion_tokens"] for r in streams)
    assert all(r["request"]["stream_options"] == {"include_usage": True} for r in streams)


def test_n_and_best_of_multiply_what_a_request_may_spend(tmp_path: Path, hostile_install: QwenInstall) -> None:
    body = '{"model": "metered", "n": 50, "max_tokens": 100, "messages": [{"role": "user", "content": "go"}]}'
    found, served, counted, records = _run_hostile(tmp_path, hostile_install, _spend("/chat/completions", body))
    assert found["statuses"] == [402], "one n=50 request needs 50 x 100 tokens: more than the budget"
    assert served == 0 and counted == 0
    (refused,) = [r for r in records if r["path"] == "/v1/chat/completions"]
    assert refused["budget_exhausted"]["need"] > 50 * 100


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/responses", '{"model": "metered", "input": f"go {i}", "max_output_tokens": 100, "stream": True}'),
        ("/responses", '{"model": "metered", "input": f"go {i}", "max_output_tokens": 100}'),
        ("/completions", '{"model": "metered", "prompt": [f"a {i}", "b"], "best_of": 2, "max_tokens": 100}'),
        ("/chat/completions", '{"model": "metered", "max_tokens": "100", "messages": []}'),
        ("/chat/completions", '{"model": "metered", "max_completion_tokens": 99.5, "messages": []}'),
        ("/chat/completions", '{"model": "metered", "stream": True, "messages": []}'),
    ],
    ids=["responses-stream", "responses", "completions-batch-best-of", "string-cap", "float-cap", "no-cap"],
)
def test_every_generation_route_and_cap_form_is_budgeted_and_counted(
    tmp_path: Path, hostile_install: QwenInstall, route: str, body: str
) -> None:
    found, served, counted, _records = _run_hostile(tmp_path, hostile_install, _spend(route, body))
    statuses = found["statuses"]
    assert statuses[-1] == 402 and set(statuses[:-1]) == {200} and len(statuses) > 2, found
    assert counted >= served > 0
    example = json.loads(body.replace("True", "true").replace('f"', '"').replace("{i}", "0"))
    assert served <= BUDGET + _allowance(route, example) + 8


def test_an_unreadable_cap_is_refused_with_400_and_never_forwarded(
    tmp_path: Path, hostile_install: QwenInstall
) -> None:
    attack = """
        bodies = [
            {"model": "metered", "max_tokens": "lots", "messages": []},
            {"model": "metered", "max_tokens": -5, "messages": []},
            {"model": "metered", "n": [50], "messages": []},
            {"model": "metered", "stream": "yes", "messages": []},
            {"model": "metered", "input": "x", "background": True},
            {"model": "metered", "input": "x", "previous_response_id": "resp_1"},
        ]
        paths = ["/chat/completions"] * 4 + ["/responses"] * 2
        answers = []
        for path, body in zip(paths, bodies):
            status, _h, raw = http("POST", base_url + path, body, {"Authorization": f"Bearer {token}"})
            answers.append([status, __import__("json").loads(raw)["error"]["message"]])
        report(answers=answers)
    """
    found, served, counted, records = _run_hostile(tmp_path, hostile_install, attack)
    assert [status for status, _message in found["answers"]] == [400] * 6
    assert all("\n" not in message for _status, message in found["answers"])
    assert "`max_tokens` must be a number of at least 1" in found["answers"][0][1]
    assert served == counted == 0
    refused = [r for r in records if r.get("rejected") == "bad_generation_request"]
    assert len(refused) == 6 and all(r["status"] == 400 for r in refused)


# --- the pieces -----------------------------------------------------------------------------------------------------


def test_a_stream_gets_usage_and_the_relay_drops_only_the_chunk_it_added() -> None:
    prepared = prepare_generation(CHAT_ROUTE, b'{"stream": true}', default_max_tokens=None, priority=None)
    assert prepared.usage_added and json.loads(prepared.body)["stream_options"] == {"include_usage": True}
    asked = prepare_generation(
        CHAT_ROUTE,
        b'{"stream": true, "stream_options": {"include_usage": true}}',
        default_max_tokens=None,
        priority=None,
    )
    assert not asked.usage_added
    assert not prepare_generation(
        RESPONSES_ROUTE, b'{"stream": true}', default_max_tokens=None, priority=None
    ).usage_added

    content = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": null}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\r\n\r\n'
    stream = content + usage + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):  # every split of the stream across two reads
        relay = UsageChunkFilter()
        relayed = relay.feed(stream[:cut]) + relay.feed(stream[cut:]) + relay.close()
        assert relayed == content + b"data: [DONE]\n\n", cut
    assert assemble_sse(stream)["usage"]["completion_tokens"] == 1, "the record keeps what the server sent"
