"""Check, before a run starts, that both stores answer: the metadata database and the artifact store.

`probe_stores` is what ``validate`` and the first task of a cycle call, so a run with an unreachable, silent or
read-only store fails in its first minute with one line instead of at its last task with a traceback.
"""

from __future__ import annotations

from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactError
from mass_ops.store.errors import StorageError, storage_error
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.timeouts import StoreTimeouts


def probe_metadata_store(url: str, *, timeouts: StoreTimeouts | None = None) -> None:
    """``SELECT 1`` against the metadata database within the store timeouts; `StorageError` if it does not answer."""
    store = MetadataStore(url, pool_size=1, max_overflow=0, timeouts=timeouts)
    try:
        store.ping()
    finally:
        store.dispose()


def probe_artifact_store(url: str, *, timeouts: StoreTimeouts | None = None) -> None:
    """Write, read back and delete a small object under ``.probe/``; `StorageError` if the store cannot.

    An integrity failure of the read-back is reported as a `StorageError` too: a store that hands back other bytes
    than it was given is not usable, whatever the reason.
    """
    from mass_ops.store.s3_artifacts import S3ArtifactStore

    store = open_artifact_store(url)
    if timeouts is not None and isinstance(store, S3ArtifactStore):
        store = S3ArtifactStore(store.bucket, store.prefix, timeouts=timeouts)
    try:
        store.probe()
    except StorageError:
        raise
    except ArtifactError as exc:
        if isinstance(exc, ValueError):
            raise  # a configuration problem (bad URL, missing bucket) keeps its input-error type and exit 2
        raise storage_error("probe", "artifact store", store.url, exc) from exc


def probe_stores(metadata_url: str, artifact_url: str, *, timeouts: StoreTimeouts | None = None) -> None:
    """Both probes, metadata store first; returns None when both stores answer, else raises one `StorageError`
    (or an `InputError` for a URL that names no usable store)."""
    probe_metadata_store(metadata_url, timeouts=timeouts)
    probe_artifact_store(artifact_url, timeouts=timeouts)
