"""Fixtures shared by the whole suite.

Postgres (the machine's server on 127.0.0.1:5432) and moto's standalone S3 server are real services; their
fixtures live in tests/fixtures/ and are registered here once for every test package.
"""

from __future__ import annotations

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.s3"]


def pytest_configure(config: object) -> None:
    """Run as from a terminal even when started as a background job: a non-interactive shell starts `cmd &` with
    SIGINT ignored, children inherit that, and the tests that Ctrl-C a child (`episode run`, the demo UI) would wait
    for a signal their child never sees. A Python handler is reset to the default in an exec'd child; SIG_IGN is not."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
