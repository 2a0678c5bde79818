"""The agent process of one attempt: its command line, its launch, its limits and the end of all it started.

`qwen --model M --approval-mode yolo --output-format stream-json` runs in the workspace, prompt on stdin, in its own
session (process group), optionally inside the bubblewrap sandbox (`agent_argv`). `run_agent` enforces the episode
wall-clock limit (none when null, as in the reference) by stopping the whole group: TERM, grace, KILL. Leftovers —
background jobs, and anything that left the group but kept the environment's scope marker (`kill_scope`) — are
killed when the agent ends; in the sandbox every process of the attempt lives in its PID namespace and ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mass_ops.compute.processes import signal_group
from mass_ops.compute.sandbox import proxy_socket_dir, runtime_paths, sandboxed_argv
from mass_ops.runtime.agent_environment import SCOPE_ENV
from mass_ops.runtime.attempt_folder import AttemptPaths
from mass_ops.runtime.qwen_install import QwenInstall

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentRun:
    """How the agent process ended."""

    exit_code: int | None
    terminated_by: str | None
    duration_s: float


def kill_scope(scope: str) -> int:
    """SIGKILL every process whose environment carries `MASS_EPISODE_SCOPE=<scope>` (Linux /proc); returns count.

    Catches what left the agent's process group (`setsid`, daemonizing tools) but kept the inherited environment.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    marker = f"{SCOPE_ENV}={scope}".encode()
    killed = 0
    for _round in range(5):  # a dying parent can fork once more; a few rounds settle it
        found = 0
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
        killed += found
        if not found:
            break
        time.sleep(0.05)
    return killed


def agent_argv(install: QwenInstall, model: str, paths: AttemptPaths, *, bwrap: str | None, egress: bool) -> list[str]:
    """The agent's command line; with `bwrap` (the sandbox's binary) wrapped in the attempt's sandbox, whose network
    reaches public addresses through the egress proxy when `egress`."""
    argv = install.argv("--model", model, "--approval-mode", "yolo", "--output-format", "stream-json")
    if bwrap is None:
        return argv
    # Everything of the attempt lives in the sandbox's PID namespace: killing bwrap (its session's leader
    # below) or the agent's end takes every process of the attempt with it.
    return sandboxed_argv(
        argv,
        bwrap=bwrap,
        workspace=paths.workspace,
        home=paths.home,
        tmp=paths.tmp,
        socket_dir=proxy_socket_dir(paths.root),
        runtime=runtime_paths(install.node_bin, install.qwen_entry),
        egress=egress,
    )


async def run_agent(
    argv: Sequence[str],
    paths: AttemptPaths,
    env: dict[str, str],
    scope: str,
    *,
    wall_clock_s: int | None,
    kill_grace_s: float,
) -> AgentRun:
    """Run `argv` in the workspace (prompt on stdin, stream and stderr to the attempt's logs) until it ends or
    `wall_clock_s` passes; then, or when cancelled, stop its group. Returns how it ended."""
    started = time.monotonic()
    with paths.prompt.open("rb") as stdin, paths.stream.open("wb") as stdout, paths.stderr.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=paths.workspace,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group: one signal reaches shells and subagents too
        )
    terminated_by = None
    try:
        # No limit (None) waits for the agent however long it runs, as the reference does.
        await asyncio.wait_for(process.wait(), timeout=wall_clock_s)
    except TimeoutError:
        terminated_by = "wall_clock"
        logger.warning(
            "episode agent pid %d exceeded the wall-clock limit of %d s: stopping", process.pid, wall_clock_s
        )
        await stop_group(process, kill_grace_s)
    except BaseException:
        await stop_group(process, kill_grace_s)
        raise
    finally:
        # Background jobs the agent left running belong to the episode and end with it.
        signal_group(process.pid, signal.SIGKILL)
        await asyncio.to_thread(kill_scope, scope)
    return AgentRun(process.returncode, terminated_by, time.monotonic() - started)


async def stop_group(process: asyncio.subprocess.Process, kill_grace_s: float) -> None:
    """TERM the agent's process group, KILL it after the grace period (or if interrupted meanwhile)."""
    signal_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout=kill_grace_s)
    except TimeoutError:
        pass
    finally:
        signal_group(process.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), timeout=kill_grace_s)
