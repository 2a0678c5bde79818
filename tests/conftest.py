"""Fixtures shared by the whole suite.

Postgres (the machine's server on 127.0.0.1:5432) and moto's standalone S3 server are real services; their
fixtures live in tests/fixtures/ and are registered here once for every test package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.s3"]
# The modules that run a whole cycle or a real Airflow scheduler: under xdist they form one group, run one after the
# other on one worker from the start, while the other worker takes the rest; two of them side by side would ask for
# far more than two cores at once (a trainer's ranks, model servers, Airflow's components).
WHOLE_SYSTEM_MODULES = (
    "tests/dags/test_cycle_e2e.py",
    "tests/deploy/test_browser.py",
    "tests/dags/test_backfill_scheduler.py",
    "tests/dags/test_promotion_gate.py",
    "tests/dags/test_dag_runs.py",
)
WHOLE_SYSTEM_GROUP = "whole-system"
_SCRATCH_MADE_BY = "MASS_TEST_SCRATCH_MADE_BY"  # the pid of the pytest process that made the episode scratch folder


def pytest_configure(config: object) -> None:
    """Run as from a terminal even when started as a background job: a non-interactive shell starts `cmd &` with
    SIGINT ignored, children inherit that, and the tests that Ctrl-C a child (`episode run`, the demo UI) would wait
    for a signal their child never sees. A Python handler is reset to the default in an exec'd child; SIG_IGN is not."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.mass_scratch = _private_episode_scratch()  # type: ignore[attr-defined]


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker (scripts/test.sh): the whole-system modules first. Every worker collects the same order,
    and the controller hands out work units in it (`pytest_xdist_make_scheduler`)."""
    import os

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    root = Path(__file__).resolve().parents[1]
    missing = [module for module in WHOLE_SYSTEM_MODULES if not (root / module).is_file()]
    if missing:  # a renamed module would silently run beside the others again
        raise pytest.UsageError(f"tests/conftest.py WHOLE_SYSTEM_MODULES names missing files: {', '.join(missing)}")
    items.sort(key=lambda item: _work_unit(item.nodeid) != WHOLE_SYSTEM_GROUP)  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `--dist loadfile`: each module is one work unit (its module fixtures are built once) and the
    whole-system modules are one unit together, handed out first; units go out in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WholeSystemFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection order: the whole-system unit first
    return WholeSystemFirst(config, log)


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return WHOLE_SYSTEM_GROUP if module in WHOLE_SYSTEM_MODULES else module
