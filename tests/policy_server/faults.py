"""Fault injection rules for the stand-in policy server.

A rule names a fault and when it fires: on given request numbers (1-based, counted per endpoint: chat completions,
or `/v1/models` for `model_not_listed`), on a request kind, at most `times` times. The first matching rule wins.
Text form (CLI `--fault`): `KIND[:key=value,...]`, keys `requests` (`1+3+4`), `kind`, `times`, `after_chunks`,
`stall_s`; e.g. `http_503:requests=1+2`, `stream_cut:kind=orchestrator,times=1,after_chunks=4`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from tests.policy_server.policies import RequestKind


class Fault(StrEnum):
    HTTP_503 = "http_503"  # 503 with an OpenAI-style error body
    CONNECTION_RESET = "connection_reset"  # TCP RST before any response byte
    STREAM_CUT = "stream_cut"  # connection closed after `after_chunks` SSE events (no [DONE], no final chunk)
    STALL = "stall"  # `after_chunks` events, then silence for `stall_s` seconds (connection held open)
    MODEL_NOT_LISTED = "model_not_listed"  # /v1/models omits the served names
    INVALID_JSON = "invalid_json"  # the reply's content is truncated, unparseable JSON
    WRONG_SCHEMA = "wrong_schema"  # the reply's content is valid JSON with none of the expected keys
    EMPTY_CONTENT = "empty_content"  # reasoning only, empty content, finish_reason "length"


class FaultSpecError(ValueError):
    """A `--fault` specification that cannot be parsed."""


@dataclass
class FaultRule:
    fault: Fault
    requests: frozenset[int] | None = None
    kind: RequestKind | None = None
    times: int | None = None
    after_chunks: int = 3
    stall_s: float = 3600.0
    fired: int = field(default=0, compare=False)

    def matches(self, request_number: int, kind: RequestKind | None) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.requests is not None and request_number not in self.requests:
            return False
        return self.kind is None or self.kind == kind

    @classmethod
    def parse(cls, spec: str) -> FaultRule:
        """Rule from its text form (see module docstring)."""
        name, _, options = spec.partition(":")
        try:
            fault = Fault(name.strip())
        except ValueError:
            known = ", ".join(f.value for f in Fault)
            raise FaultSpecError(f"fault spec {spec!r}: unknown fault {name!r} (known: {known})") from None
        rule = cls(fault=fault)
        for option in filter(None, (o.strip() for o in options.split(","))):
            key, sep, value = option.partition("=")
            if not sep:
                raise FaultSpecError(f"fault spec {spec!r}: option {option!r} is not key=value")
            try:
                if key == "requests":
                    rule.requests = frozenset(int(n) for n in value.split("+"))
                elif key == "kind":
                    rule.kind = RequestKind(value)
                elif key == "times":
                    rule.times = int(value)
                elif key == "after_chunks":
                    rule.after_chunks = int(value)
                elif key == "stall_s":
                    rule.stall_s = float(value)
                else:
                    raise FaultSpecError(f"fault spec {spec!r}: unknown option {key!r}")
            except ValueError as exc:
                if isinstance(exc, FaultSpecError):
                    raise
                raise FaultSpecError(f"fault spec {spec!r}: bad value for {key!r}: {value!r}") from None
        return rule
