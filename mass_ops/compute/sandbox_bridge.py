"""Inside an episode's sandbox: serve 127.0.0.1:PORT by relaying to a host proxy's Unix socket, and run the agent.

Usage (see `mass_ops.compute.sandbox.sandboxed_argv`)::

    python -I -S sandbox_bridge.py SOCKET PORT [SOCKET PORT ...] -- AGENT_ARGV...

Each pair is one service: the episode proxy first, then the egress proxy when the attempt has one. Every port is
bound before the agent starts, so the agent's first request finds it. Each accepted connection is relayed byte for
byte to a new connection on its SOCKET, in both directions, until either side closes. The bridge exits with the
agent's exit status (128 + N when a signal N ended it); as the sandbox's main process, its exit ends the sandbox and
every process left in it. Standard library only: it runs with `-I -S`, with nothing of mass-ops importable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

CHUNK = 1 << 16
BACKLOG = 128


def _pump(source: socket.socket, target: socket.socket) -> None:
    """Copy `source` to `target` until `source` ends; then end `target`'s sending side (HTTP half-close)."""
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)


def _relay(client: socket.socket, socket_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, socket_path: str) -> None:
    while True:
        try:
            client, _address = listener.accept()
        except OSError:
            return
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # streamed tokens go on at once
        threading.Thread(target=_relay, args=(client, socket_path), daemon=True).start()


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else -1
    pairs = argv[:split]
    if split < 2 or split % 2 or split == len(argv) - 1 or not all(port.isdigit() for port in pairs[1::2]):
        sys.stderr.write("usage: sandbox_bridge.py SOCKET PORT [SOCKET PORT ...] -- AGENT_ARGV...\n")
        return 2
    command = argv[split + 1 :]
    for socket_path, port in zip(pairs[::2], pairs[1::2], strict=True):
        listener = socket.create_server(("127.0.0.1", int(port)), backlog=BACKLOG)
        threading.Thread(target=_serve, args=(listener, socket_path), daemon=True).start()
    try:
        # posix_spawn, not subprocess: the bridge starts before every agent, and subprocess costs it an import.
        # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec: give the agent the
        # defaults back (as subprocess does), or `yes | head` in its shell would never end by SIGPIPE.
        # bwrap adds PWD for its --chdir: drop it, so the agent's environment is exactly the runner's allow-list.
        env = {name: value for name, value in os.environ.items() if name != "PWD"}
        agent = os.posix_spawnp(command[0], command, env, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        sys.stderr.write(f"sandbox bridge: cannot start the agent {command[0]}: {exc}\n")
        return 127
    code = os.waitstatus_to_exitcode(os.waitpid(agent, 0)[1])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
