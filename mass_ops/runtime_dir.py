"""Where the tools mass-ops installs for itself live: Node 22, qwen-code, the Qwen3 tokenizer.

`$MASS_RUNTIME_DIR` when set (container images use /opt/mass-runtime), else `<repo>/.runtime`.
"""

from __future__ import annotations

import os
from pathlib import Path

RUNTIME_DIR_ENV = "MASS_RUNTIME_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[1]


def default_runtime_dir() -> Path:
    """`$MASS_RUNTIME_DIR` if set, else `<repo>/.runtime`."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    return Path(configured).expanduser().resolve() if configured else _REPO_ROOT / ".runtime"
