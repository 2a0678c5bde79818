"""Process-group supervision: start a command in its own session, signal and stop its whole group, reap it.

Contract: `start_in_session` starts `argv` as the leader of a new session and process group (pgid == pid), so one
signal reaches every process it starts; with `die_with_parent` (Linux) the leader also gets SIGTERM when the process
that started it dies, however it dies. `stop_group` sends SIGTERM (`term_signals` times, spread over `grace_s`),
then SIGKILL to what still runs, waiting at most `kill_wait_s` more; it reaps our own child meanwhile so no zombie
is left, and reports the signals sent and the processes SIGKILL had to end. Signals to a group that is gone (or not
ours) are ignored: stopping is idempotent. Nothing here knows about model servers, episodes or training.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.1


@dataclass(frozen=True)
class GroupStop:
    """How a process group was stopped: the signals sent, in order (empty when it was already gone), and the pids
    still running when SIGKILL was needed."""

    signals: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    described: list[str] = field(default_factory=list)  # `describe` of each killed pid, read before the SIGKILL


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time in clock ticks) from /proc/<pid>/stat; None without /proc or pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing parenthesis.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False when the group is gone or not ours to signal."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies waiting to be reaped do not count)."""
    if not signal_group(pgid, 0):
        return False
    return bool(group_members(pgid)) if Path("/proc").is_dir() else True  # without /proc: the signal check


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of group `pgid` (from /proc; where it is missing, [pgid] while it answers)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return [pgid] if signal_group(pgid, 0) else []
    members = []
    for entry in proc.iterdir():
        stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def reap(pid: int) -> None:
    """Collect the exit status of `pid` when it is our own exited child, so it does not stay a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` giving the child `sig` when the process that started it dies (Linux `PR_SET_PDEATHSIG`);
    None where the kernel has no such call. The C function is resolved before the fork (one system call after it);
    a child whose parent already died exits at once, since nobody would stop it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def start_in_session(
    argv: Sequence[str],
    *,
    stdout: IO[Any] | int | None,
    stderr: IO[Any] | int | None = subprocess.STDOUT,
    stdin: IO[Any] | int | None = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    die_with_parent: bool = False,
    pass_fds: Sequence[int] = (),
    text: bool = False,
    bufsize: int = -1,
) -> subprocess.Popen[Any]:
    """Start `argv` as the leader of a new session and process group (its pgid is its pid); OSError when it cannot
    start. `text` decodes its pipes (errors replaced)."""
    return subprocess.Popen(
        list(argv),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=parent_death_signal() if die_with_parent else None,
        text=text,
        errors="replace" if text else None,
        bufsize=bufsize,
    )


def _wait(running: Callable[[], bool], pid: int | None, wait_s: float) -> bool:
    """Wait until `running()` is False (reaping `pid` meanwhile) or `wait_s` passes; whether it stopped."""
    deadline = time.monotonic() + wait_s
    while running():
        if time.monotonic() >= deadline:
            return False
        if pid is not None:
            reap(pid)
        time.sleep(POLL_S)
    return True


def stop_group(
    pgid: int,
    *,
    grace_s: float,
    kill_wait_s: float = 10.0,
    term_signals: int = 1,
    running: Callable[[], bool] | None = None,
    leader: int | None = None,
    describe: Callable[[int], str] | None = None,
) -> GroupStop:
    """Stop group `pgid`: SIGTERM `term_signals` times (each followed by an equal share of `grace_s`), then SIGKILL
    what still runs and wait up to `kill_wait_s`. `running` says whether it still runs (default: its leader lives);
    `leader` is a pid of ours to reap while waiting (default: `pgid`); `describe` names what SIGKILL had to end."""
    alive = running or (lambda: group_alive(pgid))
    pid = pgid if leader is None else leader
    sent: list[str] = []
    for _ in range(max(1, term_signals)):
        if not alive():
            return GroupStop(sent, [])
        signal_group(pgid, signal.SIGTERM)
        sent.append(signal.SIGTERM.name)
        if _wait(alive, pid, grace_s / max(1, term_signals)):
            return GroupStop(sent, [])
    killed = group_members(pgid)
    described = [describe(member) for member in killed] if describe else []  # while /proc still shows them
    signal_group(pgid, signal.SIGKILL)
    _wait(alive, pid, kill_wait_s)
    return GroupStop([*sent, signal.SIGKILL.name], killed, described)


def stop_child(process: subprocess.Popen[Any], *, grace_s: float) -> GroupStop:
    """Stop our child `process` and the group it leads: SIGTERM to the group, SIGKILL when the child has not exited
    after `grace_s`, each time waiting on the child itself (which reaps it). The group is signalled even when the
    child already exited: processes it started may still run."""
    sent: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_group(process.pid, sig)
        sent.append(sig.name)
        try:
            process.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return GroupStop(sent, [])
