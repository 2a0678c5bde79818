"""The local backend's agent sandbox: bubblewrap (`bwrap`) namespaces around one episode's agent (issue #25.7).

Contract: the agent runs in its own user, PID, IPC, UTS, mount, cgroup and network namespaces with every capability
dropped. It sees read-only system folders, a short list of `/etc` entries, the runner's Python and the agent
runtime; read-write only its workspace, its home and a private `/tmp`; its own `/proc` and a minimal `/dev`; nothing
else. Its network is loopback only: the bridge relays `127.0.0.1:PROXY_PORT_IN_SANDBOX` (and, with
`runtime.sandbox_egress: public`, `EGRESS_PORT_IN_SANDBOX`) to Unix sockets of the attempt. No process can outlive
the sandbox (`--die-with-parent`, PID namespace). Trust model in full: docs/security.md (`mass_ops.compute.sandbox`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mass_ops.compute.egress import EGRESS_SOCKET_NAME
from mass_ops.errors import InfrastructureError

# Where the sandbox sees the proxy's socket folder, and the port the bridge serves there (any port: the network
# namespace is the sandbox's own, so it cannot collide with another episode's).
PROXY_DIR_IN_SANDBOX = "/run/mass-proxy"
PROXY_SOCKET_NAME = "proxy.sock"
PROXY_PORT_IN_SANDBOX = 39371
EGRESS_PORT_IN_SANDBOX = 39372  # the egress proxy (`mass_ops.compute.egress`), when the attempt has one
BRIDGE_IN_SANDBOX = "/run/mass-bridge.py"
BRIDGE_SCRIPT = Path(__file__).with_name("sandbox_bridge.py")
SANDBOX_HOSTNAME = "mass-episode"
# How a sandboxed attempt's status document describes the sandbox.
BWRAP_DESCRIPTION = (
    "bubblewrap sandbox: own user/pid/ipc/uts/mount/cgroup/network namespaces, no capabilities; read-only system, "
    "runtime and minimal /etc; writable workspace, home and private /tmp; network: its episode proxy only, and "
    "public internet addresses through its egress proxy where runtime.sandbox_egress is public"
)

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# `/etc` entries a program may need to start, resolve names, verify TLS and tell the time; nothing that holds
# credentials (`shadow`, `gshadow`, `sudoers`, `npmrc`, `pip.conf`, service configs).
ETC_ENTRIES = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "ssl",
    "pki",
    "resolv.conf",
    "hosts",
    "host.conf",
    "gai.conf",
    "nsswitch.conf",
    "passwd",
    "group",
    "localtime",
    "timezone",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "os-release",
    "services",
    "protocols",
    "mime.types",
    "inputrc",
    "terminfo",
    "fonts",
)
NAMESPACE_FLAGS = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-net",
    "--unshare-cgroup-try",
    "--disable-userns",
    "--cap-drop",
    "ALL",
    "--die-with-parent",
    "--new-session",
)
PROBE_TIMEOUT_S = 20.0


class SandboxError(InfrastructureError):
    """The sandbox's host side cannot be prepared (its socket folder); the message is one line."""


@dataclass(frozen=True)
class SandboxSupport:
    """Whether bubblewrap can build the sandbox on this machine: its path, or why not (one line)."""

    bwrap: str | None
    reason: str

    @property
    def available(self) -> bool:
        return self.bwrap is not None


@functools.cache
def bwrap_support() -> SandboxSupport:
    """Probe once per process: `bwrap` is installed and can create every namespace the sandbox uses (user namespaces
    may be disabled, e.g. in an unprivileged container)."""
    found = shutil.which("bwrap")
    if found is None:
        return SandboxSupport(None, "bubblewrap (bwrap) is not installed")
    argv = [found, *NAMESPACE_FLAGS, *_system_view(), "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return SandboxSupport(None, f"{found} cannot run: {type(exc).__name__}")
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return SandboxSupport(None, f"{found} cannot create the sandbox's namespaces here ({why})")
    return SandboxSupport(found, "bubblewrap sandbox available")


def runtime_paths(*executables: Path | str) -> tuple[Path, ...]:
    """The read-only folders and files that run the agent and the bridge: the runner's Python (prefix and base
    prefix), and for each executable its outermost `node_modules` folder (where Node resolves its packages; not the
    folder above, which may be a home directory) or, outside npm, the file itself and what its links lead to.
    System folders are shown anyway and are left out."""
    found: list[Path] = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    for executable in executables:
        path = Path(os.path.abspath(executable))
        parts = path.parts
        if "node_modules" in parts:
            found.append(Path(*parts[: parts.index("node_modules") + 1]))
            continue
        found.append(path)
        found.append(path.resolve())
    return _outermost(p for p in found if not _is_system(p))


def proxy_socket_dir(attempt_root: Path) -> Path:
    """The host folder that holds an attempt's proxy socket: short (a Unix socket path has at most 107 bytes, an
    attempt folder can be longer), private, and derived from the attempt folder (which the runner holds locked)."""
    digest = hashlib.sha256(str(attempt_root.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"mass-proxy-{digest}"


def create_socket_dir(folder: Path) -> Path:
    """Create `folder` (mode 0700) for the proxy socket, replacing a leftover of a crashed attempt of ours; returns
    the socket's path. Refused (`SandboxError`) when the name is taken by a link or by another user's entry."""
    socket = folder / PROXY_SOCKET_NAME
    if len(os.fsencode(socket)) > 107:
        raise SandboxError(f"episode sandbox: socket path {socket} is too long; set TMPDIR to a shorter folder")
    with contextlib.suppress(FileNotFoundError):
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise SandboxError(f"episode sandbox: {folder} exists and is not our own folder; remove it")
        shutil.rmtree(folder)
    os.mkdir(folder, 0o700)
    return socket


def remove_socket_dir(folder: Path) -> None:
    """Remove an attempt's socket folder (nothing of it is evidence)."""
    shutil.rmtree(folder, ignore_errors=True)


def sandboxed_argv(
    agent_argv: Sequence[str],
    *,
    bwrap: str,
    workspace: Path,
    home: Path,
    tmp: Path,
    socket_dir: Path,
    runtime: Iterable[Path],
    egress: bool = False,
) -> list[str]:
    """The command line that runs `agent_argv` in the sandbox (module docstring), behind the bridge to the proxy.

    `workspace` and `home` appear at their own paths (read-write), `tmp` as `/tmp`, `socket_dir` read-only at
    `PROXY_DIR_IN_SANDBOX`, every `runtime` path read-only at its own path. The agent starts in `workspace`. With
    `egress` the bridge also serves `EGRESS_PORT_IN_SANDBOX`, relayed to the egress proxy's socket in `socket_dir`.
    """
    argv = [bwrap, *NAMESPACE_FLAGS, "--hostname", SANDBOX_HOSTNAME, *_system_view()]
    # /tmp first: the runtime, the workspace and home may lie below /tmp, and their mounts must land on top of it.
    argv += ["--bind", str(tmp), "/tmp", "--symlink", "/tmp", "/var/tmp"]
    for path in _outermost(runtime):
        argv += ["--ro-bind", str(path), str(path)]
    argv += ["--bind", str(workspace), str(workspace), "--bind", str(home), str(home)]
    argv += ["--ro-bind", str(socket_dir), PROXY_DIR_IN_SANDBOX, "--ro-bind", str(BRIDGE_SCRIPT), BRIDGE_IN_SANDBOX]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", str(workspace)]
    bridge = [sys.executable, "-I", "-S", BRIDGE_IN_SANDBOX]
    services = [f"{PROXY_DIR_IN_SANDBOX}/{PROXY_SOCKET_NAME}", str(PROXY_PORT_IN_SANDBOX)]
    if egress:
        services += [f"{PROXY_DIR_IN_SANDBOX}/{EGRESS_SOCKET_NAME}", str(EGRESS_PORT_IN_SANDBOX)]
    return [*argv, "--", *bridge, *services, "--", *agent_argv]


def proxy_url_in_sandbox() -> str:
    """The base URL of the episode proxy as the sandboxed agent reaches it (through the bridge)."""
    return f"http://127.0.0.1:{PROXY_PORT_IN_SANDBOX}"


def egress_url_in_sandbox() -> str:
    """The egress proxy's URL as the sandboxed agent reaches it (through the bridge): its `HTTPS_PROXY` and kin."""
    return f"http://127.0.0.1:{EGRESS_PORT_IN_SANDBOX}"


def _system_view() -> list[str]:
    """Read-only system folders (links stay links) and the `/etc` entries in `ETC_ENTRIES`."""
    argv: list[str] = []
    for name in SYSTEM_DIRS:
        if os.path.islink(name):
            argv += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            argv += ["--ro-bind", name, name]
    for entry in ETC_ENTRIES:
        argv += ["--ro-bind-try", f"/etc/{entry}", f"/etc/{entry}"]
    return argv


def _is_system(path: Path) -> bool:
    return any(path == Path(root) or Path(root) in path.parents for root in SYSTEM_DIRS)


def _outermost(paths: Iterable[Path]) -> tuple[Path, ...]:
    """The paths without duplicates and without any that lies inside another (a nested bind adds nothing)."""
    unique = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path == other or other in path.parents for other in kept):
            kept.append(path)
    return tuple(kept)
