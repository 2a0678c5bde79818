"""Helpers of the hand-off tests that drive the protocol in-process: a sandbox side written by hand
(`ScriptedSandbox`), the publisher on a thread (`serve_in_thread`), and a pod's session proxy with its publisher and
scripted sandbox set up together (`proxied_pod`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime import handoff as hand
from tests.support.runtime import API_KEY, TASK, PolicyHost, open_episode_cycle

SEED = 450051


class ScriptedSandbox:
    """The sandbox side written by hand, for hand-offs no honest `episode run` produces."""

    def __init__(self, root: Path, config: CycleConfig, prompt: str) -> None:
        self.handoff = hand.Handoff(root)
        self.config = config
        self.prompt = prompt

    @property
    def slug(self) -> str:
        """The slug of the one unit this sandbox announces."""
        return EpisodeUnit(self.config.cycle_name, TASK, "reference", SEED).slug

    def announce_only(self) -> None:
        """Write request.json (and a heartbeat) as the sandbox does before it waits for the ledger."""
        unit = hand.HandoffUnit(
            task_id=TASK,
            kind="reference",
            seed=SEED,
            condition=f"t{TASK}_bare",
            prompt_sha256=hashlib.sha256(self.prompt.encode()).hexdigest(),
        )
        request = hand.HandoffRequest(cycle=self.config.cycle_name, config_hash=self.config.config_hash(), units=[unit])
        self.handoff.write(self.handoff.path(hand.REQUEST_FILE), request)
        self.handoff.path(hand.SANDBOX_ALIVE).touch()

    def announce(self) -> hand.Ledger:
        self.announce_only()
        ledger = self.handoff.path(hand.LEDGER_FILE)
        deadline = time.monotonic() + 60
        while not ledger.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.handoff.read(ledger, hand.Ledger)

    def attempt(self, attempt: int, *, prompt: str | None = None, finished: bool = True) -> Path:
        folder = self.handoff.attempt_dir(self.slug, attempt)
        target = folder if finished else folder.with_name(f".{folder.name}.partial")
        target.mkdir(parents=True)
        for name in hand.ATTEMPT_FILES:
            (target / EPISODE_FILES[name]).write_bytes(b"")
        (target / EPISODE_FILES["prompt"]).write_text(prompt or self.prompt)
        return target

    def complete(self, code: int = 0) -> None:
        self.handoff.write(self.handoff.path(hand.COMPLETE_FILE), hand.Completion(exit_code=code))


def serve_in_thread(publisher: hand.HandoffPublisher) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `publisher` on a daemon thread; the dict gets its exit code ("code") or what it raised ("error")."""
    result: dict[str, Any] = {}

    def serve() -> None:
        try:
            result["code"] = publisher.run()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, result


def finished_publication(folder: Path, attempt: int) -> None:
    """Write the attempt's publication.json: a succeeded record of one request, one prompt and one completion token."""
    record = {
        "status": "succeeded",
        "model": "m",
        "exit_code": 0,
        "failure": None,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "requests": 1,
        "max_prompt_tokens": 1,
        "started_at": datetime.now(UTC).isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "qwen_code_version": "x",
    }
    document = {"unit": folder.parent.name, "attempt": attempt, "record": record, "status": {}}
    (folder / hand.PUBLICATION_FILE).write_text(json.dumps(document))


def session_ask(handoff: hand.Handoff, name: str, ask: str, answer: str, model: type[Any]) -> Any:
    """Ask the publisher in sessions/ as a runner would, and wait for its answer."""
    folder = handoff.path(hand.SESSIONS_DIR)
    handoff.write_bytes(folder / f"{name}.{ask}", b"")
    deadline = time.monotonic() + 60
    while not (folder / answer).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return handoff.read(folder / answer, model)


@dataclass
class ProxiedPod:
    """A pod in one process: the cycle, its publisher serving on a thread with the pod's proxy, a scripted sandbox,
    and the proxy's folder (control socket and session logs)."""

    ctx: CycleContext
    publisher: hand.HandoffPublisher
    thread: threading.Thread
    result: dict[str, Any]
    sandbox: ScriptedSandbox
    proxy_dir: Path

    @property
    def session_logs(self) -> list[Path]:
        """The proxy's session logs (its rejection log aside)."""
        return [path for path in (self.proxy_dir / "sessions").glob("*.jsonl") if path.name != "rejected.jsonl"]

    def open_session(self, attempt: int = 1, attempt_try: int = 1) -> hand.SessionGrant:
        """Ask the publisher for the session of the sandbox's unit's attempt, as the runner's try `attempt_try`."""
        name = f"{self.sandbox.slug}-a{attempt}-t{attempt_try}"
        grant: hand.SessionGrant = session_ask(
            self.sandbox.handoff, name, "open", f"{name}.session.json", hand.SessionGrant
        )
        return grant


@contextlib.contextmanager
def proxied_pod(policy_host: PolicyHost, tmp_path: Path, *, upstream: str, endpoint: str) -> Iterator[ProxiedPod]:
    """The pod's `SessionProxy` (towards `upstream`, holding the key) on the policy host's loop, a cycle whose
    inference endpoint is `endpoint`, its publisher serving on a thread with that proxy, and a scripted sandbox on the
    hand-off folder; the proxy stops on exit. The sandbox has announced nothing yet."""
    from mass_ops.runtime.session_proxy import SessionProxy

    proxy_dir = tmp_path / "proxy"
    proxy = SessionProxy(
        proxy_dir / "sessions",
        control_socket=proxy_dir / "control.sock",
        upstreams=[upstream],
        upstream_api_key=API_KEY,
    )
    policy_host.loop.run(proxy.start())
    try:
        ctx = open_episode_cycle(tmp_path / "cycle", endpoint)
        pod_proxy = hand.PodProxy(proxy_dir / "control.sock", proxy_dir / "sessions")
        publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx, proxy=pod_proxy)
        thread, result = serve_in_thread(publisher)
        sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
        yield ProxiedPod(ctx, publisher, thread, result, sandbox, proxy_dir)
    finally:
        policy_host.loop.run(proxy.stop())
