"""aiohttp OpenAI-compatible server whose answers come from a scripted policy (a named stand-in for the LLM).

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` (streaming and non-streaming, usage in every
response, `stream_options.include_usage` honoured), `GET /stats` (counters, for tests and benchmarks).
Streams are shaped like vLLM's: a role chunk, `reasoning_content` deltas, `content` deltas, tool calls whose
`arguments` arrive in several fragments, a finish chunk, an optional usage chunk, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.policy_server.faults import Fault, FaultRule
from tests.policy_server.policies import (
    ChatRequest,
    Policy,
    PolicyReply,
    RequestKind,
    ResearchTeamPolicy,
    classify_request,
)


@dataclass
class PolicyServerConfig:
    """Knobs of the stand-in server.

    models: served names (the first is the default when a request names none).
    latency_s: delay before the first byte of each completion, spent holding a capacity slot.
    chunk_delay_s: pause between SSE events. chunk_chars: text characters per content/reasoning delta.
    capacity: completions processed at once; excess requests wait for a slot (None = unlimited).
    reasoning_field: delta key for reasoning text ("reasoning_content" like vLLM/transformers, or "reasoning").
    """

    models: tuple[str, ...] = ("policy-stand-in",)
    latency_s: float = 0.0
    chunk_delay_s: float = 0.0
    chunk_chars: int = 24
    argument_fragments: int = 4
    capacity: int | None = None
    reasoning_field: str = "reasoning_content"
    faults: list[FaultRule] = field(default_factory=list)


@dataclass
class ServerStats:
    requests_total: int = 0
    chat_requests: int = 0
    models_requests: int = 0
    active: int = 0
    waiting: int = 0
    peak_active: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    faults_fired: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "chat_requests": self.chat_requests,
            "models_requests": self.models_requests,
            "active": self.active,
            "waiting": self.waiting,
            "peak_active": self.peak_active,
            "by_kind": dict(self.by_kind),
            "faults_fired": dict(self.faults_fired),
        }


def estimate_tokens(text: str) -> int:
    """Token estimate used for usage accounting: ceil(chars / 4), at least 1."""
    return max(1, math.ceil(len(text) / 4))


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _fragments(text: str, count: int) -> list[str]:
    """`text` cut into `count` non-empty pieces (fewer if shorter), as streamed tool-call arguments are."""
    count = max(1, min(count, len(text)))
    step = math.ceil(len(text) / count)
    return [text[i : i + step] for i in range(0, len(text), step)] or [""]


class PolicyServer:
    """The stand-in server. `await start()` / `await stop()` (or `async with`); `base_url` ends without `/v1`."""

    def __init__(
        self,
        config: PolicyServerConfig | None = None,
        policy: Policy | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.config = config or PolicyServerConfig()
        self.policy: Policy = policy or ResearchTeamPolicy()
        self.host = host
        self.stats = ServerStats()
        self.requests: list[dict[str, Any]] = []  # bodies of chat requests, in arrival order
        self._requested_port = port
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._slots: asyncio.Semaphore | None = None
        self._ids = itertools.count(1)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("PolicyServer.port read before start()")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        if self.config.capacity is not None:
            self._slots = asyncio.Semaphore(self.config.capacity)
        app = web.Application(client_max_size=1024**3)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> PolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- endpoints --------------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.stats.requests_total += 1
        return web.json_response({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.as_dict())

    async def _models(self, request: web.Request) -> web.Response:
        self.stats.requests_total += 1
        self.stats.models_requests += 1
        rule = self._fire(self.stats.models_requests, None, only={Fault.MODEL_NOT_LISTED})
        names = () if rule else self.config.models
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "mass-ops-tests"} for name in names]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests_total += 1
        self.stats.chat_requests += 1
        number = self.stats.chat_requests
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON", "BadRequestError")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "request body needs a `messages` list", "BadRequestError")
        model = body.get("model") or self.config.models[0]
        if model not in self.config.models:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        self.requests.append(body)
        kind = classify_request(body)
        self.stats.by_kind[kind.value] += 1
        rule = self._fire(number, kind, exclude={Fault.MODEL_NOT_LISTED})

        if rule is not None and rule.fault is Fault.CONNECTION_RESET:
            _reset_connection(request)
            return web.Response(status=500)  # never delivered: the socket is gone
        if rule is not None and rule.fault is Fault.HTTP_503:  # an overloaded server refuses without queueing
            return _error(503, "Service Unavailable: injected fault", "ServiceUnavailableError")
        async with _Slot(self):
            if self.config.latency_s:
                await asyncio.sleep(self.config.latency_s)
            reply = _apply_content_fault(self.policy.respond(ChatRequest(body=body, kind=kind)), rule)
            completion = _Completion(self, body, model, reply)
            if body.get("stream"):
                return await self._stream(request, completion, rule)
            return await self._whole(request, completion, rule)

    async def _whole(self, request: web.Request, completion: _Completion, rule: FaultRule | None) -> web.StreamResponse:
        payload = json.dumps(completion.whole()).encode("utf-8")
        if rule is not None and rule.fault is Fault.STALL:
            await asyncio.sleep(rule.stall_s)
        if rule is not None and rule.fault is Fault.STREAM_CUT:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            _close_connection(request)
            return response
        return web.Response(body=payload, content_type="application/json")

    async def _stream(
        self, request: web.Request, completion: _Completion, rule: FaultRule | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        events = completion.stream_events()
        for sent, event in enumerate(events):
            if rule is not None and sent == rule.after_chunks and rule.fault in (Fault.STREAM_CUT, Fault.STALL):
                if rule.fault is Fault.STALL:
                    await asyncio.sleep(rule.stall_s)
                _close_connection(request)
                return response
            if sent and self.config.chunk_delay_s:
                await asyncio.sleep(self.config.chunk_delay_s)
            await response.write(event)
        await response.write_eof()
        return response

    def _fire(
        self,
        number: int,
        kind: RequestKind | None,
        only: set[Fault] | None = None,
        exclude: set[Fault] | None = None,
    ) -> FaultRule | None:
        for rule in self.config.faults:
            if only is not None and rule.fault not in only:
                continue
            if exclude is not None and rule.fault in exclude:
                continue
            if rule.matches(number, kind):
                rule.fired += 1
                self.stats.faults_fired[rule.fault.value] += 1
                return rule
        return None


class _Slot:
    """Capacity slot: excess requests wait here, counted as `waiting`."""

    def __init__(self, server: PolicyServer) -> None:
        self._server = server

    async def __aenter__(self) -> None:
        stats = self._server.stats
        stats.waiting += 1
        try:
            if self._server._slots is not None:
                await self._server._slots.acquire()
        finally:
            stats.waiting -= 1
        stats.active += 1
        stats.peak_active = max(stats.peak_active, stats.active)

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.stats.active -= 1
        if self._server._slots is not None:
            self._server._slots.release()


class _Completion:
    """Renders one policy reply as a chat.completion or as SSE events."""

    def __init__(self, server: PolicyServer, body: dict[str, Any], model: str, reply: PolicyReply) -> None:
        self._config = server.config
        self._body = body
        self._model = model
        self._reply = reply
        serial = next(server._ids)
        self._id = f"chatcmpl-standin-{serial:06d}"
        self._created = int(time.time())
        self._arguments = [json.dumps(call.arguments, ensure_ascii=False) for call in reply.tool_calls]
        self._call_ids = [f"call_{serial:06d}_{i}" for i in range(len(reply.tool_calls))]

    def usage(self) -> dict[str, int]:
        prompt = estimate_tokens(json.dumps(self._body.get("messages"), ensure_ascii=False))
        generated = (self._reply.reasoning or "") + self._reply.content + "".join(self._arguments)
        completion = estimate_tokens(generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self._reply.content if (self._reply.content or not self._reply.tool_calls) else None,
        }
        if self._reply.reasoning is not None:
            message[self._config.reasoning_field] = self._reply.reasoning
        if self._reply.tool_calls:
            message["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
                for call_id, call, arguments in zip(
                    self._call_ids, self._reply.tool_calls, self._arguments, strict=True
                )
            ]
        return {
            "id": self._id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "message": message, "finish_reason": self._reply.effective_finish_reason}],
            "usage": self.usage(),
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def stream_events(self) -> list[bytes]:
        """All SSE events of the streamed reply, each `data: …\\n\\n` encoded."""
        reply, size = self._reply, self._config.chunk_chars
        chunks = [self._chunk({"role": "assistant", "content": ""})]
        if reply.reasoning:
            chunks += [self._chunk({self._config.reasoning_field: piece}) for piece in _split(reply.reasoning, size)]
        if reply.content:
            chunks += [self._chunk({"content": piece}) for piece in _split(reply.content, size)]
        for index, (call, call_id, arguments) in enumerate(
            zip(reply.tool_calls, self._call_ids, self._arguments, strict=True)
        ):
            head = {"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            chunks.append(self._chunk({"tool_calls": [head]}))
            chunks += [
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                for piece in _fragments(arguments, self._config.argument_fragments)
            ]
        chunks.append(self._chunk({}, reply.effective_finish_reason))
        if (self._body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = self._chunk({})
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self.usage()
            chunks.append(usage_chunk)
        events = [b"data: " + json.dumps(c, ensure_ascii=False).encode("utf-8") + b"\n\n" for c in chunks]
        return [*events, b"data: [DONE]\n\n"]


def _apply_content_fault(reply: PolicyReply, rule: FaultRule | None) -> PolicyReply:
    if rule is None:
        return reply
    if rule.fault is Fault.INVALID_JSON:
        broken = reply.content[: max(1, len(reply.content) // 2)] if reply.content.startswith("{") else '{"winner": '
        return PolicyReply(content=broken, reasoning=reply.reasoning, finish_reason="stop")
    if rule.fault is Fault.WRONG_SCHEMA:
        return PolicyReply(content=json.dumps({"verdict": "unclear"}), reasoning=reply.reasoning, finish_reason="stop")
    if rule.fault is Fault.EMPTY_CONTENT:
        return PolicyReply(content="", reasoning=reply.reasoning or "Thinking…", finish_reason="length")
    return reply


def _error(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": error_type, "code": status}}, status=status)


def _close_connection(request: web.Request) -> None:
    """Close after flushing what was written: the client sees a body cut short (no terminating chunk)."""
    if request.transport is not None:
        request.transport.close()


def _reset_connection(request: web.Request) -> None:
    """Drop the connection with a TCP RST (SO_LINGER 0), as a crashing server or a middlebox would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
