"""Reassembly of OpenAI-compatible chat-completion SSE streams into one `chat.completion.reassembled` object.

Contract: `SSEAssembler` takes a streamed response's bytes as they pass (parsing never slows the relay) and returns
the MASS_SPEC §4 object: `content` / `reasoning_content` joined from the deltas, `tool_calls` merged by index, the
last non-null `usage`, the first chunk-level `error`, `n_chunks`, `n_bad_chunks` (payloads that are not JSON
objects) and `done` (whether `data: [DONE]` arrived, so a stream cut mid-way is visible). `UsageChunkFilter` takes
the usage-only chunk the proxy asked for out of a relayed stream, so the agent gets the stream it asked for. The
result's fields in full: docs/proxy.md (`mass_ops.runtime.sse`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

REASSEMBLED_OBJECT = "chat.completion.reassembled"
DONE_SENTINEL = "[DONE]"


@dataclass
class _ToolCallAccumulator:
    index: int
    id: str | None = None
    type: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def merge(self, fragment: dict[str, Any]) -> None:
        if fragment.get("id") and not self.id:
            self.id = fragment["id"]
        if fragment.get("type") and not self.type:
            self.type = fragment["type"]
        function = fragment.get("function") or {}
        name = function.get("name")
        # Servers send the name once; a few repeat it on every fragment, and a rare few stream it in pieces.
        if name and name != self.name:
            self.name = name if not self.name else self.name + name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            self.arguments.append(arguments)
        elif arguments is not None:
            # Non-string arguments (already-parsed objects) are kept as their JSON text.
            self.arguments.append(json.dumps(arguments, ensure_ascii=False))

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "id": self.id,
            "type": self.type or "function",
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


@dataclass
class _ChoiceAccumulator:
    index: int
    role: str | None = None
    content: list[str] | None = None
    reasoning: list[str] | None = None
    reasoning_details: list[Any] | None = None
    tool_calls: dict[int, _ToolCallAccumulator] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: Any = None

    def merge(self, choice: dict[str, Any]) -> None:
        delta: dict[str, Any]
        if isinstance(choice.get("delta"), dict):
            delta = choice["delta"]
        else:
            # Some servers put a whole `message` in the last chunk; treat it like a delta.
            message = choice.get("message")
            delta = message if isinstance(message, dict) else {}
        if delta.get("role") and not self.role:
            self.role = delta["role"]
        if isinstance(delta.get("content"), str):
            if self.content is None:
                self.content = []
            self.content.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                if self.reasoning is None:
                    self.reasoning = []
                self.reasoning.append(delta[key])
        details = delta.get("reasoning_details")
        if isinstance(details, list):
            if self.reasoning_details is None:
                self.reasoning_details = []
            self.reasoning_details.extend(details)
        for position, fragment in enumerate(delta.get("tool_calls") or []):
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index", position)
            accumulator = self.tool_calls.setdefault(index, _ToolCallAccumulator(index=index))
            accumulator.merge(fragment)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]

    def as_dict(self) -> dict[str, Any]:
        tool_calls = [self.tool_calls[i].as_dict() for i in sorted(self.tool_calls)] or None
        return {
            "index": self.index,
            "message": {
                "role": self.role or "assistant",
                "content": "".join(self.content) if self.content is not None else None,
                "reasoning_content": "".join(self.reasoning) if self.reasoning is not None else None,
                "reasoning_details": self.reasoning_details,
                "tool_calls": tool_calls,
            },
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


class SSEAssembler:
    """Incremental SSE parser: `feed()` bytes in any split, `result()` once the stream is over.

    `feed()` only keeps a reference to the bytes, so a relay can call it per network read at wire speed (no copy:
    appending to one growing buffer cost the relay a sixth of its time on 50 MB streams); `parse_pending()` decodes
    every complete line fed so far (call it whenever progressive state is wanted) and `result()` finishes: it also
    takes a trailing event that lacks its blank line. Lines are split on bytes before decoding, so multi-byte UTF-8
    characters cut across reads stay intact. `raw` is every byte fed, for logs that store the stream as is (joined
    when first read after a feed); `size` and `pieces()` give its length and contents without joining.
    """

    def __init__(self) -> None:
        self._raw = bytearray()
        self._fed: list[bytes] = []  # fed since `_raw` was last joined
        self.size = 0
        self._offset = 0  # bytes of `raw` already parsed
        self._skip_lf = False
        self._data_lines: list[str] = []
        self._id: str | None = None
        self._model: str | None = None
        self._created: int | None = None
        self._choices: dict[int, _ChoiceAccumulator] = {}
        self._usage: Any = None
        self._error: Any = None
        self._result: dict[str, Any] | None = None
        self.n_chunks = 0
        self.n_bad_chunks = 0
        self.done = False

    def feed(self, data: bytes) -> None:
        """Append the next bytes of the stream (no parsing here)."""
        if self._result is not None:
            raise RuntimeError("SSEAssembler.feed() called after result()")
        self._fed.append(bytes(data))  # a no-op for bytes; a copy of a buffer the caller may reuse
        self.size += len(data)

    @property
    def raw(self) -> bytearray:
        """Every byte fed so far."""
        if self._fed:
            for piece in self._fed:
                self._raw += piece
            self._fed = []
        return self._raw

    @raw.setter
    def raw(self, data: bytearray) -> None:
        """Take `data` as the whole stream fed so far (a stream handed over already joined)."""
        self._raw, self._fed, self.size = data, [], len(data)

    def pieces(self) -> list[bytes | bytearray]:
        """The stream fed so far as consecutive pieces (`raw` without joining them)."""
        return ([self._raw] if self._raw else []) + self._fed

    def parse_pending(self) -> None:
        """Parse every complete line fed so far; a partial last line waits for more bytes."""
        end = max(self.raw.rfind(b"\n"), self.raw.rfind(b"\r")) + 1
        if end > self._offset:
            self._parse(bytes(self.raw[self._offset : end]))
            self._offset = end

    def result(self) -> dict[str, Any]:
        """The `chat.completion.reassembled` object of the whole stream; no `feed()` after this."""
        if self._result is not None:
            return self._result
        self.parse_pending()
        if self._offset < len(self.raw):
            self._parse(bytes(self.raw[self._offset :]))
            self._offset = len(self.raw)
        self._dispatch()
        self._result = {
            "object": REASSEMBLED_OBJECT,
            "id": self._id,
            "model": self._model,
            "created": self._created,
            "choices": [self._choices[i].as_dict() for i in sorted(self._choices)],
            "usage": self._usage,
            "error": self._error,
            "n_chunks": self.n_chunks,
            "n_bad_chunks": self.n_bad_chunks,
            "done": self.done,
        }
        return self._result

    def _parse(self, data: bytes) -> None:
        if self._skip_lf and data.startswith(b"\n"):
            data = data[1:]  # second half of a CRLF whose CR ended the previous parse
        self._skip_lf = data.endswith(b"\r")
        for line in data.splitlines():
            self._line(line.decode("utf-8", errors="replace"))

    def _line(self, line: str) -> None:
        if line == "":
            self._dispatch()
        elif line.startswith(":"):
            return  # SSE comment / keep-alive
        elif line.startswith("data:"):
            value = line[5:]
            self._data_lines.append(value[1:] if value.startswith(" ") else value)
        # `event:`, `id:`, `retry:` fields carry nothing the reassembly needs.

    def _dispatch(self) -> None:
        if not self._data_lines:
            return
        payload = "\n".join(self._data_lines)
        self._data_lines = []
        if payload.strip() == DONE_SENTINEL:
            self.done = True
            return
        try:
            chunk = loads_untrusted(payload, what="stream chunk", max_bytes=len(payload), max_depth=None)
        except UntrustedInputError:
            self.n_bad_chunks += 1
            return
        if not isinstance(chunk, dict):
            self.n_bad_chunks += 1
            return
        self.n_chunks += 1
        self._merge(chunk)

    def _merge(self, chunk: dict[str, Any]) -> None:
        if self._id is None and chunk.get("id"):
            self._id = chunk["id"]
        if self._model is None and chunk.get("model"):
            self._model = chunk["model"]
        if self._created is None and chunk.get("created") is not None:
            self._created = chunk["created"]
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        response = chunk.get("response")  # Responses API: `response.completed` (and others) carry the response
        if isinstance(response, dict) and response.get("usage") is not None:
            self._usage = response["usage"]
        if chunk.get("error") is not None and self._error is None:
            self._error = chunk["error"]
        for position, choice in enumerate(chunk.get("choices") or []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            self._choices.setdefault(index, _ChoiceAccumulator(index=index)).merge(choice)


def assemble_sse(raw: str | bytes) -> dict[str, Any]:
    """Reassemble a complete SSE stream (text or bytes) into a `chat.completion.reassembled` object."""
    assembler = SSEAssembler()
    assembler.feed(raw.encode("utf-8") if isinstance(raw, str) else raw)
    return assembler.result()


# An SSE event ends at a blank line; servers end lines with LF (vLLM, OpenAI) or CRLF.
EVENT_END = re.compile(rb"\r\n\r\n|\n\n")
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


class UsageChunkFilter:
    """What to relay of a stream whose usage chunk the agent did not ask for: everything but that chunk.

    `feed()` returns the bytes to send on now: whole events, minus any usage-only one; a partial event waits for its
    end (a client can use no event before its blank line, so this delays nothing it could read). `close()` returns
    the rest. Events are only parsed when they hold a `"usage": {` at all, so a stream costs a regex scan per read.
    """

    def __init__(self) -> None:
        self._pending = b""
        self.dropped = 0

    def feed(self, data: bytes) -> bytes:
        """The whole events that `data` completes, usage-only ones left out."""
        pending = self._pending + data if self._pending else bytes(data)
        end = 0
        for match in EVENT_END.finditer(pending, max(0, len(self._pending) - 3)):
            end = match.end()
        self._pending = pending[end:]
        return self._without_usage(pending[:end])

    def close(self) -> bytes:
        """What is left once the stream has ended (a last event without its blank line is kept as it is)."""
        rest, self._pending = self._pending, b""
        return self._without_usage(rest)

    def _without_usage(self, events: bytes) -> bytes:
        if not events or USAGE_OBJECT.search(events) is None:
            return events
        kept = []
        for event in _split_events(events):
            if USAGE_OBJECT.search(event) is not None and _usage_only(event):
                self.dropped += 1
                continue
            kept.append(event)
        return b"".join(kept)


def _split_events(data: bytes) -> list[bytes]:
    """`data` cut after each blank line (the pieces join back to `data`)."""
    pieces, start = [], 0
    for match in EVENT_END.finditer(data):
        pieces.append(data[start : match.end()])
        start = match.end()
    if start < len(data):
        pieces.append(data[start:])
    return pieces


def _usage_only(event: bytes) -> bool:
    """Whether the event is a chunk with no choices and a usage object (what `include_usage` adds at the end)."""
    lines = event.decode("utf-8", errors="replace").splitlines()
    payload = "\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))
    try:
        chunk = loads_untrusted(payload, what="stream chunk", max_bytes=len(payload), max_depth=None)
    except UntrustedInputError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)
