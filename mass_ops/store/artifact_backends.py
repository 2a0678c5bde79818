"""Which artifact store a URL names: `open_artifact_store` picks the backend (S3 or a local folder).

It sits above the interface (`store.artifacts`) and both backends, so neither backend nor the interface imports it.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from mass_ops.store.artifacts import ArtifactStore, ArtifactStoreConfigError
from mass_ops.store.local_artifacts import LocalArtifactStore


def open_artifact_store(url: str, *, create: bool = True) -> ArtifactStore:
    """Open the store named by `url`: ``s3://bucket/prefix`` (S3), ``file:///abs/path`` or a plain folder path.

    S3 endpoint and credentials come only from boto3's standard environment/config chain (``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, instance roles ...); a URL carrying credentials is refused.
    A local folder is created if missing, and gets the store's own subfolders; with ``create=False`` nothing is
    created (to inspect a location before trusting it, as `store gc` does).
    """
    if not isinstance(url, str) or not url.strip():
        raise ArtifactStoreConfigError(
            "artifact store URL is empty; expected s3://bucket/prefix, file:///absolute/path or a folder path"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ArtifactStoreConfigError(f"artifact store URL is malformed: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme == "s3":
        # botocore is loaded only by whoever opens an S3 store.
        from mass_ops.store.s3_artifacts import S3ArtifactStore

        return S3ArtifactStore.from_url(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ArtifactStoreConfigError(
                f"artifact store file URL names host {parts.netloc!r}; only local paths (file:///path) are supported"
            )
        if parts.query or parts.fragment:
            raise ArtifactStoreConfigError("artifact store file URL must not have a query string or fragment")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ArtifactStoreConfigError(f"artifact store file URL must hold an absolute path, got {path!r}")
        return LocalArtifactStore(path, create=create)
    if scheme == "":
        return LocalArtifactStore(url, create=create)
    # Echo only the scheme: the rest of an unknown URL may hold credentials.
    raise ArtifactStoreConfigError(
        f"unsupported artifact store URL scheme {scheme!r}; use s3://bucket/prefix, file:///path or a folder path"
    )
