"""`mass-ops demo --ui` without a browser or Airflow: arguments, the standalone environment, the login file, the
form's default config, and stopping a process tree (fake `airflow standalone` trees stand in for the real one;
tests/deploy/test_browser.py runs the real thing)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mass_ops_airflow.demo import demo_config
from mass_ops_airflow.demo import ui as demo_ui
from mass_ops_airflow.demo.ui import DemoUi, DemoUiError
from rich.console import Console
from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.compute.local import is_alive, read_state, start_server, stop_server
from mass_ops.config import read_config_source, validate_config

runner = CliRunner()

# A fake `airflow standalone`: a child that ignores the polite signals when asked to, then both wait forever.
FAKE_TREE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    child_code = "import signal, sys, time\\n"
    if sys.argv[2] == "stubborn":
        child_code += "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    child_code += "print('child up', flush=True)\\ntime.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE)
    child.stdout.readline()
    open(sys.argv[1], "w").write(str(child.pid))
    print("tree up", flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(path: Path, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the command line ---------------------------------------------------------------------------------------------


def test_cli_hands_port_and_overrides_to_the_ui(monkeypatch):
    calls = []

    def fake_run_ui(overrides, *, port, console, err_console):
        calls.append((overrides, port))
        return 0

    monkeypatch.setattr(demo_ui, "run_ui", fake_run_ui)
    assert runner.invoke(app, ["demo", "--ui", "--port", "9123", "--set", "collection.candidates=2"]).exit_code == 0
    assert runner.invoke(app, ["demo", "--ui"]).exit_code == 0
    assert calls == [(["collection.candidates=2"], 9123), (None, demo_ui.DEFAULT_PORT)]


@pytest.mark.parametrize("args", [["--ui", "--port", "0"], ["--ui", "--port", "70000"], ["--port", "9000"]])
def test_bad_port_arguments_exit_2_without_running(monkeypatch, args):
    monkeypatch.setattr(demo_ui, "run_ui", lambda *a, **k: pytest.fail("the UI must not start"))
    result = runner.invoke(app, ["demo", *args])
    assert result.exit_code == 2
    assert "--port" in result.output


def test_port_in_use_is_one_line_and_nothing_is_written(tmp_path, monkeypatch, busy_port):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["demo", "--ui", "--port", str(busy_port)])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert f"--port {busy_port}: 127.0.0.1:{busy_port} is not free" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_override_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["demo", "--ui", "--port", str(_free_port()), "--set", "collection.candidates=0"])
    assert result.exit_code == 2
    assert "collection.candidates" in result.stderr
    assert list(tmp_path.iterdir()) == []


# --- what standalone gets ---------------------------------------------------------------------------------------


def test_environment_points_airflow_at_the_demo_home_port_and_form(tmp_path):
    ui = DemoUi(home=tmp_path / "airflow", port=8123)
    base = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "MASS_METADATA_URL": "postgresql://elsewhere/db",
        "MASS_ARTIFACT_URL": "s3://elsewhere",
        "MASS_SETTINGS_DIR": "/etc/cluster",
        "AIRFLOW__CORE__DAGS_FOLDER": "/somewhere/else",
    }
    env = demo_ui.ui_environment(ui, base)
    home = str((tmp_path / "airflow").resolve())
    assert env["AIRFLOW_HOME"] == home and env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == f"sqlite:///{home}/airflow.db"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(Path("dags").resolve())
    assert (env["AIRFLOW__API__HOST"], env["AIRFLOW__API__PORT"]) == ("127.0.0.1", "8123")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:8123/execution/"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "admin:admin"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] == f"{home}/{demo_ui.PASSWORDS_FILE}"
    assert env["MASS_DEFAULT_PRESET"] == f"{home}/{demo_ui.CYCLE_CONFIG_FILE}"
    # standalone starts `airflow <component>` from PATH: this environment's script first.
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    assert env["HOME"] == "/root"
    assert not {"MASS_METADATA_URL", "MASS_ARTIFACT_URL", "MASS_SETTINGS_DIR"} & set(env)
    assert base["MASS_METADATA_URL"] == "postgresql://elsewhere/db", "the caller's mapping is left alone"


def test_standalone_command_uses_this_environments_airflow():
    argv = demo_ui.standalone_argv()
    assert argv[-1] == "standalone"
    assert argv[0] == str(Path(sys.executable).with_name("airflow")) or argv[:3] == [sys.executable, "-m", "airflow"]


# --- login ------------------------------------------------------------------------------------------------------


def test_the_password_file_is_not_written_through_a_planted_link(tmp_path):
    """The staging file's name is unpredictable and created exclusively: a link planted at the old guessable name
    (`.<file>.<pid>.tmp`) neither receives the secret nor redirects the write."""
    ui = DemoUi(home=tmp_path / "airflow")
    ui.home.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    planted = ui.passwords_file.with_name(f".{ui.passwords_file.name}.{os.getpid()}.tmp")
    planted.symlink_to(victim)
    password = demo_ui.ensure_password(ui)
    assert victim.read_text() == "untouched" and password not in victim.read_text()
    assert not ui.passwords_file.is_symlink() and ui.passwords_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in ui.home.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()] == []


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_airflow_log_servers_of_the_ui_listen_on_loopback_only(tmp_path):
    """Airflow's log server binds every interface; under the UI's environment it binds 127.0.0.1."""
    port = _free_port()
    ui = DemoUi(home=tmp_path / "airflow")
    env = demo_ui.ui_environment(ui, dict(os.environ))
    code = f"from airflow.utils.serve_logs import serve_logs; serve_logs({port})"
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _listening_addresses(port):
            if server.poll() is not None:
                pytest.fail(f"the log server exited {server.returncode}: {server.stderr.read().decode()[-500:]}")
            if time.monotonic() > deadline:
                pytest.fail("the log server did not listen within 60 s")
            time.sleep(0.2)
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, no 0.0.0.0 / :: socket
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_password_is_generated_once_into_a_private_file_and_never_into_the_environment(tmp_path):
    ui = DemoUi(home=tmp_path / "airflow")
    password = demo_ui.ensure_password(ui)
    assert len(password) >= 16
    assert ui.passwords_file.stat().st_mode & 0o777 == 0o600
    assert json.loads(ui.passwords_file.read_text()) == {"admin": password}
    assert demo_ui.ensure_password(ui) == password, "a restart keeps the password"
    env = demo_ui.ui_environment(ui, {"PATH": "/usr/bin"})
    assert not any(password in value for value in env.values())


def test_password_file_keeps_other_users_and_refuses_a_broken_file(tmp_path):
    ui = DemoUi(home=tmp_path, user="operator")
    ui.passwords_file.write_text(json.dumps({"admin": "kept-as-is"}))
    password = demo_ui.ensure_password(ui)
    assert json.loads(ui.passwords_file.read_text()) == {"admin": "kept-as-is", "operator": password}

    ui.passwords_file.write_text("{not json")
    with pytest.raises(DemoUiError, match=f"{ui.passwords_file}: not a JSON object"):
        demo_ui.ensure_password(ui)


# --- the trigger form's default ---------------------------------------------------------------------------------


def test_form_default_preset_file_is_the_demo_cycle_itself(tmp_path):
    ui = DemoUi(home=tmp_path)
    config = demo_config(["collection.candidates=2"])
    path = demo_ui.write_cycle_config(ui, config.model_dump(mode="json"))
    assert path == ui.cycle_config_file and path.stat().st_mode & 0o777 == 0o600
    from_file = validate_config(read_config_source(str(path)))
    # Same config, same hash: a run triggered with the form's defaults is the cycle `mass-ops demo` runs.
    assert from_file.config_hash() == config.config_hash()
    assert from_file.collection.candidates == 2
    assert from_file.models.served_name == "runs/demo/models/L0-bf16"
    assert from_file.config_hash() != demo_config().config_hash()


# --- starting and stopping ----------------------------------------------------------------------------------------


# The polite tree gets a long grace (stop_group returns as soon as the group is gone; a loaded machine can take
# seconds to unwind two interpreters), the stubborn one a short one (it ignores SIGINT and SIGTERM whatever the grace).
@pytest.mark.parametrize(
    ("kind", "grace_s", "signals"),
    [("polite", 30.0, ["SIGTERM"]), ("stubborn", 1.5, ["SIGTERM", "SIGTERM", "SIGKILL"])],
)
def test_stop_group_stops_the_whole_tree(tmp_path, kind, grace_s, signals):
    child_file = tmp_path / "child.pid"
    process = demo_ui.start_standalone(
        [sys.executable, "-c", FAKE_TREE, str(child_file), kind], {"PATH": os.environ["PATH"]}, tmp_path / "log"
    )
    try:
        child = int(_wait_for(child_file))
        assert os.getpgid(child) == process.pid, "the tree runs in its own process group"
        stopped = demo_ui.stop_group(process, grace_s=grace_s)
        assert stopped.signals == signals
        # What needed SIGKILL is named (command line and pid) for the line the UI prints; never silently.
        killed = [text.rsplit(" (pid ", 1)[1].rstrip(")") for text in stopped.killed]
        assert killed == ([str(child)] if kind == "stubborn" else [])
        assert not _alive(process.pid) and not _alive(child)
        assert demo_ui.group_members(process.pid) == []
    finally:
        demo_ui.stop_group(process, grace_s=0.3)


def test_one_ui_per_home_for_as_long_as_standalone_lives(tmp_path):
    ui = DemoUi(home=tmp_path / "airflow")
    fd = demo_ui.lock_home(ui)
    with pytest.raises(DemoUiError, match=f"another demo UI runs on {ui.home}"):
        demo_ui.lock_home(ui)
    child_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", FAKE_TREE, str(child_file), "polite"]
    process = demo_ui.start_standalone(argv, {"PATH": os.environ["PATH"]}, tmp_path / "log", pass_fds=(fd,))
    try:
        _wait_for(child_file)
        os.close(fd)  # this process is gone, say; standalone still holds the lock
        with pytest.raises(DemoUiError, match="stop it first"):
            demo_ui.lock_home(ui)
    finally:
        demo_ui.stop_group(process, grace_s=5)
    os.close(demo_ui.lock_home(ui))


def test_serve_reports_standalone_exiting_before_the_ui_is_up(tmp_path):
    ui = DemoUi(home=tmp_path, port=_free_port())
    demo_ui.ensure_password(ui)
    argv = [sys.executable, "-c", "print('no database here'); raise SystemExit(3)"]
    with pytest.raises(DemoUiError, match=r"exited with status 3 before the UI was up(.|\n)*no database here"):
        demo_ui.serve(ui, {"PATH": os.environ["PATH"]}, Console(quiet=True), argv=argv)


SERVE_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rich.console import Console
    from mass_ops_airflow.demo import ui as demo_ui

    home, child_file, fake_tree = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    demo_ui.wait_until_ready = lambda *args, **kwargs: None  # no Airflow here: the fake tree is "ready" at once
    ui = demo_ui.DemoUi(home=home, port=int(sys.argv[4]))
    demo_ui.ensure_password(ui)
    kind = sys.argv[5] if len(sys.argv) > 5 else "polite"
    argv = [sys.executable, "-c", fake_tree, child_file, kind]
    code = demo_ui.serve(ui, {"PATH": "/usr/bin:/bin"}, Console(width=200), argv=argv)
    print(f"serve returned {code}", flush=True)
    sys.exit(code)
    """
)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_sigterm_or_sighup_stops_standalone_and_model_servers_started_meanwhile(tmp_path, stop):
    child_file = tmp_path / "child.pid"
    command = [sys.executable, "-c", SERVE_CHILD, str(tmp_path / "home"), str(child_file), FAKE_TREE, "8"]
    cli = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_state = tmp_path / "runs" / "servers" / "demo-L0" / "L1.json"
    try:
        child = int(_wait_for(child_file))
        # A run's model server whose teardown never came (the UI is stopped mid-run).
        server = start_server(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            state_file=server_state,
            endpoint="http://127.0.0.1:1/v1",
            served_name="L1",
            log_path=tmp_path / "server.log",
        )
        cli.send_signal(stop)
        output, _ = cli.communicate(timeout=60)
        assert cli.returncode == 0, output
        assert "serve returned 0" in output and "stopped the model server recorded in" in output
        assert not _alive(child), "the component was stopped too"
        assert not is_alive(server) and not server_state.exists()
    finally:
        if cli.poll() is None:
            cli.kill()
        stop_server(server_state, grace_s=1)
        if child_file.exists() and _alive(int(child_file.read_text())):
            os.kill(int(child_file.read_text()), signal.SIGKILL)


def test_what_ignores_sigterm_is_killed_and_named_on_the_terminal(tmp_path):
    child_file = tmp_path / "child.pid"
    command = [sys.executable, "-c", SERVE_CHILD, str(tmp_path / "home"), str(child_file), FAKE_TREE, "8", "stubborn"]
    cli = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        child = int(_wait_for(child_file))
        cli.send_signal(signal.SIGINT)
        output, _ = cli.communicate(timeout=60)
        assert cli.returncode == 0, output
        assert f"killed (SIGKILL) what was still running {demo_ui.STOP_GRACE_S:.0f} s after SIGTERM: " in output
        assert f"(pid {child})" in output and not _alive(child)
    finally:
        if cli.poll() is None:
            cli.kill()
        if child_file.exists() and _alive(int(child_file.read_text())):
            os.kill(int(child_file.read_text()), signal.SIGKILL)


def test_only_model_servers_started_since_the_ui_are_stopped(tmp_path):
    servers = tmp_path / "servers"
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    options = {"endpoint": "http://127.0.0.1:1/v1", "served_name": "m", "log_path": tmp_path / "s.log"}
    before = start_server(sleep, state_file=servers / "before.json", **options)
    since = time.time()
    # The older server's record says it started before `since` (it belongs to someone else).
    record = json.loads((servers / "before.json").read_text())
    record["started_at"] = since - 60
    (servers / "before.json").write_text(json.dumps(record))
    after = start_server(sleep, state_file=servers / "scope" / "after.json", **options)
    try:
        assert demo_ui.stop_model_servers(since, servers) == [str(servers / "scope" / "after.json")]
        assert not is_alive(after) and is_alive(before)
        assert read_state(servers / "before.json") is not None
    finally:
        stop_server(servers / "before.json", grace_s=1)
        stop_server(servers / "scope" / "after.json", grace_s=1)
