"""Helpers of the store tests; `tests/store/conftest.py` builds its fixtures from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SilentServer:
    """Where the silent server listens."""

    host: str
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"
