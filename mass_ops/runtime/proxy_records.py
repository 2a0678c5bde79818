"""One proxy exchange's log record and the append-only log it goes to (docs/proxy.md, "Relay and records").

`Exchange` holds what one request/response left behind; `to_record()` builds its JSONL record (the fields of
MASS_SPEC §4). `RecordLog` appends each record as one redacted line in one `os.write` on an O_APPEND descriptor, so
concurrent records never interleave and the upstream key never reaches the file. Building a record is pure: the
record writer process (`record_writer`) builds the very same record from `small_fields()` and the two bodies.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mass_ops.runtime.episode_budget import usage_tokens
from mass_ops.runtime.proxy_access import DEFAULT_KEY_VALUE, MIN_REDACTED_SECRET, REDACTION
from mass_ops.runtime.sse import SSEAssembler
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

# The only response headers logged: keys can travel in headers, and the log becomes training data and an artifact.
LOGGED_RESPONSE_HEADERS = ("content-type", "x-request-id")


@dataclass
class Exchange:
    """What one request/response exchange left behind; `to_record()` turns it into the log record."""

    seq: int
    method: str
    path: str
    ts_start: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    request_body: bytes = b""
    request_bytes: int = 0
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    assembler: SSEAssembler = field(default_factory=SSEAssembler)
    response_body: bytearray = field(default_factory=bytearray)
    response_bytes: int = 0
    duration_s: float = 0.0
    client_disconnected: bool = False
    proxy_error: str | None = None
    rejected: str | None = None  # why the proxy refused the request (token, route, size, body): never forwarded
    usage_added: bool = False  # the proxy asked the stream for usage; the agent was relayed the stream without it
    upstream_unreached: bool = False  # no connection to the upstream was made: it cannot have generated anything
    budget_need: int | None = None  # tokens held for this request by the episode's budget until it is settled
    budget_exhausted: dict[str, Any] | None = None  # the budget that refused it (never forwarded)

    def server_may_have_generated(self) -> bool:
        """Whether the upstream may have generated for this exchange: it was reached and did not refuse it (4xx)."""
        return not self.upstream_unreached and not (self.status is not None and 400 <= self.status < 500)

    def body_bytes(self) -> int:
        """Bytes of request and response body the record is built from."""
        return len(self.request_body) + (self.assembler.size if self.stream else len(self.response_body))

    def small_fields(self) -> dict[str, Any]:
        """The JSON-able fields `to_record()` reads besides the bodies (what the record writer is sent)."""
        return {name: getattr(self, name) for name in _SMALL_FIELDS}

    @classmethod
    def from_small_fields(cls, fields: dict[str, Any], request_body: bytes, payload: bytearray) -> Exchange:
        """The exchange `small_fields()` came from, given its request body and response body (or raw SSE)."""
        exchange = cls(**{name: fields[name] for name in _SMALL_FIELDS}, request_body=request_body)
        if exchange.stream:
            exchange.assembler.raw = payload
        else:
            exchange.response_body = payload
        return exchange

    def to_record(self, *, keep_raw_sse: bool) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ts_start": self.ts_start,
            "ts_start_iso": datetime.fromtimestamp(self.ts_start, UTC).isoformat(),
            "method": self.method,
            "path": self.path,
            "seq": self.seq,
            "request_bytes": self.request_bytes,
        }
        _put_body(record, "request", self.request_body)
        record["status"] = self.status
        record["response_headers"] = self.response_headers
        record["stream"] = self.stream
        record["response_bytes"] = self.response_bytes
        if self.stream:
            record["response"] = self.assembler.result()
            if keep_raw_sse:
                record["sse_raw"] = self.assembler.raw.decode("utf-8", errors="replace")
        elif self.proxy_error is None or self.response_body:
            _put_body(record, "response", bytes(self.response_body))
        else:
            record["response"] = None
        record["duration_s"] = round(self.duration_s, 6)
        if self.client_disconnected:
            record["client_disconnected"] = True
        if self.proxy_error is not None:
            record["proxy_error"] = self.proxy_error
        if self.rejected is not None:
            record["rejected"] = self.rejected
        if self.usage_added:
            record["proxy_added_usage"] = True
        if self.budget_exhausted is not None:
            record["budget_exhausted"] = self.budget_exhausted
        response = record.get("response")
        _total, cached = usage_tokens(response.get("usage") if isinstance(response, dict) else None)
        if cached is not None:
            record["cached_prompt_tokens"] = cached
        return record


_SMALL_FIELDS = (
    "seq",
    "method",
    "path",
    "ts_start",
    "request_bytes",
    "status",
    "response_headers",
    "stream",
    "response_bytes",
    "duration_s",
    "client_disconnected",
    "proxy_error",
    "rejected",
    "usage_added",
    "budget_exhausted",
)


def _put_body(record: dict[str, Any], key: str, body: bytes) -> None:
    """Store `body` as parsed JSON under `key`, else as text under `<key>_raw` (None for an empty body)."""
    if not body:
        record[key] = None
        return
    try:
        record[key] = loads_untrusted(body, what=key, max_bytes=len(body), max_depth=None)
    except UntrustedInputError:
        record[f"{key}_raw"] = body.decode("utf-8", errors="replace")


def redaction_needles(secret: str | None) -> tuple[bytes, ...]:
    """The byte forms of `secret` a JSON record can hold (raw and JSON-escaped); none for placeholders."""
    if not secret or secret == DEFAULT_KEY_VALUE or len(secret.encode()) < MIN_REDACTED_SECRET:
        return ()
    forms = {secret.encode("utf-8"), json.dumps(secret)[1:-1].encode("utf-8")}
    return tuple(sorted(forms, key=len, reverse=True))


def record_line(record: dict[str, Any], needles: Sequence[bytes]) -> bytes:
    """`record` as one redacted JSONL line."""
    data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    for needle in needles:
        data = data.replace(needle, REDACTION)
    return data


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of `data` to `fd` (os.write may take less than it is given)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class RecordLog:
    """Append-only JSONL file; one `os.write` per record so concurrent records never interleave."""

    def __init__(self, path: Path, *, redact: str | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.needles = redaction_needles(redact)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, record: dict[str, Any]) -> None:
        write_all(self._fd, record_line(record, self.needles))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
