"""The local agent runs in its bubblewrap sandbox (issue #25.7), attacked the way an agent would: the hostile
stand-in (hostile_agent.py) runs each attack through the real EpisodeRunner and proxy, and the host side checks what
the attack could not see, reach, write or leave behind."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mass_ops.compute import sandbox
from mass_ops.compute.egress import EgressProxy, host_addresses
from mass_ops.compute.sandbox import PROXY_PORT_IN_SANDBOX, SandboxSupport, bwrap_support, proxy_socket_dir
from mass_ops.runtime import runner as runner_module
from mass_ops.runtime.episode import EpisodeOutcome
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodePreflightError, EpisodeRunner
from tests.compute.test_egress import PUBLIC_NAME, fake_resolve, origin_policy
from tests.runtime.hostile_agent import hostile_findings
from tests.support.runtime import (
    API_KEY,
    KEY_VAR,
    PolicyHost,
    hostile_prompt,
    open_episode_cycle,
    request,
    runner_environ,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bwrap() -> str:
    """The bwrap executable; the sandbox tests skip with one line where this machine cannot build the sandbox."""
    support = bwrap_support()
    if support.bwrap is None:
        pytest.skip(f"no local agent sandbox here: {support.reason} (scripts/setup.sh installs bubblewrap as root)")
    return support.bwrap


def _runner(ctx: Any, install: QwenInstall, tmp: Path, **options: Any) -> EpisodeRunner:
    return EpisodeRunner(ctx, install=install, environ=runner_environ(), scratch_dir=tmp / "scratch", **options)


def _stream(ctx: Any, outcome: EpisodeOutcome) -> str:
    unit = outcome.request.unit
    return ctx.artifacts.get_bytes(f"cycles/{unit.cycle}/episodes/{unit.slug}/a{outcome.attempt}/stream.jsonl").decode()


def _attack(
    policy_host: PolicyHost, tmp: Path, install: QwenInstall, attack: str, *, keep_scratch: bool = False, **config: Any
) -> tuple[list[dict[str, Any]], EpisodeOutcome, str]:
    """Run `attack` as a hostile agent's episode; returns its findings, the outcome and the whole stream log."""
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp, f"{server.base_url}/v1", **config)
        runner = _runner(ctx, install, tmp, keep_scratch=keep_scratch)
        outcome = asyncio.run(runner.run_attempt(request(ctx, hostile_prompt(attack)), 1))
    stream = _stream(ctx, outcome)
    return hostile_findings(stream), outcome, stream


def _marked_processes(marker: str) -> list[int]:
    """Host pids whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def _no_leftovers(marker: str) -> Iterator[None]:
    """Whatever the test finds, kill what an attack left behind (on code without the sandbox it survives)."""
    try:
        yield
    finally:
        for pid in _marked_processes(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --- secrets and other episodes ----------------------------------------------------------------------------------

_CHILD_RUNNER = """
import asyncio, json, sys
from pathlib import Path
from mass_ops.config import validate_config
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from tests.inner_loop_fakes import open_test_cycle
from tests.support.runtime import HOSTILE_AGENT, request
ctx = open_test_cycle(validate_config(json.loads(Path(sys.argv[1]).read_text())))
install = QwenInstall(node_bin=Path(sys.executable), qwen_entry=HOSTILE_AGENT, version="hostile")
runner = EpisodeRunner(ctx, install=install, scratch_dir=Path(sys.argv[2]))  # environ: this process's own
outcome = asyncio.run(runner.run_attempt(request(ctx, Path(sys.argv[3]).read_text()), 1))
print(json.dumps({"status": outcome.status, "attempt": outcome.attempt}))
"""

_READ_ENVIRONS = """
import os
def environ(pid):
    try:
        return open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\\0")
    except OSError as exc:
        return [f"<{type(exc).__name__}>"]
ancestors, pid = {}, os.getpid()
while pid > 0 and str(pid) not in ancestors:
    ancestors[str(pid)] = environ(pid)
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        break
    pid = int(status.split("PPid:")[1].split()[0])
others = {p: [v for v in environ(p) if any(w in v.split("=")[0] for w in ("KEY", "SECRET", "TOKEN", "AWS"))]
          for p in os.listdir("/proc") if p.isdigit()}
report(ancestors=ancestors, others=others)
"""


def test_the_runner_s_environment_and_its_secrets_are_out_of_reach(
    policy_host: PolicyHost, tmp_path: Path, bwrap: str
) -> None:
    """The runner holds the inference key and an S3 secret in its real environment (a separate process, so that
    /proc/<pid>/environ holds them); the agent reads every ancestor's and every visible process's environment."""
    s3_secret = f"s3-secret-{secrets.token_hex(16)}"
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        config = write_config(ctx, tmp_path)
        prompt = tmp_path / "prompt.txt"
        prompt.write_text(hostile_prompt(_READ_ENVIRONS))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(REPO),
            KEY_VAR: API_KEY,
            "AWS_SECRET_ACCESS_KEY": s3_secret,
        }
        child = subprocess.run(
            [sys.executable, "-c", _CHILD_RUNNER, str(config), str(tmp_path / "scratch"), str(prompt)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert child.returncode == 0, child.stderr[-2000:]
    outcome = json.loads(child.stdout.strip().splitlines()[-1])
    assert outcome["status"] == "succeeded"
    unit = request(ctx, "x").unit
    stream = ctx.artifacts.get_bytes(f"cycles/{unit.cycle}/episodes/{unit.slug}/a1/stream.jsonl").decode()
    [found] = hostile_findings(stream)
    # The attack did read environments (its own at least) ...
    own = [values for values in found["ancestors"].values() if any(v.startswith("MASS_EPISODE_SCOPE=") for v in values)]
    assert own, found["ancestors"]
    # ... but none of them held a secret of the runner's.
    assert API_KEY not in stream and s3_secret not in stream
    assert not [v for values in found["others"].values() for v in values if v.startswith(("AWS_", f"{KEY_VAR}="))]


_WAIT_FOR_RELEASE = """
import time
(workspace / "ready.part").write_text(token)
(workspace / "ready.part").rename(workspace / "ready")  # whole when the host sees it
deadline = time.monotonic() + 60
while not (workspace / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
report(released=(workspace / "release").exists())
"""

_USE_THE_OTHER_EPISODE = """
import os, socket
tokens = set()
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            values = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
        except OSError:
            continue
        tokens.update(v.split(b"=", 1)[1].decode() for v in values if v.startswith(b"MASS_EPISODE_TOKEN="))
tokens.discard(token)
with_its_token = {}
for url in sorted({OTHER_URL, base_url}):
    for candidate in sorted(tokens | {OTHER_TOKEN}):
        try:
            status = http("GET", url + "/models", headers={"Authorization": f"Bearer {candidate}"}, timeout=5)[0]
        except OSError as exc:
            status = type(exc).__name__
        with_its_token[f"{url} {candidate == OTHER_TOKEN}"] = status
unix = socket.socket(socket.AF_UNIX)
try:
    unix.connect(OTHER_SOCKET)
    its_socket = "connected"
except OSError as exc:
    its_socket = type(exc).__name__
report(
    foreign_tokens=sorted(tokens),
    with_its_token=with_its_token,
    its_socket=its_socket,
    its_workspace=os.path.exists(OTHER_WORKSPACE),
)
"""


def test_another_running_episode_s_token_and_proxy_are_out_of_reach(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str
) -> None:
    """Episode B runs (and waits) while episode A looks for B's token in every process's environment and tries B's
    proxy with it: by B's URL, by its own, and by B's proxy socket on the host."""
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _runner(ctx, hostile_install, tmp_path)
        first = request(ctx, hostile_prompt(_WAIT_FOR_RELEASE), seed=1)
        root = tmp_path / "scratch" / ctx.cycle_name / f"{first.unit.slug}-a1"

        async def both() -> tuple[EpisodeOutcome, EpisodeOutcome]:
            waiting = asyncio.create_task(runner.run_attempt(first, 1))
            ready = root / "workspace" / "ready"
            while not ready.exists():  # readiness: B's agent runs and holds its token
                assert not waiting.done(), "episode B ended before it was ready"
                await asyncio.sleep(0.02)
            settings = json.loads((root / "home" / ".qwen" / "settings.json").read_text())
            attack = (
                f"OTHER_TOKEN = {ready.read_text()!r}\n"
                f"OTHER_URL = {settings['modelProviders']['openai'][0]['baseUrl'].rstrip('/')!r}\n"
                f"OTHER_SOCKET = {str(proxy_socket_dir(root) / sandbox.PROXY_SOCKET_NAME)!r}\n"
                f"OTHER_WORKSPACE = {str(root / 'workspace' / 'ready')!r}\n" + _USE_THE_OTHER_EPISODE.strip()
            )
            try:
                second = await runner.run_attempt(request(ctx, hostile_prompt(attack), seed=2), 1)
            finally:
                (root / "workspace" / "release").write_text("go")
            return await waiting, second

        other, outcome = asyncio.run(both())
    assert other.status == "succeeded" and hostile_findings(_stream(ctx, other)) == [{"released": True}]
    [found] = hostile_findings(_stream(ctx, outcome))
    assert found["foreign_tokens"] == []
    # B's token opens nothing A can reach: A's URL is A's own proxy (B's URL is the same in-sandbox address).
    assert found["with_its_token"] and not [s for s in found["with_its_token"].values() if s == 200]
    assert found["its_socket"] == "FileNotFoundError" and found["its_workspace"] is False


# --- processes -----------------------------------------------------------------------------------------------------

_LEAVE_A_DAEMON = """
import os, subprocess, time
subprocess.Popen(
    ["setsid", "env", "-i", "sh", "-c", "sleep 300; :", MARKER],
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
)
def running():
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and MARKER.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
        except OSError:
            pass
    return False
deadline = time.monotonic() + 30
while not running() and time.monotonic() < deadline:
    time.sleep(0.02)
report(daemon_running=running())
"""


@pytest.mark.parametrize("ending", ["agent_exits", "wall_clock"])
def test_a_setsid_daemon_does_not_outlive_its_attempt(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str, ending: str
) -> None:
    """`setsid env -i …` leaves the agent's process group and drops the scope marker from its environment; it still
    ends with the attempt, whether the agent exits or the wall-clock limit stops it."""
    marker = f"mass-daemon-{secrets.token_hex(8)}"
    attack = f"MARKER = {marker!r}\n" + _LEAVE_A_DAEMON.strip()
    options: dict[str, Any] = {}
    if ending == "wall_clock":
        attack += "\ntime.sleep(300)\n"
        options = {"episode_wall_clock_s": 3}
    with _no_leftovers(marker):
        findings, outcome, _stream_text = _attack(policy_host, tmp_path, hostile_install, attack, **options)
        assert findings[0] == {"daemon_running": True}
        if ending == "wall_clock":
            assert outcome.status_record["terminated_by"] == "wall_clock"
        assert _marked_processes(marker) == []


def test_a_cancelled_attempt_takes_its_daemon_with_it(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str
) -> None:
    """Cancellation (Ctrl-C, SIGTERM of the task) stops the sandbox mid-attack: the daemon ends, nothing is recorded."""
    marker = f"mass-daemon-{secrets.token_hex(8)}"
    attack = f"MARKER = {marker!r}\n{_LEAVE_A_DAEMON.strip()}\ntime.sleep(300)\n"
    with _no_leftovers(marker), policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = _runner(ctx, hostile_install, tmp_path)

        async def cancel_once_the_daemon_runs() -> None:
            attempt = asyncio.create_task(runner.run_attempt(request(ctx, hostile_prompt(attack)), 1))
            while not _marked_processes(marker):  # readiness: the host sees the sandbox's processes
                assert not attempt.done(), "the attempt ended before its daemon started"
                await asyncio.sleep(0.02)
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt

        asyncio.run(cancel_once_the_daemon_runs())
        assert _marked_processes(marker) == []
        assert ctx.repo.episodes(ctx.cycle_id) == []


# --- network -------------------------------------------------------------------------------------------------------

_CONNECT = """
import socket
reached = {}
for name, (host, port) in TARGETS.items():
    try:
        socket.create_connection((host, port), timeout=5).close()
        reached[name] = "connected"
    except OSError as exc:
        reached[name] = type(exc).__name__
status = http("GET", base_url + "/models", headers={"Authorization": f"Bearer {token}"})[0]
report(reached=reached, own_proxy=status)
"""


def _host_can_connect(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        return True
    return False


def test_local_services_are_unreachable_and_the_own_proxy_is_reachable(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str
) -> None:
    """Postgres on 127.0.0.1:5432, a TCP server this test starts and the model server itself are host services;
    only the episode's own proxy answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        with policy_host.serve() as server:
            ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
            model_port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
            targets = {
                "test_server": ("127.0.0.1", listener.getsockname()[1]),
                "model_server": ("127.0.0.1", model_port),
            }
            if _host_can_connect(5432):
                targets["postgres"] = ("127.0.0.1", 5432)
            attack = f"TARGETS = {targets!r}\n" + _CONNECT.strip()
            outcome = asyncio.run(
                _runner(ctx, hostile_install, tmp_path).run_attempt(request(ctx, hostile_prompt(attack)), 1)
            )
        [found] = hostile_findings(_stream(ctx, outcome))
    finally:
        listener.close()
    assert found["own_proxy"] == 200
    assert set(found["reached"]) == set(targets)
    assert not [name for name, result in found["reached"].items() if result == "connected"], found["reached"]
    assert accepted == []


# --- files ---------------------------------------------------------------------------------------------------------

_WRITE_EVERYWHERE = """
import os
attempt = workspace.parent
targets = {
    "outside": OUTSIDE / PLANTED,
    "attempt_folder": attempt / PLANTED,
    "logs": attempt / "logs" / PLANTED,
    "scratch": attempt.parent / PLANTED,
    "repository": REPO / PLANTED,
    "runtime": REPO / ".venv" / PLANTED,
    "root": Path("/") / PLANTED,
    "usr": Path("/usr") / PLANTED,
    "workspace": workspace / PLANTED,
    "home": Path(os.environ["HOME"]) / PLANTED,
    "tmp": Path("/tmp") / PLANTED,
}
wrote = {}
for name, path in targets.items():
    try:
        path.write_text("x")
        wrote[name] = True
    except OSError as exc:
        wrote[name] = type(exc).__name__
logs = attempt / "logs"
seen = {"logs_exists": logs.exists(), "proxy_log_exists": (logs / "api_requests.jsonl").exists()}
try:
    seen["proxy_log"] = (logs / "api_requests.jsonl").read_text()[:200]
except OSError as exc:
    seen["proxy_log"] = type(exc).__name__
report(wrote=wrote, seen=seen)
"""


def test_writes_outside_workspace_home_and_tmp_fail_and_the_logs_are_invisible(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str
) -> None:
    """The agent writes to every folder it can name. Below /tmp the sandbox shows its own private /tmp (the
    attempt's tmp/ folder): what it writes there stays there, so the host side is what this test checks."""
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = f"planted-{secrets.token_hex(6)}.txt"
    host_paths = [Path("/") / planted, Path("/usr") / planted, REPO / planted, REPO / ".venv" / planted]
    attack = (
        f"from pathlib import Path\nOUTSIDE = Path({str(outside)!r})\nREPO = Path({str(REPO)!r})\n"
        f"PLANTED = {planted!r}\n{_WRITE_EVERYWHERE}"
    )
    try:
        findings, outcome, _stream_text = _attack(policy_host, tmp_path, hostile_install, attack, keep_scratch=True)
        on_the_host = [path for path in host_paths if path.exists()]
    finally:
        for path in host_paths:  # on code without the sandbox the attack writes there: leave the machine clean
            path.unlink(missing_ok=True)
    [found] = findings
    wrote = found["wrote"]
    assert outcome.status == "succeeded"
    for name in ("workspace", "home", "tmp"):
        assert wrote[name] is True
    # Outside /tmp: read-only or not there at all. A repository below /tmp (a clone in /tmp) is not there either:
    # the agent's /tmp is its own, so a write there lands in its private tmp/ (the host check below covers it).
    below_tmp = REPO.is_relative_to("/tmp")
    for name in ("runtime", "root", "usr", *(() if below_tmp else ("repository",))):
        assert wrote[name] != True, (name, wrote[name])  # noqa: E712 - a finding is True or an error's name
    assert found["seen"] == {"logs_exists": False, "proxy_log_exists": False, "proxy_log": "FileNotFoundError"}
    # On the host: nothing outside the attempt's workspace, home and tmp/.
    unit = outcome.request.unit
    attempt = tmp_path / "scratch" / unit.cycle / f"{unit.slug}-a1"
    assert on_the_host == [] and list(outside.iterdir()) == []
    landed = {path.relative_to(attempt).parts[0] for path in tmp_path.rglob(planted)}
    assert landed == {"home", "tmp", "workspace"}


# --- the normal agent, and where there is no sandbox ------------------------------------------------------------------


def test_the_stand_in_agent_completes_its_requests_through_the_bridge(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall, bwrap: str
) -> None:
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        outcome = asyncio.run(
            _runner(ctx, stand_in_install, tmp_path).run_attempt(request(ctx, "Report.\n@agent requests=3"), 1)
        )
        served = server.stats.chat_requests
    assert outcome.status == "succeeded" and served == 3
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert row.requests == 3 and row.prompt_tokens > 0
    unit = outcome.request.unit
    settings = json.loads(ctx.artifacts.get_bytes(f"cycles/{unit.cycle}/episodes/{unit.slug}/a1/settings.json"))
    assert settings["modelProviders"]["openai"][0]["baseUrl"] == f"http://127.0.0.1:{PROXY_PORT_IN_SANDBOX}/v1"
    assert "bubblewrap sandbox" in outcome.status_record["hiw"]["env_policy"]


def test_without_a_sandbox_a_real_key_is_refused_unless_the_config_allows_it(
    policy_host: PolicyHost, tmp_path: Path, stand_in_install: QwenInstall, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runtime.sandbox: none`, or bwrap unavailable: one line naming the opt-out, nothing created; the placeholder
    key (the demo's keyless local server) and the explicit opt-out run."""
    import mass_ops.runtime.runner as runner_module

    prompt = "Report.\n@agent requests=1"
    with policy_host.serve() as server:
        endpoint = f"{server.base_url}/v1"
        ctx = open_episode_cycle(tmp_path / "none", endpoint, sandbox="none")
        with pytest.raises(EpisodePreflightError) as caught:
            asyncio.run(_runner(ctx, stand_in_install, tmp_path / "none").run_attempt(request(ctx, prompt), 1))
        message = str(caught.value)
        assert (
            "\n" not in message
            and "runtime.allow_unsandboxed_agent" in message
            and "runtime.sandbox is none" in message
        )
        assert API_KEY not in message and KEY_VAR in message
        assert not (tmp_path / "none" / "scratch").exists() and ctx.repo.episodes(ctx.cycle_id) == []
        assert server.stats.chat_requests == 0

        # bwrap chosen but not usable here: the same refusal, with the reason.
        monkeypatch.setattr(
            runner_module, "bwrap_support", lambda: SandboxSupport(None, "bubblewrap (bwrap) is not installed")
        )
        ctx = open_episode_cycle(tmp_path / "missing", endpoint)
        with pytest.raises(
            EpisodePreflightError, match=r"\(bubblewrap \(bwrap\) is not installed\).*allow_unsandboxed"
        ):
            asyncio.run(_runner(ctx, stand_in_install, tmp_path / "missing").run_attempt(request(ctx, prompt), 1))

        # The placeholder key runs unsandboxed (the demo from a fresh clone), and so does the explicit opt-out.
        keyless = EpisodeRunner(
            ctx, install=stand_in_install, environ={"PATH": os.environ["PATH"]}, scratch_dir=tmp_path / "keyless"
        )
        assert asyncio.run(keyless.run_attempt(request(ctx, prompt), 1)).status == "succeeded"
        allowed = open_episode_cycle(tmp_path / "allowed", endpoint, allow_unsandboxed_agent=True)
        outcome = asyncio.run(
            _runner(allowed, stand_in_install, tmp_path / "allowed").run_attempt(request(allowed, prompt), 1)
        )
    assert outcome.status == "succeeded" and "no sandbox" in outcome.status_record["hiw"]["env_policy"]


# --- downloads: the egress proxy -----------------------------------------------------------------------------------

_EGRESS = """
import os, socket, subprocess
EGRESS = ("127.0.0.1", 39372)
def ask(request, inside=None):
    with socket.create_connection(EGRESS, timeout=20) as s:
        s.sendall(request.encode())
        data = b""
        while b"\\r\\n\\r\\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        if inside is not None and data.startswith(b"HTTP/1.1 200"):
            s.sendall(inside.encode())
        while chunk := s.recv(65536):
            data += chunk
    return data.decode(errors="replace")
statuses = {name: ask(text).split("\\r\\n")[0] for name, text in REFUSED.items()}
tunnel = ask(f"CONNECT {PUBLIC}:{PORT} HTTP/1.1\\r\\n\\r\\n", f"GET /tunnel HTTP/1.1\\r\\nHost: {PUBLIC}\\r\\n\\r\\n")
plain = ask(f"GET http://{PUBLIC}:{PORT}/plain HTTP/1.1\\r\\nHost: {PUBLIC}\\r\\n\\r\\n")
curl = {}
for name, flags in (("get", []), ("tunnel", ["--proxytunnel"])):
    done = subprocess.run(["curl", "-sS", "--max-time", "20", *flags, f"http://{PUBLIC}:{PORT}/curl-{name}"],
                          capture_output=True, text=True)
    curl[name] = done.stdout.strip() or done.stderr.strip()
proxies = {k: v for k, v in os.environ.items() if "proxy" in k.lower()}
report(statuses=statuses, tunnel=tunnel.rsplit("\\n", 1)[-1], plain=plain.rsplit("\\n", 1)[-1], curl=curl,
       proxies=proxies)
"""


class _Origin(ThreadingHTTPServer):
    """The stand-in for a public download site, on 127.0.0.2: answers `hello <path>`."""

    def __init__(self) -> None:
        class Hello(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = f"hello {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.2", 0), Hello)


def _host_ipv4() -> str | None:
    """A non-loopback address of this host's own, if it has one."""
    return next((str(a) for a in host_addresses() if a.version == 4 and not a.is_loopback), None)


def test_downloads_reach_public_addresses_and_never_a_host_service(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str, monkeypatch: Any
) -> None:
    """`runtime.sandbox_egress: public`: the agent's proxy variables lead to its egress proxy. A fake public name
    (mapped by an injected resolver to 127.0.0.2, the one address the test lets through) is reached by CONNECT and
    by a plain GET, and by curl both ways; every way to a host service is refused (403) and counted in the status."""
    monkeypatch.setattr(
        runner_module, "EgressProxy", functools.partial(EgressProxy, resolve=fake_resolve, policy=origin_policy)
    )
    origin = _Origin()
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    port = origin.server_address[1]
    try:
        with policy_host.serve() as server:
            model_port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
            refused = {
                "postgres": "CONNECT 127.0.0.1:5432 HTTP/1.1\r\n\r\n",
                "metadata": "CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n",
                "private": "CONNECT 10.1.2.3:443 HTTP/1.1\r\n\r\n",
                "ipv6_loopback": f"CONNECT [::1]:{port} HTTP/1.1\r\n\r\n",
                "mapped_loopback": f"CONNECT [::ffff:127.0.0.1]:{port} HTTP/1.1\r\n\r\n",
                "name_to_loopback": f"CONNECT loopback.example:{port} HTTP/1.1\r\n\r\n",
                "model_server": f"GET http://127.0.0.1:{model_port}/v1/models HTTP/1.1\r\n\r\n",
                "other_port": f"CONNECT {PUBLIC_NAME}:8443 HTTP/1.1\r\n\r\n",
            }
            if (own := _host_ipv4()) is not None:
                refused["host_address"] = f"CONNECT {own}:{port} HTTP/1.1\r\n\r\n"
            attack = f"REFUSED = {refused!r}\nPUBLIC = {PUBLIC_NAME!r}\nPORT = {port}\n" + _EGRESS.strip()
            ctx = open_episode_cycle(
                tmp_path,
                f"{server.base_url}/v1",
                sandbox_egress="public",
                sandbox_egress_ports=[443, 80, 5432, port, model_port],
            )
            outcome = asyncio.run(
                _runner(ctx, hostile_install, tmp_path).run_attempt(request(ctx, hostile_prompt(attack)), 1)
            )
    finally:
        origin.shutdown()
        origin.server_close()
    [found] = hostile_findings(_stream(ctx, outcome))
    assert found["statuses"] == dict.fromkeys(refused, "HTTP/1.1 403 Forbidden")
    assert (found["tunnel"], found["plain"]) == ("hello /tunnel", "hello /plain")
    assert found["curl"] == {"get": "hello /curl-get", "tunnel": "hello /curl-tunnel"}
    url = f"http://127.0.0.1:{sandbox.EGRESS_PORT_IN_SANDBOX}"
    assert found["proxies"] == {
        **dict.fromkeys(("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"), url),
        **dict.fromkeys(("NO_PROXY", "no_proxy"), "127.0.0.1,localhost"),
    }
    egress = outcome.status_record["egress"]
    assert (egress["connections"], egress["refused"]) == (4, len(refused))
    assert egress["bytes_up"] > 0 and egress["bytes_down"] >= len("hello /tunnel") * 4


_NO_EGRESS = """
import os, socket
try:
    socket.create_connection(("127.0.0.1", 39372), timeout=5).close()
    reached = "connected"
except OSError as exc:
    reached = type(exc).__name__
report(reached=reached, proxies=sorted(k for k in os.environ if "proxy" in k.lower()),
       sockets=sorted(os.listdir("/run/mass-proxy")))
"""


def test_without_egress_no_proxy_is_named_and_nothing_listens(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, bwrap: str
) -> None:
    """`runtime.sandbox_egress: none` (the demo's): the episode proxy is the sandbox's only network."""
    findings, outcome, _stream_text = _attack(policy_host, tmp_path, hostile_install, _NO_EGRESS.strip())
    assert findings == [
        {"reached": "ConnectionRefusedError", "proxies": ["NO_PROXY", "no_proxy"], "sockets": ["proxy.sock"]}
    ]
    assert "egress" not in outcome.status_record
