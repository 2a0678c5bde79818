"""Where the tools mass-ops installs for itself live: Node 22, qwen-code, the Qwen3 tokenizer.

`$MASS_RUNTIME_DIR` when set (container images use /opt/mass-runtime; the repository's scripts use `./.runtime`),
else the user's cache folder (`$XDG_CACHE_HOME/mass-ops/runtime`, by default `~/.cache/mass-ops/runtime`), which
works the same from a source checkout and from an installed wheel.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NPM_TIMEOUT_S = 600

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


def npm_install(prefix: Path, spec: str, *, error: type[Exception], timeout_s: float = NPM_TIMEOUT_S) -> None:
    """`npm install SPEC` into the folder `prefix` (created; a private package.json makes npm treat it as the project
    root instead of walking up to a parent project). Failures raise `error` with one line: npm missing, a timeout
    after `timeout_s`, or npm's exit status with the tail of its output."""
    npm = shutil.which("npm")
    if npm is None:
        raise error(f"npm is required to install {spec} but is not on PATH")
    prefix.mkdir(parents=True, exist_ok=True)
    manifest = prefix / "package.json"
    if not manifest.exists():
        manifest.write_text('{"name": "mass-ops-runtime", "private": true}\n', encoding="utf-8")
    cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", spec]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise error(f"npm install {spec} timed out after {timeout_s:g} s") from None
    if result.returncode != 0:
        tail = " ".join((result.stderr or result.stdout).strip()[-800:].split())
        raise error(f"npm install {spec} failed (exit {result.returncode}): {tail}")


@contextmanager
def install_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on `lock_path` for the duration of an install (concurrent processes wait for it)."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
