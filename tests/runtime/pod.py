"""A Kubernetes episode pod simulated in one process, with the real parts: the pod's `SessionProxy` (on the policy
host's event loop, holding the key), the publisher (`HandoffPublisher`, on a thread, with the stores) and the
sandbox's runner (`SandboxHandoff` + `EpisodePool`, without key or stores), sharing a hand-off folder as the pod's
containers share their emptyDir. What the sandbox container may not reach in a real pod — the proxy's control
socket and session logs (`proxy_dir`) — it is simply not told about here."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.runtime import handoff as hand
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.runtime.pool import EpisodePool
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.session_proxy import SessionProxy
from tests.support.runtime import API_KEY, PolicyHost

PUBLISHER_JOIN_S = 120


@dataclass
class PodRun:
    """What a simulated pod left: the sandbox's outcomes (or its error), the publisher's result, and the places."""

    handoff: Path
    proxy_dir: Path
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    sandbox_error: BaseException | None = None
    publisher: dict[str, Any] = field(default_factory=dict)
    runner: Any = None  # the sandbox's runner, when the test chose its class

    @property
    def session_logs(self) -> list[Path]:
        """The proxy's session logs (its rejection log aside)."""
        return sorted(path for path in (self.proxy_dir / "sessions").glob("*.jsonl") if path.name != "rejected.jsonl")


def run_pod(
    policy_host: PolicyHost,
    ctx: CycleContext,
    requests: Sequence[EpisodeRequest],
    *,
    install: QwenInstall,
    upstream: str,
    tmp: Path,
    runner_class: Callable[..., Any] | None = None,
) -> PodRun:
    """Run `requests` in a simulated pod against `upstream` (which wants `API_KEY`); the publisher records into
    `ctx`. The sandbox's runner gets PATH only: no key, no store."""
    run = PodRun(handoff=tmp / "handoff", proxy_dir=tmp / "proxy")
    run.handoff.mkdir(parents=True)
    proxy = SessionProxy(
        run.proxy_dir / "sessions",
        control_socket=run.proxy_dir / "control.sock",
        upstreams=[upstream],
        upstream_api_key=API_KEY,
    )
    policy_host.loop.run(proxy.start())
    try:
        publisher = hand.HandoffPublisher(
            ctx.config,
            run.handoff,
            attach=lambda _config: ctx,
            proxy=hand.PodProxy(run.proxy_dir / "control.sock", run.proxy_dir / "sessions"),
        )
        thread = threading.Thread(target=_publish, args=(publisher, run.publisher), daemon=True)
        thread.start()
        try:
            with hand.SandboxHandoff(run.handoff) as session:
                sandbox_ctx = session.open(ctx.config, requests)
                options: dict[str, Any] = {
                    "install": install,
                    "environ": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    "scratch_dir": tmp / "scratch",
                    "sink": session.sink,
                    "proxy_sessions": session.proxy_sessions,
                }
                run.runner = None if runner_class is None else runner_class(sandbox_ctx, **options)
                with EpisodePool(sandbox_ctx, runner=run.runner, **({} if run.runner else options)) as pool:
                    run.outcomes = pool.run(list(requests))
        except Exception as exc:
            run.sandbox_error = exc
        thread.join(timeout=PUBLISHER_JOIN_S)
    finally:
        policy_host.loop.run(proxy.stop())
    return run


def _publish(publisher: hand.HandoffPublisher, result: dict[str, Any]) -> None:
    try:
        result["code"] = publisher.run()
    except BaseException as exc:
        result["error"] = exc
