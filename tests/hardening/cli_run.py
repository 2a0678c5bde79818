"""Run the real `mass-ops` command as a user would, fenced so that a regression fails the test, not the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The console script installed next to the interpreter running the tests (the project's virtualenv).
MASS_OPS = Path(sys.executable).with_name("mass-ops")
# A hang fails the test after this long; nothing here should take more than a few seconds.
TIMEOUT_S = 60
# A command that starts expanding a hostile input dies at this address-space size instead of taking the machine
# with it (a normal command stays far below).
MEMORY_LIMIT_BYTES = 2 << 30


@dataclass(frozen=True)
class Result:
    """Exit status and the non-empty lines a command printed."""

    returncode: int
    stdout: str
    stderr_lines: list[str]


def _fence() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def run_cli(*args: str, cwd: Path) -> Result:
    """`mass-ops ARGS` in `cwd` (so any file it wrongly writes lands in the test's folder)."""
    done = subprocess.run(
        [str(MASS_OPS), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
        preexec_fn=_fence,
        check=False,
    )
    return Result(done.returncode, done.stdout, [line for line in done.stderr.splitlines() if line.strip()])
