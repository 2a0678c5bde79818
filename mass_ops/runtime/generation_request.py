"""A generation request as the episode proxy forwards it (docs/proxy.md, "Budgets" and "Server priority").

`prepare_generation` reads the agent's body, refuses what the proxy cannot budget (GenerationRequestError, HTTP 400),
asks a stream for its usage, caps an uncapped request at the episode's default output, stamps the episode's
priority, and writes the body again as compact JSON so the server reads exactly what the proxy read. Its `need` is
the most tokens the request may use. Pure and picklable: large bodies run it in a worker (`body_parsers`).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any

from mass_ops.errors import InputError
from mass_ops.runtime.proxy_access import CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

PROMPT_BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class _RouteFields:
    """The request fields of one generation route that bound what the server may generate."""

    max_tokens: tuple[str, ...]  # caps on one sequence's output (the server obeys the largest it reads)
    added_max_tokens: str  # set to the episode's default output when the request sets none
    sequences: tuple[str, ...]  # multiply the sequences generated per prompt (n, best_of)
    stream_usage: bool  # a stream reports usage only when asked (`stream_options.include_usage`)
    refused: tuple[str, ...]  # make the server generate from state the proxy cannot see


_ROUTE_FIELDS = {
    CHAT_ROUTE: _RouteFields(("max_completion_tokens", "max_tokens"), "max_tokens", ("n", "best_of"), True, ()),
    COMPLETIONS_ROUTE: _RouteFields(("max_tokens",), "max_tokens", ("n", "best_of"), True, ()),
    RESPONSES_ROUTE: _RouteFields(
        ("max_output_tokens",),
        "max_output_tokens",
        (),
        False,
        ("background", "previous_response_id", "conversation", "prompt"),
    ),
}


class GenerationRequestError(InputError):
    """A generation request the proxy does not forward (HTTP 400): the one-line reason."""


@dataclass(frozen=True)
class GenerationRequest:
    """A generation request as the proxy forwards it."""

    body: bytes  # the body as forwarded: canonical JSON, so the server reads exactly the fields the proxy read
    need: int | None  # the most tokens it may use (prompt estimate + its output allowance); None without a budget
    usage_added: bool  # the proxy asked the stream for a usage chunk the agent did not ask for (the relay drops it)


def prepare_generation(
    route: str, body: bytes, *, default_max_tokens: int | None, priority: int | None
) -> GenerationRequest:
    """Read a generation request's body and return it as forwarded, with what it may spend.

    Refused (GenerationRequestError) when the body is no JSON object, an output cap is not a number of at least 1 or
    `n` / `best_of` not one of at least 0 (ints, floats and numeric strings are read, rounded up), `stream` is not a
    boolean, or the request would have the server generate from server-side state (Responses: background,
    previous_response_id, conversation, stored prompts, built-in tools). Forwarded with: a stream's
    `stream_options.include_usage` on; with a budget (`default_max_tokens`), an output cap of that size when the
    request sets none; `priority` when given. The body is written again as compact JSON, so duplicate keys or escapes
    cannot make the server read other values than the proxy. The need is the prompt estimate (forwarded bytes / 4)
    plus prompts x sequences (n, best_of) x the largest output cap.
    """
    try:
        # The body is already bounded by the proxy's request limit; the nesting is left to the parser's stack.
        document = loads_untrusted(body, what="request body", max_bytes=len(body), max_depth=None)
    except UntrustedInputError:
        raise GenerationRequestError("the body is not JSON the proxy can read") from None
    if not isinstance(document, dict):
        raise GenerationRequestError("the body is not a JSON object")
    fields = _ROUTE_FIELDS[route]
    for name in fields.refused:
        if document.get(name) not in (None, False):
            raise GenerationRequestError(
                f"`{name}` is not accepted by the episode proxy (the server would generate from state its budget "
                "cannot see)"
            )
    tools = document.get("tools") if route == RESPONSES_ROUTE else None
    if isinstance(tools, list) and any(not isinstance(tool, dict) or tool.get("type") != "function" for tool in tools):
        raise GenerationRequestError("only `function` tools are accepted by the episode proxy (built-in tools loop)")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GenerationRequestError("`stream` must be true or false")
    usage_added = False
    if stream and fields.stream_usage:
        options = document.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise GenerationRequestError("`stream_options` must be an object")
        if (options or {}).get("include_usage") is not True:
            document["stream_options"] = {**(options or {}), "include_usage": True}
            usage_added = True
    # A cap of 0 is refused: some servers read it as "no cap".
    caps = [_token_count(document, name, least=1) for name in fields.max_tokens if document.get(name) is not None]
    sequences = max([1, *(_token_count(document, name) for name in fields.sequences if document.get(name) is not None)])
    if default_max_tokens is not None and not caps:
        document[fields.added_max_tokens] = default_max_tokens
    if priority is not None:
        document["priority"] = int(priority)
    forwarded = _json_bytes(document)
    if default_max_tokens is None:
        return GenerationRequest(forwarded, None, usage_added)
    prompts = _prompt_count(document.get("prompt")) if route == COMPLETIONS_ROUTE else 1
    output = max(caps, default=default_max_tokens)
    need = -(-len(forwarded) // PROMPT_BYTES_PER_TOKEN) + prompts * sequences * output
    return GenerationRequest(forwarded, need, usage_added)


def _token_count(document: dict[str, Any], name: str, *, least: int = 0) -> int:
    """The request's `name` as a count of at least `least` (a float or numeric string rounded up);
    GenerationRequestError otherwise."""
    value = document[name]
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    number = math.nan
    if isinstance(value, float):
        number = value
    elif isinstance(value, str) and len(value) <= 64:
        with contextlib.suppress(ValueError):
            number = float(value.strip())
    if not math.isfinite(number) or math.ceil(number) < least or number < 0:
        shown = json.dumps(value)[:40] if isinstance(value, str | int | float | bool) else type(value).__name__
        raise GenerationRequestError(f"`{name}` must be a number of at least {least}, not {shown}")
    return math.ceil(number)


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions request: a list of strings or of token lists is a batch; anything else one prompt."""
    if isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        return len(prompt)
    return 1


def _json_bytes(document: dict[str, Any]) -> bytes:
    """`document` as compact JSON; non-ASCII text stays as it is unless it holds a lone surrogate (kept escaped)."""
    try:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii")
    except RecursionError:
        raise GenerationRequestError("the body is nested too deeply") from None
