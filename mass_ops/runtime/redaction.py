"""Redaction of the API key from the files an attempt produced: a second line of defence.

The agent never holds the key (its proxy does), but an upstream could echo it. `SecretRedactor` rewrites each file
that holds it (temp file, then rename, mode kept) with `REDACTION` in its place; a key shorter than
`MIN_REDACTED_SECRET`, or the placeholder of a keyless local server, makes it inactive.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mass_ops.runtime.proxy import DEFAULT_KEY_VALUE, MIN_REDACTED_SECRET, REDACTION


class SecretRedactor:
    """Replaces every occurrence of the API key in files and folders the attempt produced (a second line of
    defence: the agent never holds the key; an empty secret makes the redactor inactive)."""

    def __init__(self, secret: str) -> None:
        encoded = secret.encode("utf-8")
        self._secret = encoded if len(encoded) >= MIN_REDACTED_SECRET and secret != DEFAULT_KEY_VALUE else b""

    @property
    def active(self) -> bool:
        return bool(self._secret)

    def file(self, path: Path) -> bool:
        """Redact `path` in place (temp file, then rename) if it holds the secret; returns whether it did."""
        if not self._secret or not path.is_file() or path.is_symlink() or not self._contains(path):
            return False
        mode = stat.S_IMODE(path.stat().st_mode)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".redact")
        try:
            with path.open("rb") as source, os.fdopen(fd, "wb") as target:
                for chunk in self._chunks(source):
                    target.write(chunk.replace(self._secret, REDACTION))
            os.chmod(temp, mode)
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        return True

    def tree(self, root: Path) -> list[str]:
        """Redact every regular file under `root` (links are not followed); returns the relative paths changed."""
        changed = []
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = Path(folder) / name
                with contextlib.suppress(OSError):
                    if self.file(path):
                        changed.append(str(path.relative_to(root)))
        return changed

    def _contains(self, path: Path) -> bool:
        with path.open("rb") as source:
            return any(self._secret in chunk for chunk in self._chunks(source))

    def _chunks(self, source: Any, size: int = 1 << 20) -> Iterator[bytes]:
        """The source's bytes in chunks such that every occurrence of the secret lies whole inside one chunk."""
        width = len(self._secret)
        carry = b""
        while block := source.read(size):
            data = carry + block
            # The last width-1 bytes may begin an occurrence that the next block completes: hold them back, unless
            # an occurrence straddles that cut, in which case the cut moves past it.
            cut = max(0, len(data) - (width - 1))
            start = data.find(self._secret, max(0, cut - width + 1), cut + width - 1)
            if start != -1 and start < cut:
                cut = start + width
            yield data[:cut]
            carry = data[cut:]
        if carry:
            yield carry
