"""Render ↔ inference round trip: what the loss covers is what the model produced.

A multi-turn, multi-thread teacher episode (the orchestrator, two general-purpose subagents spawned through the `agent`
tool, a title call; tool calls, reasoning, an empty-reasoning final turn, a history rewrite) is rendered into windows.
Independently, every reply the proxy logged (reasoning_content, content, tool_calls as the model generated them) is
rendered by the Qwen3 chat template as the assistant message that follows its own request's generation prompt, which
is how vLLM tokenised it at inference. For every assistant turn of every rendered conversation, the trained tokens must
equal those inference tokens after the `<think>\\n` the generation prefix holds (`<think>\\n\\n` for empty reasoning),
through `<|im_end|>`; and the tools schema the request carried must be in every window's prompt.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from mass_ops.render import IGNORE_INDEX, EpisodeSource, TrainingWindow, render_episode
from mass_ops.render.masks import ChatRenderer, vllm_messages
from mass_ops.render.proxy_log import exchanges
from mass_ops.render.threads import conversations
from tests.render.scenarios import BARE_PROMPT, TEACHER_PROMPT, TeacherEpisode, build_teacher_episode

WINDOW = 4096
OVERLAP = 1024
THINK_HEADS = ("<think>\n", "<think>\n\n")


@pytest.fixture(scope="module")
def episode() -> TeacherEpisode:
    return build_teacher_episode()


@pytest.fixture(scope="module")
def windows(episode: TeacherEpisode, qwen3_tokenizer: Any) -> list[TrainingWindow]:
    source = EpisodeSource(
        episode="t202_L0_s710000",
        task=202,
        condition="t202_L0",
        seed=710000,
        success=True,
        log_records=episode.log.records,
        teacher_prompt=TEACHER_PROMPT,
        bare_prompt=BARE_PROMPT,
    )
    rendered = render_episode(source, qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)
    assert rendered.errors == []
    return rendered.windows


def reply_key(message: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """Identifies a reply both as logged and as replayed into later histories."""
    calls = tuple(call["id"] for call in message.get("tool_calls") or ())
    return message.get("content") or "", message.get("reasoning_content") or "", calls


def inference_tokens(record: dict[str, Any], tokenizer: Any) -> list[int]:
    """The tokens the model produced for one logged request, from its generation prompt through `<|im_end|>`,
    tokenised in the context of that prompt as the server did."""
    request = record["request"]
    part_separator = ChatRenderer(tokenizer).part_separator
    messages = vllm_messages(request["messages"], part_separator=part_separator)
    tools = request.get("tools")
    logged = record["response"]["choices"][0]["message"]
    # The reply as the model generated it: tool-call arguments are the text it emitted, which the template copies.
    reply: dict[str, Any] = {"role": "assistant", "content": logged.get("content") or ""}
    if logged.get("reasoning_content") is not None:
        reply["reasoning_content"] = logged["reasoning_content"]
    if logged.get("tool_calls"):
        reply["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": dict(call["function"])} for call in logged["tool_calls"]
        ]
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    full = tokenizer.apply_chat_template(
        [*messages, reply], tools=tools, add_generation_prompt=False, tokenize=False, enable_thinking=True
    )
    assert full.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    end = full.rindex("<|im_end|>") + len("<|im_end|>")
    encoding = tokenizer.backend_tokenizer.encode(full, add_special_tokens=False)
    return [
        token
        for token, (start, stop) in zip(encoding.ids, encoding.offsets, strict=True)
        if start >= len(prompt) and stop <= end
    ]


def trained_runs(windows: list[TrainingWindow]) -> list[list[int]]:
    """Maximal runs of trained positions, window after window (one run per trained assistant turn)."""
    runs: list[list[int]] = []
    for window in windows:
        previous = False
        for label in window.labels:
            if label != IGNORE_INDEX:
                if not previous:
                    runs.append([])
                runs[-1].append(label)
            previous = label != IGNORE_INDEX
    return runs


def test_trained_tokens_are_the_tokens_produced_at_inference(episode, windows, qwen3_tokenizer):
    records = {
        reply_key(record["response"]["choices"][0]["message"]): record
        for record in episode.log.records
        if record["status"] == 200
    }
    grouped: dict[str, list[TrainingWindow]] = defaultdict(list)
    for window in windows:
        grouped[window.thread].append(window)
    threads = conversations(exchanges(episode.log.records))
    checked = 0
    for conversation in threads:
        runs = trained_runs(sorted(grouped[conversation.thread_id], key=lambda w: (w.segment, w.window)))
        turns = [m for m in conversation.messages if m.get("role") == "assistant"]
        assert len(runs) == len(turns), conversation.thread_id
        for turn, run in zip(turns, runs, strict=True):
            produced = inference_tokens(records[reply_key(turn)], qwen3_tokenizer)
            head = produced[: len(produced) - len(run)]
            assert qwen3_tokenizer.decode(head) in THINK_HEADS, qwen3_tokenizer.decode(produced[:4])
            assert produced[len(head) :] == run, qwen3_tokenizer.decode(run)
            checked += 1
    print(f"{checked} assistant turns in {len(threads)} conversations match their inference tokens")
    # o1, o2 | a1, a2 | b1, b2 (b3 hit the length limit: dropped) | title | o1, o2, o3 after the history rewrite
    assert checked == 10
    assert {w.role for w in windows} == {"orchestrator", "worker", "auxiliary"}


def test_every_window_prompt_carries_the_tools_schema_of_its_requests(episode, windows, qwen3_tokenizer):
    tools_of = {c.thread_id: c.tools for c in conversations(exchanges(episode.log.records))}
    with_tools = 0
    for window in windows:
        prompt = qwen3_tokenizer.decode(window.input_ids[: window.header_tokens])
        tools = tools_of[window.thread]
        if not tools:
            assert "<tools>" not in prompt
            continue
        schema = "<tools>" + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + "\n</tools>"
        assert schema in prompt, window.thread
        with_tools += 1
    assert with_tools and with_tools < len(windows)  # the title thread has no tools
