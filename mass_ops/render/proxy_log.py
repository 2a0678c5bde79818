"""An episode's proxy log (MASS_SPEC §4) read as the chat-completion exchanges that rendering uses.

The logging proxy writes one JSON record per HTTP request (`api_requests.jsonl`, gzipped after the episode). Only
successful chat completions matter here: path `/v1/chat/completions`, status 200 and a response with choices. A
response is either the upstream JSON completion or, for streams, the proxy's `chat.completion.reassembled` object;
both carry `choices[0].message` {content, reasoning_content, tool_calls} and `finish_reason`.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mass_ops.render.errors import RenderError
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
_GZIP_MAGIC = b"\x1f\x8b"
# One record holds a request the agent sent and the reply; far above the proxy's own request limit, and what
# one line may cost the renderer's memory however the (gzipped) log was made.
LOG_LINE_MAX_BYTES = 256 << 20

ProxyLogSource = bytes | bytearray | str | os.PathLike[str] | Iterable[Mapping[str, Any] | str | bytes]


@dataclass(frozen=True)
class Exchange:
    """One successful chat-completion call: the request the agent sent and the model's reply as a chat message."""

    seq: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: dict[str, Any]
    finish_reason: str | None


def iter_proxy_records(source: ProxyLogSource, *, where: str = "proxy log") -> Iterator[Mapping[str, Any]]:
    """Yield the records of a proxy log given as gz/plain bytes, a file path, or an iterable of records/lines.

    A line that is not a JSON object raises `RenderError` naming `where` and the line number.
    """
    if isinstance(source, bytes | bytearray):
        yield from _iter_lines(io.BytesIO(bytes(source)), where)
    elif isinstance(source, str | os.PathLike):
        with open(Path(source), "rb") as handle:
            yield from _iter_lines(handle, f"{where} ({source})")
    else:
        for number, item in enumerate(source, start=1):
            if isinstance(item, Mapping):
                yield item
            elif isinstance(item, str | bytes):
                if item.strip():
                    yield _parse_line(item, where, number)
            else:
                raise RenderError(f"{where}: record {number} is a {type(item).__name__}, not a JSON object or line")


def _iter_lines(handle: BinaryIO, where: str) -> Iterator[Mapping[str, Any]]:
    head = handle.read(2)
    handle.seek(0)
    stream: BinaryIO = gzip.GzipFile(fileobj=handle) if head == _GZIP_MAGIC else handle  # type: ignore[assignment]
    try:
        for number, line in enumerate(capped_lines(stream, where), start=1):
            if line.strip():
                yield _parse_line(line, where, number)
    except (OSError, EOFError) as exc:  # corrupt or truncated gzip member
        raise RenderError(f"{where}: unreadable compressed log ({type(exc).__name__}: {exc})") from exc


def capped_lines(stream: BinaryIO | io.BufferedIOBase, where: str) -> Iterator[bytes]:
    """The lines of a proxy log, each read only up to `LOG_LINE_MAX_BYTES` (RenderError naming `where` and the line
    beyond it): never more than one capped line in memory, however long a line the log holds."""
    number = 0
    while line := stream.readline(LOG_LINE_MAX_BYTES + 1):
        number += 1
        if len(line) > LOG_LINE_MAX_BYTES:
            raise RenderError(f"{where}: line {number} is over the {LOG_LINE_MAX_BYTES:,}-byte limit")
        yield line


def _parse_line(line: str | bytes, where: str, number: int) -> Mapping[str, Any]:
    try:
        record = loads_untrusted(line, what=f"{where}: line {number}", max_bytes=LOG_LINE_MAX_BYTES)
    except UntrustedInputError as exc:
        raise RenderError(str(exc)) from None
    if not isinstance(record, dict):
        raise RenderError(f"{where}: line {number} is a JSON {type(record).__name__}, not an object")
    return record


def is_chat_completion(record: Mapping[str, Any]) -> bool:
    """True for a record the renderer keeps: chat-completions path, HTTP 200, a response with choices."""
    path = record.get("path")
    if not isinstance(path, str) or path.split("?", 1)[0] != CHAT_COMPLETIONS_PATH:
        return False
    if record.get("status") != 200:
        return False
    response = record.get("response")
    return isinstance(response, Mapping) and isinstance(response.get("choices"), list) and bool(response["choices"])


def exchanges(source: ProxyLogSource, *, where: str = "proxy log") -> list[Exchange]:
    """The kept records of a proxy log as `Exchange`s, in file order (bulky fields such as raw SSE are dropped)."""
    kept: list[Exchange] = []
    for record in iter_proxy_records(source, where=where):
        if is_chat_completion(record):
            kept.append(_exchange(record, where))
    return kept


def _exchange(record: Mapping[str, Any], where: str) -> Exchange:
    seq = record.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise RenderError(f"{where}: a chat-completion record has no integer seq (got {seq!r})")
    request = record.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("messages"), list):
        raise RenderError(f"{where}: record seq={seq} has no parsed request with a messages list")
    messages = request["messages"]
    if not all(isinstance(message, dict) for message in messages):
        raise RenderError(f"{where}: record seq={seq} has a request message that is not an object")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RenderError(f"{where}: record seq={seq} has request tools that are not a list")
    choice = record["response"]["choices"][0]
    if not isinstance(choice, Mapping):
        raise RenderError(f"{where}: record seq={seq} has a response choice that is not an object")
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise RenderError(f"{where}: record seq={seq} has a response choice without a message")
    finish_reason = choice.get("finish_reason")
    return Exchange(
        seq=seq,
        messages=messages,
        tools=tools or None,
        reply=replay_message(message, where=f"{where} seq={seq}"),
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
    )


def replay_message(message: Mapping[str, Any], *, where: str = "response") -> dict[str, Any]:
    """The model's reply as the assistant message a client would send back: content ("" when none), reasoning
    (`reasoning_content`, else vLLM's newer `reasoning` field) and tool calls with string arguments."""
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise RenderError(f"{where}: response content is a {type(content).__name__}, not a string")
    reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RenderError(f"{where}: response reasoning is a {type(reasoning).__name__}, not a string")
        reply["reasoning_content"] = reasoning
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RenderError(f"{where}: response tool call without a function name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = ""
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    if calls:
        reply["tool_calls"] = calls
    return reply
