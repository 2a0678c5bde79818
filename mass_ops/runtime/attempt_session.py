"""An attempt's session with a Kubernetes episode pod's proxy, and where the pod's runner gets one.

In a pod the proxy (and the key) live in another container, and only the publisher reaches its control socket: the
runner asks it for each attempt's session (`ProxySessions`, implemented by `mass_ops.runtime.handoff`), points the
agent at the session's URL with its token, and closes the session once the agent has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.outcome import UsageTotals


@dataclass(frozen=True)
class AttemptSession:
    """An attempt's session with a pod's episode proxy, as the runner holds it: where the agent connects and with
    which token (`name` is how the publisher knows it)."""

    name: str
    proxy_url: str
    token: str


class ProxySessions(Protocol):
    """Where a pod's runner gets each attempt's proxy session: from the publisher, the one container that reaches
    the proxy's control socket (`mass_ops.runtime.handoff.HandoffProxySessions`)."""

    async def open(self, unit: EpisodeUnit) -> AttemptSession:
        """The session of attempt `unit.attempt`, the endpoint checked; `EndpointUnreachableError` (wait and ask
        again) or `EpisodePreflightError`."""
        ...

    async def close(self, session: AttemptSession, api_log: Path) -> UsageTotals:
        """Close `session` once its agent has ended: its log lands at `api_log`; returns the proxy's counts."""
        ...
