"""Where the tools mass-ops installs for itself live: Node 22, qwen-code, the Qwen3 tokenizer.

`$MASS_RUNTIME_DIR` when set (container images use /opt/mass-runtime; the repository's scripts use `./.runtime`),
else the user's cache folder (`$XDG_CACHE_HOME/mass-ops/runtime`, by default `~/.cache/mass-ops/runtime`), which
works the same from a source checkout and from an installed wheel.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUNTIME_DIR_ENV = "MASS_RUNTIME_DIR"


def default_runtime_dir() -> Path:
    """`$MASS_RUNTIME_DIR` if set, else `$XDG_CACHE_HOME/mass-ops/runtime` (default `~/.cache/mass-ops/runtime`)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser().resolve() / "mass-ops" / "runtime"


def installed_npm_version(package_dir: Path) -> str | None:
    """The version in an installed npm package's package.json, or None when it is absent or unreadable."""
    try:
        manifest = json.loads((package_dir / "package.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None
