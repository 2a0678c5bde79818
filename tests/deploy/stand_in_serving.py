"""The scripted policy stand-in as the local backend's model server, for the demo UI under test.

`stand_in_site/sitecustomize.py` calls `use_policy_stand_in()` at interpreter start in every Python process of the
UI under test (`demo_ui_process` puts that folder on PYTHONPATH): where a stage would start `transformers serve
MODEL --host H --port P`, it starts `python -m tests.policy_server` on the same host and port, listing MODEL as its
served name. The server is recorded, probed and stopped exactly as the real one; the cycle's episodes run real
qwen-code against it, and render, training and export use the tiny L0 weights as always.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

STAND_IN_MODULE = "tests.policy_server"


def stand_in_serve_argv(model: str, *, port: int, host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:
    """What `transformers_serve_argv` returns, with the policy stand-in in place of `transformers serve`
    (`extra` is for the real server's device and dtype flags, which the stand-in does not have)."""
    return [sys.executable, "-m", STAND_IN_MODULE, "--host", host, "--port", str(port), "--model", model]


def use_policy_stand_in() -> None:
    """Make the local backend start the stand-in (callers import `transformers_serve_argv` at call time)."""
    import mass_ops.compute.local as local

    local.transformers_serve_argv = stand_in_serve_argv
