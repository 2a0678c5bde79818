"""The one error a store failure becomes at the store boundary: `StorageError`, one line, password masked.

A store that does not answer, refuses the connection, is not a database, or cannot be written is an infrastructure
failure (exit status 1): rerunning once the store is back may succeed. The message says what failed, which store,
its URL with secrets masked, and the first line of the underlying reason — never a driver's multi-line dump.
"""

from __future__ import annotations

from mass_ops.errors import InfrastructureError
from mass_ops.store.urls import mask_secrets, mask_url

MAX_REASON_CHARS = 300


class StorageError(InfrastructureError):
    """A metadata or artifact store could not be reached, did not answer in time, or refused the operation."""


def one_line_reason(cause: BaseException | str) -> str:
    """The first non-empty line of `cause` (its type name when empty), secrets masked, at most 300 characters."""
    text = cause if isinstance(cause, str) else str(cause)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = lines[0] if lines else (cause if isinstance(cause, str) else type(cause).__name__)
    reason = mask_secrets(reason)
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…"


def storage_error(action: str, store: str, url: object, cause: BaseException | str) -> StorageError:
    """A `StorageError` reading ``<action> failed: <store> <masked url>: <reason>``.

    :param action: what was being done ("connect", "upload of s3://b/k", "probe write").
    :param store: which store ("metadata store", "artifact store").
    """
    return StorageError(f"{action} failed: {store} {mask_url(url)}: {one_line_reason(cause)}")
