"""Hand-built proxy logs with the shapes qwen-code and the logging proxy really produce (MASS_SPEC §4).

Shapes checked against a qwen-code 0.21.10 run: the system prompt is a string ("You are Qwen Code, …" for the main
agent, "You are a general-purpose subagent …" for `agent` tool workers); the first user message is a list of text
parts — `<system-reminder>` parts, then the prompt; history assistant messages carry `content` "" (or text),
`reasoning_content` when non-empty and tool calls whose arguments qwen-code re-serialised compactly; tool results are
`tool` messages whose content is a list of text parts. Streamed replies are logged in the proxy's reassembled form
(`chat.completion.reassembled`) next to the raw SSE, in which tool-call arguments arrive split across fragments.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from dataclasses import dataclass, field
from typing import Any

ORCHESTRATOR_SYSTEM = (
    "You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group, specializing in software engineering "
    "tasks. Your primary goal is to help users safely and efficiently.\n\n# Core Mandates\n\n- Follow conventions.\n"
)
WORKER_SYSTEM = (
    "You are a general-purpose subagent working for a parent agent. Complete only the assigned task, using the "
    "available tools as needed.\n\nImportant Rules:\n - You operate in non-interactive mode."
)
TITLE_SYSTEM = "Generate a short title (at most six words) for the conversation below. Reply with the title only."
STARTUP_REMINDER = (
    "<system-reminder>\nThis is the Qwen Code. We are setting up the context for our chat.\nToday's date is Monday, "
    "November 30, 2026.\nMy operating system is: linux\nI'm currently working in the directory: /work/ws\n"
    "</system-reminder>"
)


def tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    """An OpenAI function tool with string parameters."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": sorted(properties),
            },
        },
    }


ORCHESTRATOR_TOOLS = [
    tool("agent", "Launch a new agent to handle a multi-step task.", subagent_type="agent type", prompt="task"),
    tool("read_file", "Read a file.", file_path="absolute path"),
    tool("run_shell_command", "Run a shell command.", command="bash command"),
]
WORKER_TOOLS = [
    tool("write_file", "Write a file.", file_path="absolute path", content="file content"),
    tool("run_shell_command", "Run a shell command.", command="bash command"),
]


def tool_output(seed: int, lines: int) -> str:
    """Deterministic, realistic command output: a training log with metrics, a few thousand tokens when long."""
    rng = random.Random(seed)
    rows = [f"$ uv run python run_pipeline.py --seed {seed}"]
    for step in range(lines):
        rows.append(
            f"[epoch {step // 20:02d} step {step:04d}] loss={rng.uniform(0.1, 2.5):.4f} "
            f"precision@5={rng.random():.3f} recall@10={rng.random():.3f} lr={rng.uniform(1e-5, 3e-4):.2e}"
        )
    rows.append("wrote results/metrics.json and deliverables/plots/pr_curve.png")
    return "\n".join(rows)


@dataclass
class Call:
    """One tool call the model makes; `raw` overrides the generated argument text."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str | None = None

    def generated(self) -> str:
        """Argument text as the model generated it (Python json spacing)."""
        return self.raw if self.raw is not None else json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Reply:
    """What the model answers to one request."""

    content: str | None = None
    reasoning: str | None = None
    calls: list[Call] = field(default_factory=list)
    finish_reason: str | None = None

    def finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.calls else "stop")


class ProxyLog:
    """Accumulates proxy records; `seq` grows with every request, records are written when the response ends."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        reply: Reply,
        *,
        stream: bool = True,
        seq: int | None = None,
        status: int = 200,
    ) -> dict[str, Any]:
        """Log one chat completion and return its record."""
        seq = self.next_seq() if seq is None else seq
        request: dict[str, Any] = {
            "model": "tiny",
            "messages": copy.deepcopy(messages),
            "stream": stream,
            "temperature": 0.6,
            "top_p": 0.95,
            "max_tokens": 32768,
            "chat_template_kwargs": {"enable_thinking": True},
        }
        if tools:
            request["tools"] = copy.deepcopy(tools)
        record: dict[str, Any] = {
            "ts_start": 1_790_000_000.0 + seq,
            "method": "POST",
            "path": "/v1/chat/completions",
            "seq": seq,
            "request_bytes": len(json.dumps(request)),
            "request": request,
            "status": status,
            "stream": stream,
            "duration_s": 0.5,
        }
        if status == 200:
            if stream:
                record["sse_raw"] = sse_text(reply)
                record["response"] = reassembled(reply)
            else:
                record["response"] = completion(reply)
        else:
            record["response"] = {"error": {"message": "upstream failure", "code": status}}
        self.add(record)
        return record

    def lines(self) -> list[str]:
        return [json.dumps(record) for record in self.records]

    def gz(self) -> bytes:
        return gzip.compress(("\n".join(self.lines()) + "\n").encode("utf-8"))


def _tool_calls_wire(reply: Reply) -> list[dict[str, Any]] | None:
    if not reply.calls:
        return None
    return [
        {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.generated()}}
        for i, call in enumerate(reply.calls)
    ]


def reassembled(reply: Reply) -> dict[str, Any]:
    """The proxy's `chat.completion.reassembled` object for a streamed reply."""
    return {
        "object": "chat.completion.reassembled",
        "id": "chatcmpl-test",
        "model": "tiny",
        "created": 1_790_000_000,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": reply.content,
                    "reasoning_content": reply.reasoning,
                    "reasoning_details": None,
                    "tool_calls": _tool_calls_wire(reply),
                },
                "finish_reason": reply.finish(),
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        "error": None,
        "n_chunks": 6,
        "n_bad_chunks": 0,
    }


def completion(reply: Reply) -> dict[str, Any]:
    """A non-streamed vLLM chat completion (reasoning parser on)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning}
    calls = _tool_calls_wire(reply)
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1_790_000_000,
        "model": "tiny",
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish()}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
    }


def sse_text(reply: Reply) -> str:
    """Raw SSE of the reply: reasoning and content in pieces, tool-call arguments split across fragments."""
    chunks: list[dict[str, Any]] = [{"role": "assistant"}]
    for text, key in ((reply.reasoning, "reasoning_content"), (reply.content, "content")):
        if text:
            middle = len(text) // 2
            chunks += [{key: text[:middle]}, {key: text[middle:]}]
    for index, call in enumerate(reply.calls):
        args = call.generated()
        cut = max(1, len(args) // 3)
        chunks.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        )
        for piece in (args[:cut], args[cut : 2 * cut], args[2 * cut :]):
            chunks.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    events = [
        {"id": "chatcmpl-test", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        for delta in chunks
    ]
    events.append({"id": "chatcmpl-test", "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish()}]})
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"


class Agent:
    """One agent thread as qwen-code drives it: sends its history, then appends the reply the way it re-sends it."""

    def __init__(self, log: ProxyLog, system: str, prompt: str, tools: list[dict[str, Any]] | None) -> None:
        self.log = log
        self.tools = tools
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": STARTUP_REMINDER}, {"type": "text", "text": prompt}]},
        ]

    def turn(self, reply: Reply, *, stream: bool = True, seq: int | None = None) -> dict[str, Any]:
        """Send the history, log the reply and append it as qwen-code re-serialises it."""
        record = self.log.chat(self.messages, self.tools, reply, stream=stream, seq=seq)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
        if reply.calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    # qwen-code parses the arguments and re-serialises them with JSON.stringify (no spaces).
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments, separators=(",", ":"))},
                }
                for call in reply.calls
            ]
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        self.messages.append(message)
        return record

    def results(self, *outputs: tuple[str, str]) -> None:
        """Append tool results (call id, text), one tool message each."""
        for call_id, text in outputs:
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": [{"type": "text", "text": text}]})

    def user(self, text: str) -> None:
        """Append a user message (a reminder or follow-up qwen-code injects mid-run)."""
        self.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
