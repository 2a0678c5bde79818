"""Large proxy records are built by a child process, not on a thread of the relay (docs/proxy.md).

`append_record` appends an exchange's record to its log and returns the response's usage for the budget. A record of
`RECORD_PROCESS_BYTES` or more goes to `RecordWriter`, one child process per proxy process (`python -m
mass_ops.runtime.record_writer`) at a lower CPU priority: on a thread its seconds of Python would hold the GIL the
relay needs. The child builds the very record the thread would (`Exchange.to_record`); if it cannot start or fails,
the record is built here instead, so none is lost.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from mass_ops.runtime.proxy_records import Exchange, RecordLog, record_line, write_all

logger = logging.getLogger(__name__)

# Records whose request + response bodies reach this size are built by the record writer process, not on a thread
# (about 10 ms of Python per 256 KiB of SSE: below this a thread's GIL hold costs the relay less than the hand-off).
RECORD_PROCESS_BYTES = 256 * 1024
RECORD_WRITER_NICE = 10  # the writer yields the CPU to the relay: a record can wait, a stream cannot
RECORD_WRITER_FLAG = "--record-writer"  # `python -m mass_ops.runtime.proxy --record-writer` runs `main` too
WRITER_EXIT_S = 5.0  # how long close() waits for the child to exit on end of input before killing it


class RecordWriterError(Exception):
    """The record writer process is gone or broke the protocol (the caller builds the record itself)."""


def append_record(log: RecordLog, exchange: Exchange, *, keep_raw_sse: bool) -> Any:
    """Append `exchange`'s record to `log` (large ones by the record writer); returns the response's usage."""
    if exchange.body_bytes() >= RECORD_PROCESS_BYTES:
        writer = RecordWriter.shared()
        if writer is not None:
            try:
                return writer.append(log, exchange, keep_raw_sse=keep_raw_sse)
            except RecordWriterError as exc:
                logger.warning("episode proxy: record writer failed (%s); record %d built here", exc, exchange.seq)
    record = exchange.to_record(keep_raw_sse=keep_raw_sse)
    log.append(record)
    response = record.get("response")
    return response.get("usage") if isinstance(response, dict) else None


class RecordWriter:
    """A child process that builds and appends large records; one per proxy process.

    Protocol on its stdin/stdout, one exchange at a time: the parent sends a frame `!III` (header, request body and
    response payload lengths) + a JSON header (log path, redaction needles, the exchange's small fields) + the two
    payloads; the child appends the record to the log and answers `!I` + JSON `{"usage": ...}` (the response's usage,
    for the budget) or `{"error": "<class name>"}` when it could not build or write the record.
    """

    _shared: RecordWriter | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mass_ops.runtime.record_writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._to_child = self._process.stdin.fileno()
        self._from_child = self._process.stdout.fileno()
        self._lock = threading.Lock()
        self.broken = False

    @classmethod
    def shared(cls) -> RecordWriter | None:
        """This process's writer, started on first use (and again if it broke); None if it cannot start."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared.broken:
                try:
                    cls._shared = cls()
                except OSError as exc:
                    logger.warning("episode proxy: no record writer process (%s); records built on threads", exc)
                    return None
                atexit.register(cls._shared.close)
            return cls._shared

    def append(self, log: RecordLog, exchange: Exchange, *, keep_raw_sse: bool) -> Any:
        """Have the child append `exchange`'s record to `log`; returns the response's usage. RecordWriterError."""
        # A stream's pieces go to the child one by one: joining 50 MB here would hold this process's GIL meanwhile.
        payload = exchange.assembler.pieces() if exchange.stream else [exchange.response_body]
        payload_size = sum(len(piece) for piece in payload)
        header = json.dumps(
            {
                "log": str(log.path),
                "needles": [needle.decode("utf-8") for needle in log.needles],
                "keep_raw_sse": keep_raw_sse,
                "exchange": exchange.small_fields(),
            }
        ).encode("utf-8")
        with self._lock:
            if self.broken:
                raise RecordWriterError("record writer already failed")
            try:
                write_all(self._to_child, struct.pack("!III", len(header), len(exchange.request_body), payload_size))
                for part in (header, exchange.request_body, *payload):
                    write_all(self._to_child, part)
                (size,) = struct.unpack("!I", _read_exactly(self._from_child, 4))
                answer = json.loads(_read_exactly(self._from_child, size))
            except (OSError, ValueError, struct.error) as exc:
                self.broken = True
                self.close()
                raise RecordWriterError(type(exc).__name__) from None
        if not isinstance(answer, dict) or "error" in answer:
            # The child wrote nothing (it answers only after a whole write, or instead of one).
            error = answer.get("error") if isinstance(answer, dict) else "malformed answer"
            raise RecordWriterError(str(error))
        return answer.get("usage")

    def close(self) -> None:
        """End the child (it exits on end of input) and reap it."""
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(timeout=WRITER_EXIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


def _read_exactly(fd: int, size: int) -> bytearray:
    """`size` bytes from `fd`; OSError when the pipe ends first."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise OSError("record writer pipe closed")
        data += chunk
    return data


def main() -> None:
    """The record writer process: read frames from stdin, append records, answer on stdout (`RecordWriter`)."""
    with contextlib.suppress(OSError):
        os.nice(RECORD_WRITER_NICE)
    requests, answers = 0, os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the answers
    while True:
        try:
            head = _read_exactly(requests, 12)
        except OSError:
            return  # the parent closed the pipe (or exited): no record can be pending
        header_size, request_size, payload_size = struct.unpack("!III", head)
        header = json.loads(_read_exactly(requests, header_size))
        request_body = bytes(_read_exactly(requests, request_size))
        payload = _read_exactly(requests, payload_size)
        try:
            exchange = Exchange.from_small_fields(header["exchange"], request_body, payload)
            record = exchange.to_record(keep_raw_sse=header["keep_raw_sse"])
            line = record_line(record, [needle.encode("utf-8") for needle in header["needles"]])
            fd = os.open(header["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                write_all(fd, line)
            finally:
                os.close(fd)
            response = record.get("response")
            answer: dict[str, Any] = {"usage": response.get("usage") if isinstance(response, dict) else None}
        except Exception as exc:  # the parent builds this record itself; the writer serves the next one
            answer = {"error": type(exc).__name__}
        data = json.dumps(answer).encode("utf-8")
        write_all(answers, struct.pack("!I", len(data)) + data)


if __name__ == "__main__":
    main()
