"""`python -m tests.policy_server --port 0 --port-file F ...`: the stand-in policy server as a subprocess."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import tempfile
from pathlib import Path

from tests.policy_server.faults import FaultRule
from tests.policy_server.policies import ResearchTeamPolicy
from tests.policy_server.server import PolicyServer, PolicyServerConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.policy_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = ephemeral (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here (atomically) once listening")
    parser.add_argument("--model", action="append", dest="models", help="served model name (repeatable)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each completion's first byte")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between SSE events")
    parser.add_argument("--capacity", type=int, help="completions processed at once (default unlimited)")
    parser.add_argument("--reasoning-field", default="reasoning_content", choices=["reasoning_content", "reasoning"])
    parser.add_argument("--judge-winner", default="seeded", choices=["seeded", "A", "B", "tie"])
    parser.add_argument("--fault", action="append", default=[], type=FaultRule.parse, help="e.g. http_503:requests=1")
    return parser


async def _serve(args: argparse.Namespace) -> None:
    config = PolicyServerConfig(
        models=tuple(args.models or PolicyServerConfig.models),
        latency_s=args.latency,
        chunk_delay_s=args.chunk_delay,
        capacity=args.capacity,
        reasoning_field=args.reasoning_field,
        faults=args.fault,
    )
    server = PolicyServer(config, ResearchTeamPolicy(judge_winner=args.judge_winner), host=args.host, port=args.port)
    await server.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    if args.port_file:
        args.port_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=args.port_file.parent, delete=False) as handle:
            handle.write(f"{server.port}\n")
        os.replace(handle.name, args.port_file)
    print(f"policy stand-in serving {', '.join(config.models)} on {server.base_url}", flush=True)
    try:
        await stopped.wait()
    finally:
        await server.stop()


def main() -> None:
    args = _parser().parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
