"""The policy stand-in server: OpenAI compatibility, scripted answers per request kind, capacity and faults."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from mass_ops.runtime.sse import assemble_sse
from tests.policy_server import (
    WORKFLOW_START_MARKER,
    EventLoopThread,
    Fault,
    FaultRule,
    FaultSpecError,
    PolicyServer,
    PolicyServerConfig,
    RequestKind,
    ResearchTeamPolicy,
    classify_request,
    estimate_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "policy-stand-in"
ORCHESTRATOR_SYSTEM = "You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group."
SUBAGENT_SYSTEM = "You are a general-purpose subagent working for a parent agent. Complete only the assigned task."
MEMORY_SYSTEM = "You are now acting as the managed memory extraction subagent for an AI coding assistant."
OPTIMIZER_SYSTEM = "You are a principal prompt engineer for autonomous coding agents. Return valid JSON only."
JUDGE_SYSTEM = "You are a senior quantitative researcher reviewing two workspaces. JSON only."


def _body(system: str, user: str = "Do the task.", *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "stream": stream, **extra}


def _with_tool_results(body: dict[str, Any], n: int) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for i in range(n):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "x", "arguments": "{}"}}
        turns += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"},
        ]
    return {**body, "messages": body["messages"] + turns}


async def _post(server: PolicyServer, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as client, client.post(f"{server.base_url}/v1/chat/completions", json=body) as r:
        return r.status, await r.read()


def _run(config: PolicyServerConfig | None, *bodies: dict[str, Any], policy: Any = None) -> list[tuple[int, bytes]]:
    async def scenario() -> list[tuple[int, bytes]]:
        async with PolicyServer(config, policy) as server:
            return [await _post(server, body) for body in bodies]

    return asyncio.run(scenario())


def test_request_kinds_are_recognised_from_the_system_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "write_file"}}]
    assert classify_request(_body(ORCHESTRATOR_SYSTEM, tools=tools)) is RequestKind.ORCHESTRATOR
    assert classify_request(_body(SUBAGENT_SYSTEM, tools=tools)) is RequestKind.SUBAGENT
    assert classify_request(_body(MEMORY_SYSTEM, tools=tools)) is RequestKind.AUXILIARY
    assert classify_request(_body(OPTIMIZER_SYSTEM)) is RequestKind.OPTIMIZER
    assert classify_request(_body(JUDGE_SYSTEM)) is RequestKind.JUDGE
    assert classify_request(_body("You are a senior researcher in pharmacy.")) is RequestKind.JUDGE
    assert classify_request(_body("You are a senior research reviewer.")) is RequestKind.JUDGE
    assert classify_request(_body("You are a helpful assistant.")) is RequestKind.AUXILIARY


def test_orchestrator_script_advances_with_tool_results() -> None:
    cwd_note = "I'm currently working in the directory: /tmp/ws-1\nWrite the report."
    base = _body(ORCHESTRATOR_SYSTEM, cwd_note, seed=5)
    replies = [json.loads(raw) for _, raw in _run(None, *(_with_tool_results(base, n) for n in range(5)))]
    calls = [[c["function"] for c in (r["choices"][0]["message"].get("tool_calls") or [])] for r in replies]
    assert [[c["name"] for c in step] for step in calls] == [["write_file"], ["run_shell_command"], ["agent"], [], []]
    assert json.loads(calls[0][0]["arguments"])["file_path"] == "/tmp/ws-1/research_report.md"
    agent_args = json.loads(calls[2][0]["arguments"])
    assert agent_args["subagent_type"] == "general-purpose" and agent_args["run_in_background"] is False
    assert "/tmp/ws-1/results/metrics.json" in agent_args["prompt"]
    assert [r["choices"][0]["finish_reason"] for r in replies] == ["tool_calls"] * 3 + ["stop"] * 2
    assert replies[0]["choices"][0]["message"]["reasoning_content"]


def test_streamed_tool_call_arguments_are_fragmented_and_usage_reported() -> None:
    body = _body(ORCHESTRATOR_SYSTEM, "I'm currently working in the directory: /w", stream=True)
    body["stream_options"] = {"include_usage": True}
    ((status, raw),) = _run(PolicyServerConfig(argument_fragments=5), body)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    fragments = [
        tc["function"]["arguments"]
        for e in events
        for ch in e["choices"]
        for tc in ch["delta"].get("tool_calls", [])
        if tc["function"]["arguments"]
    ]
    assert len(fragments) == 5
    assert all(not _parses(f) for f in fragments)  # no single fragment is the whole JSON
    assert events[-1]["choices"] == [] and raw.endswith(b"data: [DONE]\n\n")
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == estimate_tokens(json.dumps(body["messages"], ensure_ascii=False))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    message = assemble_sse(raw)["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["file_path"] == "/w/research_report.md"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_subagent_writes_the_target_then_reports() -> None:
    prompt = "Compute metrics.\nTARGET_FILE: /tmp/ws/results/metrics.json\nOutput to orchestrator: path."
    first, second = _run(None, _body(SUBAGENT_SYSTEM, prompt), _with_tool_results(_body(SUBAGENT_SYSTEM, prompt), 1))
    (call,) = json.loads(first[1])["choices"][0]["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "write_file" and arguments["file_path"] == "/tmp/ws/results/metrics.json"
    assert "score" in json.loads(arguments["content"])
    final = json.loads(second[1])["choices"][0]["message"]
    assert final["content"].startswith("Output to orchestrator") and "tool_calls" not in final


def test_optimizer_returns_a_design_that_starts_with_the_workflow_marker() -> None:
    user = "# Current multi agent design (v2)\nCreate an agent team ...\n# Save rules\n..."
    ((_, raw),) = _run(None, _body(OPTIMIZER_SYSTEM, user, seed=11, response_format={"type": "json_object"}))
    answer = json.loads(json.loads(raw)["choices"][0]["message"]["content"])
    design = answer["improved_multi_agent_design"]
    assert design.startswith(WORKFLOW_START_MARKER)
    agents = json.loads(design[len(WORKFLOW_START_MARKER) :])
    assert agents[0]["name"] == "orchestrator" and len(agents) >= 2
    assert answer["changes_from_previous"][0].startswith("v2 -> v3")
    for key in ("why_it_should_improve", "evidence_used", "expected_impact", "verification_checks"):
        assert isinstance(answer[key], list) and answer[key]


def test_judge_verdict_is_deterministic_per_seed_and_can_be_forced() -> None:
    prompts = [f"# Task\ncompare run {i}" for i in range(12)]
    bodies = [_body(JUDGE_SYSTEM, p, seed=7) for p in prompts]
    first = [json.loads(json.loads(raw)["choices"][0]["message"]["content"]) for _, raw in _run(None, *bodies)]
    again = [json.loads(json.loads(raw)["choices"][0]["message"]["content"]) for _, raw in _run(None, *bodies)]
    assert first == again
    assert [v["winner"] for v in first] == [ResearchTeamPolicy.seeded_judge_winner(7, p) for p in prompts]
    assert {v["winner"] for v in first} == {"A", "B", "tie"}  # 12 prompts: every verdict occurs
    assert all(v["rationale"] for v in first)
    ((_, raw),) = _run(None, bodies[0], policy=ResearchTeamPolicy(judge_winner="B"))
    assert json.loads(json.loads(raw)["choices"][0]["message"]["content"])["winner"] == "B"


def test_openai_sdk_talks_to_the_server_streaming_and_not() -> None:
    with EventLoopThread() as loop:
        server = PolicyServer(PolicyServerConfig(models=("tiny", "other")))
        loop.run(server.start())
        try:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-fake", max_retries=0)
            assert [m.id for m in client.models.list()] == ["tiny", "other"]
            whole = client.chat.completions.create(
                model="other", messages=[{"role": "system", "content": JUDGE_SYSTEM}]
            )
            assert json.loads(whole.choices[0].message.content)["winner"] in ("A", "B", "tie")
            assert whole.usage.prompt_tokens > 0
            stream = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "system", "content": ORCHESTRATOR_SYSTEM}, {"role": "user", "content": "go"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            names = [tc.function.name for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
            assert "write_file" in names and chunks[-1].usage.completion_tokens > 0
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
        finally:
            loop.run(server.stop())


def test_http_503_fires_on_selected_requests_only() -> None:
    config = PolicyServerConfig(faults=[FaultRule(Fault.HTTP_503, requests=frozenset({1, 3}))])
    results = _run(config, *[_body(JUDGE_SYSTEM)] * 4)
    assert [status for status, _ in results] == [503, 200, 503, 200]
    assert "Service Unavailable" in json.loads(results[0][1])["error"]["message"]


def test_fault_by_kind_and_times() -> None:
    config = PolicyServerConfig(faults=[FaultRule(Fault.INVALID_JSON, kind=RequestKind.JUDGE, times=1)])
    results = _run(config, _body(OPTIMIZER_SYSTEM), _body(JUDGE_SYSTEM), _body(JUDGE_SYSTEM))
    contents = [json.loads(raw)["choices"][0]["message"]["content"] for _, raw in results]
    assert _parses(contents[0]) and not _parses(contents[1]) and _parses(contents[2])


def test_wrong_schema_and_empty_content_faults() -> None:
    config = PolicyServerConfig(
        faults=[
            FaultRule(Fault.WRONG_SCHEMA, requests=frozenset({1})),
            FaultRule(Fault.EMPTY_CONTENT, requests=frozenset({2})),
        ]
    )
    (_, wrong), (_, empty) = _run(config, _body(JUDGE_SYSTEM), _body(JUDGE_SYSTEM))
    assert "winner" not in json.loads(json.loads(wrong)["choices"][0]["message"]["content"])
    choice = json.loads(empty)["choices"][0]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"]


def test_connection_reset_cut_and_stall_faults() -> None:
    config = PolicyServerConfig(
        faults=[
            FaultRule(Fault.CONNECTION_RESET, requests=frozenset({1})),
            FaultRule(Fault.STREAM_CUT, requests=frozenset({2}), after_chunks=3),
            FaultRule(Fault.STALL, requests=frozenset({3}), after_chunks=2, stall_s=30),
        ]
    )
    stream_body = _body(ORCHESTRATOR_SYSTEM, stream=True)

    async def scenario() -> None:
        async with PolicyServer(config) as server, aiohttp.ClientSession() as client:
            url = f"{server.base_url}/v1/chat/completions"
            with pytest.raises((aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)):
                async with client.post(url, json=stream_body) as response:
                    await response.read()
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async with client.post(url, json=stream_body) as response:
                    async for chunk in response.content.iter_any():
                        received += chunk
            assert received.count(b"data: ") == 3 and b"[DONE]" not in received
            started = time.monotonic()
            async with client.post(url, json=stream_body) as response:
                assert await response.content.readuntil(b"\n\n")
                assert await response.content.readuntil(b"\n\n")
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=0.5)
            assert time.monotonic() - started < 5
            async with client.get(f"{server.base_url}/stats") as response:
                fired = (await response.json())["faults_fired"]
            assert fired == {"connection_reset": 1, "stream_cut": 1, "stall": 1}

    asyncio.run(scenario())


def test_capacity_bounds_concurrency_and_excess_requests_wait() -> None:
    config = PolicyServerConfig(capacity=2, latency_s=0.15)

    async def scenario() -> tuple[float, dict[str, Any]]:
        async with PolicyServer(config) as server:
            started = time.monotonic()
            results = await asyncio.gather(*(_post(server, _body(JUDGE_SYSTEM)) for _ in range(6)))
            elapsed = time.monotonic() - started
            assert [status for status, _ in results] == [200] * 6
            return elapsed, server.stats.as_dict()

    elapsed, stats = asyncio.run(scenario())
    assert stats["peak_active"] == 2 and stats["active"] == 0 and stats["waiting"] == 0
    assert stats["chat_requests"] == 6 and stats["by_kind"] == {"judge": 6}
    assert elapsed >= 3 * 0.15  # six requests through two slots take at least three latency periods


def test_model_not_listed_and_unknown_model() -> None:
    config = PolicyServerConfig(models=("tiny",), faults=[FaultRule(Fault.MODEL_NOT_LISTED, requests=frozenset({1}))])

    async def scenario() -> None:
        async with PolicyServer(config) as server, aiohttp.ClientSession() as client:
            for expected in ([], ["tiny"]):
                async with client.get(f"{server.base_url}/v1/models") as response:
                    assert [m["id"] for m in (await response.json())["data"]] == expected
            status, raw = await _post(server, {**_body(JUDGE_SYSTEM), "model": "qwen-giant"})
            assert status == 404 and "qwen-giant" in json.loads(raw)["error"]["message"]

    asyncio.run(scenario())


def test_fault_spec_parsing() -> None:
    rule = FaultRule.parse("stream_cut:kind=orchestrator,times=1,after_chunks=4,requests=2+5,stall_s=1.5")
    assert (rule.fault, rule.kind, rule.times, rule.after_chunks, rule.requests, rule.stall_s) == (
        Fault.STREAM_CUT,
        RequestKind.ORCHESTRATOR,
        1,
        4,
        frozenset({2, 5}),
        1.5,
    )
    for bad in ("explode", "http_503:requests=one", "http_503:colour=red", "http_503:times"):
        with pytest.raises(FaultSpecError, match="fault spec"):
            FaultRule.parse(bad)


def test_runs_as_a_subprocess_with_port_file_and_faults(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    argv = [sys.executable, "-m", "tests.policy_server", "--port", "0", "--port-file", str(port_file)]
    process = subprocess.Popen(
        [*argv, "--model", "m1", "--fault", "http_503:requests=1", "--judge-winner", "tie"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{int(port_file.read_text())}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-fake", max_retries=0)
        assert [m.id for m in client.models.list()] == ["m1"]
        messages = [{"role": "system", "content": JUDGE_SYSTEM}]
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m1", messages=messages)
        answer = client.chat.completions.create(model="m1", messages=messages)
        assert json.loads(answer.choices[0].message.content)["winner"] == "tie"
        with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0
