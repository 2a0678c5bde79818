"""Large generation bodies are prepared in worker processes, off the proxy's event loop (docs/proxy.md, "Routes").

A JSON parse holds the GIL, on a thread as on the loop: a 30 MB body read in the proxy's process would stall every
other stream it relays. `prepare_generation_off_loop` runs `prepare_generation` inline for a small body, in a
`BodyParsers` worker for one of `PARSE_PROCESS_BYTES` or more, and on a thread when no worker can run; its refusals
(GenerationRequestError) are raised as the inline call would raise them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mass_ops.runtime.generation_request import GenerationRequest, prepare_generation

logger = logging.getLogger(__name__)

# Bodies from this size on are parsed by a worker process: a JSON parse holds the GIL, on a thread as on the loop.
PARSE_PROCESS_BYTES = 256 * 1024
PARSE_PROCESSES = 2


class BodyParsers:
    """Worker processes that prepare large generation requests (`PARSE_PROCESS_BYTES`), shared by every proxy of
    this process and started on first use."""

    _pool: ProcessPoolExecutor | None = None
    _lock = threading.Lock()

    @classmethod
    def submit(cls, call: functools.partial[GenerationRequest]) -> Future[GenerationRequest]:
        """Start `call` in a worker (may block while the first workers start: call it off the loop)."""
        import multiprocessing

        with cls._lock:
            if cls._pool is None:
                # forkserver: forking this process (threads, an event loop) could copy a held lock into the child.
                context = multiprocessing.get_context("forkserver")
                cls._pool = ProcessPoolExecutor(max_workers=PARSE_PROCESSES, mp_context=context)
            return cls._pool.submit(call)

    @classmethod
    def discard(cls) -> None:
        """Drop a broken pool (the next large body starts a new one)."""
        with cls._lock:
            pool, cls._pool = cls._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


async def prepare_generation_off_loop(
    route: str, body: bytes, *, default_max_tokens: int | None, priority: int | None
) -> GenerationRequest:
    """`prepare_generation`, run in a worker process for a large body (inline for a small one, where the parse
    costs the loop less than the hand-off); on a thread if no worker can run."""
    call = functools.partial(prepare_generation, route, body, default_max_tokens=default_max_tokens, priority=priority)
    if len(body) < PARSE_PROCESS_BYTES:
        return call()
    try:
        future = await asyncio.to_thread(BodyParsers.submit, call)
        return await asyncio.wrap_future(future)
    except (BrokenProcessPool, OSError, RuntimeError) as exc:
        logger.warning("episode proxy: no body parser process (%s); parsing on a thread", type(exc).__name__)
        BodyParsers.discard()
        return await asyncio.to_thread(call)
