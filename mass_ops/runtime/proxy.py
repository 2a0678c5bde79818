"""Logging reverse proxy between the agent (qwen-code) and the model server; its log is the episode's trajectory.

This module is its command line and its public names; the design is in docs/proxy.md. `python -m
mass_ops.runtime.proxy --listen PORT --upstream URL --log PATH` runs an open, keyless `LoggingProxy` (a pod's keyed
one: `mass_ops.runtime.session_proxy`). The proxy is split by concern and every name importers use is re-exported
here: the server and relay (`proxy_server`), what the agent may send and present (`proxy_access`), generation
requests and their budget (`generation_request`, `body_parsers`, `episode_budget`), and the log records
(`proxy_records`, `record_writer`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from mass_ops.runtime.body_parsers import PARSE_PROCESS_BYTES, PARSE_PROCESSES, BodyParsers, prepare_generation_off_loop
from mass_ops.runtime.episode_budget import (
    BUDGET_ERROR_CODE,
    BUDGET_STATUS,
    EpisodeBudget,
    usage_cost,
    usage_tokens,
)
from mass_ops.runtime.generation_request import (
    PROMPT_BYTES_PER_TOKEN,
    GenerationRequest,
    GenerationRequestError,
    prepare_generation,
)
from mass_ops.runtime.proxy_access import (
    BEARER,
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    CREDENTIAL_HEADERS,
    DEFAULT_CLIENT_PATH,
    DEFAULT_KEY_VALUE,
    GENERATION_ROUTES,
    MAX_REQUEST_BYTES,
    MIN_REDACTED_SECRET,
    MODEL_ID,
    MODELS_ROUTE,
    REDACTION,
    RESPONSES_ROUTE,
    TOKEN_BYTES,
    ProxyConfigError,
    allowed_route,
    new_agent_token,
    upstream_key_from_env,
)
from mass_ops.runtime.proxy_records import LOGGED_RESPONSE_HEADERS, Exchange, RecordLog
from mass_ops.runtime.proxy_server import (
    CONNECT_TIMEOUT_S,
    HANDLER_DRAIN_S,
    HOP_BY_HOP_HEADERS,
    RELAY_READ_BUFFER,
    WHOLE_BODY_BYTES,
    LoggingProxy,
    ProxySessionError,
)
from mass_ops.runtime.record_writer import (
    RECORD_PROCESS_BYTES,
    RECORD_WRITER_FLAG,
    RECORD_WRITER_NICE,
    RecordWriter,
    RecordWriterError,
)
from mass_ops.runtime.record_writer import main as record_writer_main

__all__ = [
    "BEARER",
    "BUDGET_ERROR_CODE",
    "BUDGET_STATUS",
    "CHAT_ROUTE",
    "COMPLETIONS_ROUTE",
    "CONNECT_TIMEOUT_S",
    "CREDENTIAL_HEADERS",
    "DEFAULT_CLIENT_PATH",
    "DEFAULT_KEY_VALUE",
    "GENERATION_ROUTES",
    "HANDLER_DRAIN_S",
    "HOP_BY_HOP_HEADERS",
    "LOGGED_RESPONSE_HEADERS",
    "MAX_REQUEST_BYTES",
    "MIN_REDACTED_SECRET",
    "MODELS_ROUTE",
    "MODEL_ID",
    "PARSE_PROCESSES",
    "PARSE_PROCESS_BYTES",
    "PROMPT_BYTES_PER_TOKEN",
    "RECORD_PROCESS_BYTES",
    "RECORD_WRITER_FLAG",
    "RECORD_WRITER_NICE",
    "REDACTION",
    "RELAY_READ_BUFFER",
    "RESPONSES_ROUTE",
    "TOKEN_BYTES",
    "WHOLE_BODY_BYTES",
    "BodyParsers",
    "EpisodeBudget",
    "Exchange",
    "GenerationRequest",
    "GenerationRequestError",
    "LoggingProxy",
    "ProxyConfigError",
    "ProxySessionError",
    "RecordLog",
    "RecordWriter",
    "RecordWriterError",
    "add_route_arguments",
    "allowed_route",
    "main",
    "new_agent_token",
    "prepare_generation",
    "prepare_generation_off_loop",
    "run_proxy_main",
    "upstream_key_from_env",
    "usage_cost",
    "usage_tokens",
]


def _write_port_file(path: Path, port: int) -> None:
    """Write `port` to `path` atomically (a reader never sees a partial number)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(f"{port}\n")
    os.replace(handle.name, path)


async def _serve(args: argparse.Namespace) -> None:
    proxy = LoggingProxy(
        args.upstream[0],
        args.log,
        host=args.host,
        port=args.listen,
        keep_raw_sse=args.keep_raw_sse,
        request_priority=args.request_priority,
        client_path=args.client_path,
        max_request_bytes=args.max_request_bytes,
    )
    await proxy.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    if args.port_file:
        _write_port_file(Path(args.port_file), proxy.port)
    print(f"logging proxy on {proxy.url} -> {proxy.upstream_base_url}, log {proxy.log_path}", flush=True)
    try:
        await stopped.wait()
    finally:
        await proxy.stop()


def run_proxy_main(main: Coroutine[Any, Any, None]) -> None:
    """Run the proxy process's `main` on uvloop where it is installed (a relay's CPU per byte is mostly the event
    loop's), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's `--client-path` and `--max-request-bytes` (what the agent may send), for every proxy command."""
    parser.add_argument(
        "--client-path", default=DEFAULT_CLIENT_PATH, help="the path of the endpoint under which routes are allowed"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="larger request bodies get HTTP 413"
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m mass_ops.runtime.proxy --listen PORT --upstream URL --log PATH [--port-file F]
    [--request-priority N] [--client-path /v1] [--max-request-bytes N]`: an open, keyless logging proxy (a pod's
    keyed one: `mass_ops.runtime.session_proxy`)."""
    if (sys.argv[1:] if argv is None else argv) == [RECORD_WRITER_FLAG]:
        record_writer_main()  # the record writer's former command line
        return
    parser = argparse.ArgumentParser(prog="python -m mass_ops.runtime.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="port to bind (0 = ephemeral, see --port-file)")
    parser.add_argument("--upstream", action="append", required=True, help="model server base URL without /v1")
    parser.add_argument("--log", required=True, help="JSONL file the request records are appended to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--keep-raw-sse", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--request-priority", type=int, help="stamp this vLLM priority on every completion request (lower first)"
    )
    add_route_arguments(parser)
    args = parser.parse_args(argv)
    if len(args.upstream) > 1:
        parser.error("one --upstream (several go with a pod's session proxy: python -m mass_ops.runtime.session_proxy)")
    with contextlib.suppress(KeyboardInterrupt):
        try:
            run_proxy_main(_serve(args))
        except ProxyConfigError as exc:
            parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    main()
