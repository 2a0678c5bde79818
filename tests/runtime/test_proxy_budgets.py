"""Budgets hold on every generation path (ISSUE #25.1): a hostile agent run through the real runner and proxy tries
each way to spend past a task budget, and the platform's records — the cycle's budget ledger in the metadata store
and the published API log — are checked against what the metered upstream really served."""

from __future__ import annotations

import asyncio
import gzip
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from benchmarks.budget_overshoot import MeteredUpstream
from mass_ops.runtime.proxy import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    RESPONSES_ROUTE,
    EpisodeBudget,
    GenerationRequestError,
    prepare_generation,
    usage_tokens,
)
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from mass_ops.runtime.sse import UsageChunkFilter, assemble_sse
from mass_ops.store.budgets import task_scope
from tests.runtime.hostile_agent import hostile_findings
from tests.support.runtime import TASK, hostile_prompt, open_episode_cycle, request, runner_environ

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

    async def scenario() -> tuple[list[dict[str, Any]], int, int, list[Any]]:
        async with MeteredUpstream(server_default_tokens=SERVER_DEFAULT) as upstream:
            options: dict[str, Any] = {"inference": {"episode_max_output_tokens": MAX_OUTPUT}}
            endpoint = f"{upstream.url}/v1"
            ctx = open_episode_cycle(
                tmp_path, endpoint, served_name="metered", budgets={"task_tokens": BUDGET}, **options
            )
            runner = EpisodeRunner(ctx, install=install, environ=runner_environ(), scratch_dir=tmp_path / "scratch")
            outcome = await runner.run_attempt(request(ctx, hostile_prompt(attack)), 1)
            unit = outcome.request.unit
            prefix = f"cycles/{unit.cycle}/episodes/{unit.slug}/a1"
            stream = ctx.artifacts.get_bytes(f"{prefix}/stream.jsonl").decode()
            log = gzip.decompress(ctx.artifacts.get_bytes(f"{prefix}/api_requests.jsonl.gz")).decode()
            spend = ctx.repo.budget_spend(ctx.cycle_id)
            counted = spend[task_scope(TASK)].tokens if task_scope(TASK) in spend else 0
            records = [json.loads(line) for line in log.splitlines()]
            return hostile_findings(stream), upstream.served, counted, records

    findings, served, counted, records = asyncio.run(scenario())
    assert len(findings) == 1 and "error" not in findings[0], findings
    return findings[0], served, counted, records


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


def test_responses_usage_is_read_from_its_events_and_its_fields() -> None:
    event = {"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 7}}}
    usage = assemble_sse(f"data: {json.dumps(event)}\n\n")["usage"]
    assert usage_tokens(usage) == (12, None)
    assert usage_tokens({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 9})[0] == 9


def test_a_request_whose_usage_is_unreported_is_charged_its_whole_need() -> None:
    budget = EpisodeBudget(episode_tokens=1000, default_max_tokens=10)
    for generated in (True, False):
        assert budget.admit(300) is None
        budget.settle(300, None, server_may_have_generated=generated)
    assert (budget.spent, budget.in_flight) == (300, 0), "charged when the server may have generated, else not"
