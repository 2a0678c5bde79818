"""Fixtures shared by the whole suite.

Postgres (the machine's server on 127.0.0.1:5432) and moto's standalone S3 server are real services; their
fixtures live in tests/fixtures/ and are registered here once for every test package.
"""

from __future__ import annotations

import pytest

from tests.support.scheduling import heaviest_modules_first

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.s3"]
_SCRATCH_MADE_BY = "MASS_TEST_SCRATCH_MADE_BY"  # the pid of the pytest process that made the episode scratch folder


def pytest_configure(config: object) -> None:
    """Run as from a terminal even when started as a background job: a non-interactive shell starts `cmd &` with
    SIGINT ignored, children inherit that, and the tests that Ctrl-C a child (`episode run`, the demo UI) would wait
    for a signal their child never sees. A Python handler is reset to the default in an exec'd child; SIG_IGN is not."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.mass_scratch = _private_episode_scratch()  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The most expensive modules first (tests/support/scheduling.py): with `--no-loadscope-reorder`, pytest-xdist
    hands modules out in this order, so no whole-cycle module is left to start at the end. A bad `slow(seconds=)`
    ends the run with its one line, not a traceback."""
    try:
        items[:] = heaviest_modules_first(items)
    except ValueError as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_unconfigure(config: object) -> None:
    """Remove the scratch folder `pytest_configure` made for this process (what episodes left in it)."""
    import shutil

    scratch = getattr(config, "mass_scratch", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _private_episode_scratch() -> str | None:
    """Episodes work in `<tmp>/mass-episodes/<cycle>/<unit>` by default, and two cycles of the same name in one
    folder refuse each other (EpisodeBusyError). Every pytest process (an xdist worker too) gets its own scratch
    folder, inherited by what it starts (the demo's Airflow, its task processes), so that tests running side by
    side never share one. Returns the folder made, or None when one was set from outside (kept as it is)."""
    import os
    import tempfile

    from mass_ops.runtime.runner import SCRATCH_ENV

    made_by = os.environ.get(_SCRATCH_MADE_BY)  # set: an xdist worker inherited its controller's folder
    if os.environ.get(SCRATCH_ENV) and made_by in (None, str(os.getpid())):
        return None
    os.environ[SCRATCH_ENV] = folder = tempfile.mkdtemp(prefix="mass-episodes-")
    os.environ[_SCRATCH_MADE_BY] = str(os.getpid())
    return folder
