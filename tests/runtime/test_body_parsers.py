"""Large generation bodies are prepared in a worker process, small ones on the loop; refusals come back the same."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from mass_ops.runtime import body_parsers
from mass_ops.runtime.generation_request import GenerationRequestError


def test_a_large_body_is_read_by_a_parser_process_and_a_small_one_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    handed_over: list[int] = []
    submit = body_parsers.BodyParsers.submit

    def counting_submit(call: Any) -> Any:
        handed_over.append(len(call.args[1]))
        return submit(call)

    monkeypatch.setattr(body_parsers.BodyParsers, "submit", staticmethod(counting_submit))
    large = json.dumps({"messages": [{"role": "user", "content": "x" * body_parsers.PARSE_PROCESS_BYTES}]}).encode()

    async def prepare(body: bytes) -> Any:
        return await body_parsers.prepare_generation_off_loop(
            "/chat/completions", body, default_max_tokens=8, priority=2
        )

    prepared = asyncio.run(prepare(large))
    assert json.loads(prepared.body)["priority"] == 2 and prepared.need is not None
    small = asyncio.run(prepare(b'{"messages": []}'))
    assert json.loads(small.body)["max_tokens"] == 8
    assert handed_over == [len(large)]
    with pytest.raises(GenerationRequestError, match="not a JSON object"):
        asyncio.run(prepare(b"[" + b" " * body_parsers.PARSE_PROCESS_BYTES + b"]"))  # the worker's refusal, re-raised
