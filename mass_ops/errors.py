"""The one error root of mass-ops, and what each kind of failure means for a command's exit status.

Every error mass-ops raises on purpose derives from `MassOpsError` through one of two branches:

- `InputError` — the user's input is wrong (a config, a task folder, a proxy log, a command's arguments, a model's
  output that a stage cannot use). Fixing the input fixes the run. Commands exit with status 2.
- `InfrastructureError` — the input is fine but something the run depends on failed (a store that does not answer,
  a model server that is down, a unit that failed after its retries). Rerunning later may succeed. Exit status 1.

Both keep the standard base they had before the hierarchy existed (`ValueError` for input, `RuntimeError` for
infrastructure) so that callers catching those still work; the CLI maps exit codes from *this* hierarchy only, so a
stray `ValueError` from a library is reported as an internal error, never as "bad input".
"""

from __future__ import annotations

EXIT_INPUT = 2
EXIT_FAILURE = 1


class MassOpsError(Exception):
    """Root of every error mass-ops raises on purpose; `exit_code` is what a command exits with."""

    exit_code: int = EXIT_FAILURE


class InputError(MassOpsError, ValueError):
    """Bad input: a config, a file, an argument or a model output that cannot be used as it is (exit 2)."""

    exit_code = EXIT_INPUT


class InfrastructureError(MassOpsError, RuntimeError):
    """A dependency failed or a unit could not be completed; the input may well be fine (exit 1)."""

    exit_code = EXIT_FAILURE


def exit_code_for(exc: BaseException) -> int | None:
    """The exit status a command should end with for `exc`, or None when it is not a mass-ops error."""
    if isinstance(exc, MassOpsError):
        return exc.exit_code
    return None


def first_line(exc: BaseException) -> str:
    """The first non-empty line of `exc`'s message (its type name when the message is empty): what a one-line
    report or a record shows of an error whose text may run over many lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
