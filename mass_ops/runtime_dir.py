"""Where the tools mass-ops installs for itself live: Node 22, qwen-code, the Qwen3 tokenizer.

`$MASS_RUNTIME_DIR` when set (container images use /opt/mass-runtime), else `<repo>/.runtime`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUNTIME_DIR_ENV = "MASS_RUNTIME_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[1]


def default_runtime_dir() -> Path:
    """`$MASS_RUNTIME_DIR` if set, else `<repo>/.runtime`."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    return Path(configured).expanduser().resolve() if configured else _REPO_ROOT / ".runtime"


def installed_npm_version(package_dir: Path) -> str | None:
    """The version in an installed npm package's package.json, or None when it is absent or unreadable."""
    try:
        manifest = json.loads((package_dir / "package.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None
