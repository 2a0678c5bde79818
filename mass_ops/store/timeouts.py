"""How long the stores may take to answer, and how often a request is tried: one place, read from the environment.

Every network client of the stores gets these limits, so a server that accepts and never answers fails the command
within seconds. Variables (defaults): ``MASS_STORE_CONNECT_TIMEOUT_S`` (5), ``MASS_STORE_READ_TIMEOUT_S`` (20),
``MASS_STORE_MAX_ATTEMPTS`` (3, S3 "standard" retries), ``MASS_STORE_STATEMENT_TIMEOUT_S`` (600, Postgres; 0 = none).
Values are seconds (decimals allowed) or a whole number of attempts; an unusable value is an `InputError` naming the
variable. What each limit applies to: docs/storage.md (`mass_ops.store.timeouts`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mass_ops.errors import InputError

CONNECT_TIMEOUT_ENV = "MASS_STORE_CONNECT_TIMEOUT_S"
READ_TIMEOUT_ENV = "MASS_STORE_READ_TIMEOUT_S"
MAX_ATTEMPTS_ENV = "MASS_STORE_MAX_ATTEMPTS"
STATEMENT_TIMEOUT_ENV = "MASS_STORE_STATEMENT_TIMEOUT_S"

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Between two reads of a response, not for a whole transfer: 20 s without a byte is an endpoint that is not
# answering. With 3 attempts a silent S3 endpoint fails a request in about a minute (botocore's defaults: minutes).
DEFAULT_READ_TIMEOUT_S = 20.0
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_STATEMENT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 24 * 3600.0  # beyond a day a "timeout" is a typo, not a limit
MAX_ATTEMPTS = 20


class StoreSettingError(InputError):
    """A store timeout or retry variable holds a value that cannot be used."""


@dataclass(frozen=True)
class StoreTimeouts:
    """Connect/read/statement timeouts (seconds) and total attempts per request of every store client."""

    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_s: float = DEFAULT_READ_TIMEOUT_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    statement_s: float = DEFAULT_STATEMENT_TIMEOUT_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreTimeouts:
        """The limits set in the environment (`os.environ` by default), defaults for unset variables."""
        env = os.environ if environ is None else environ
        return cls(
            connect_s=_seconds(env, CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S, allow_zero=False),
            read_s=_seconds(env, READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT_S, allow_zero=False),
            max_attempts=_attempts(env),
            statement_s=_seconds(env, STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT_S, allow_zero=True),
        )

    def botocore_config(self, **extra: Any) -> Any:
        """A botocore `Config` with these timeouts and a bounded "standard" retry policy (`extra` passes through)."""
        from botocore.config import Config

        return Config(
            connect_timeout=self.connect_s,
            read_timeout=self.read_s,
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            **extra,
        )

    def postgres_connect_args(self) -> dict[str, Any]:
        """libpq connection parameters (psycopg 2 and 3) that bound connecting and detect a silent peer."""
        read_ms = max(1, round(self.read_s * 1000))
        return {
            # libpq takes whole seconds and ignores 0 ("wait forever"): round up, at least 1.
            "connect_timeout": max(1, math.ceil(self.connect_s)),
            # Sent data unacknowledged this long closes the connection (a peer that vanished mid-query).
            "tcp_user_timeout": read_ms,
            "keepalives": 1,
            "keepalives_idle": max(1, math.ceil(self.read_s / 2)),
            "keepalives_interval": max(1, math.ceil(self.read_s / 6)),
            "keepalives_count": 3,
        }

    @property
    def statement_timeout_ms(self) -> int:
        """Postgres ``statement_timeout`` in milliseconds (0 = none)."""
        return round(self.statement_s * 1000)


def _raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _seconds(env: Mapping[str, str], name: str, default: float, *, allow_zero: bool) -> float:
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok and value <= MAX_TIMEOUT_S):
        floor = "0" if allow_zero else "more than 0"
        raise StoreSettingError(f"{name}={raw!r} must be a number of seconds, {floor} and at most {MAX_TIMEOUT_S:g}")
    return value


def _attempts(env: Mapping[str, str]) -> int:
    raw = _raw(env, MAX_ATTEMPTS_ENV)
    if raw is None:
        return DEFAULT_MAX_ATTEMPTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_ATTEMPTS:
        raise StoreSettingError(f"{MAX_ATTEMPTS_ENV}={raw!r} must be a whole number from 1 to {MAX_ATTEMPTS}")
    return value
