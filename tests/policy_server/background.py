"""An asyncio event loop on a background thread, so synchronous tests can host aiohttp servers.

with EventLoopThread() as loop:
    server = loop.run(start_policy_server(PolicyServerConfig()))
    ...  # talk to server.base_url from blocking code or subprocesses
    loop.run(server.stop())
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """Runs one event loop on a daemon thread; `run()` executes a coroutine there and returns its result."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="policy-server-loop", daemon=True)

    def __enter__(self) -> EventLoopThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
