"""Artifact store in an S3 bucket (AWS, MinIO, Ceph RGW, or any S3-compatible endpoint).

Endpoint and credentials come only from the standard AWS chain; nothing here accepts, stores, logs or prints a
credential. The SHA-256 is stored as object metadata (``x-amz-meta-sha256``) and checked by every full read.
Objects appear only when complete (one PUT, or a multipart upload aborted on any failure). Every client gets the
timeouts and bounded retries of `mass_ops.store.timeouts`; failures are `ArtifactUnavailableError`, one line naming
the action and the URI. ``MASS_S3_MULTIPART_THRESHOLD`` (default 64 MiB) picks multipart uploads.
Integrity and atomicity in depth: docs/storage.md (`mass_ops.store.s3_artifacts`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import botocore.session
from botocore.exceptions import BotoCoreError, ClientError
from botocore.loaders import Loader, create_loader

from mass_ops.store.artifacts import (
    PROBE_DIR,
    RESERVED_TOP_LEVEL,
    ArtifactInfo,
    ArtifactNotFoundError,
    ArtifactSourceError,
    ArtifactStore,
    ArtifactStoreConfigError,
    StagingLeftover,
    VerifiedStream,
    copy_and_hash,
    file_sha256,
    key_problem,
    require_source_file,
    validate_key,
    validate_prefix,
)
from mass_ops.store.timeouts import StoreTimeouts

logger = logging.getLogger(__name__)

MULTIPART_THRESHOLD_ENV = "MASS_S3_MULTIPART_THRESHOLD"
DEFAULT_MULTIPART_THRESHOLD = 64 * 1024 * 1024
DEFAULT_PART_SIZE = 8 * 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts in one upload
SHA256_METADATA = "sha256"
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into (bucket, prefix without surrounding slashes); refuse anything else.

    Error messages never echo the URL: a malformed one may carry credentials or a presigned query.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ArtifactStoreConfigError(f"S3 artifact store URL is malformed: {exc}") from exc
    if parts.scheme.lower() != "s3":
        raise ArtifactStoreConfigError(f"not an S3 URL (scheme {parts.scheme!r}); expected s3://bucket/prefix")
    if "@" in parts.netloc:
        raise ArtifactStoreConfigError(
            "S3 artifact store URL must not carry credentials; they come from the environment or the AWS credential "
            "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance or web-identity roles)"
        )
    if parts.query or parts.fragment:
        raise ArtifactStoreConfigError("S3 artifact store URL must not have a query string or fragment")
    if ":" in parts.netloc:
        raise ArtifactStoreConfigError(
            "S3 artifact store URL names a port; set the endpoint with AWS_ENDPOINT_URL_S3 instead"
        )
    return check_bucket(parts.netloc), check_prefix(parts.path.removeprefix("/").removesuffix("/"))


def check_bucket(bucket: str) -> str:
    """Return `bucket` if it is a valid S3 bucket name, else raise `ArtifactStoreConfigError`."""
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ArtifactStoreConfigError(
            f"invalid S3 bucket name {bucket!r}: 3-63 lowercase letters, digits, dots and hyphens, "
            "starting and ending with a letter or digit"
        )
    return bucket


def check_prefix(prefix: str) -> str:
    """Return the store prefix (no surrounding '/') if it follows the key rules, else raise."""
    if prefix:
        problem = key_problem(prefix)
        if problem is not None:
            raise ArtifactStoreConfigError(f"invalid S3 prefix {prefix!r} in artifact store URL: {problem}")
    return prefix


def multipart_threshold_from_env() -> int:
    """`MASS_S3_MULTIPART_THRESHOLD` in bytes, or the default when unset."""
    raw = os.environ.get(MULTIPART_THRESHOLD_ENV, "").strip()
    if not raw:
        return DEFAULT_MULTIPART_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ArtifactStoreConfigError(f"{MULTIPART_THRESHOLD_ENV}={raw!r} must be a positive whole number of bytes")
    return value


@functools.cache
def _service_model_loader() -> Loader:
    return create_loader()


def new_s3_client(config: Any) -> Any:
    """A fresh S3 client with the botocore `config`: endpoint, region and credentials resolved now through the
    standard chain.

    A new botocore session per client keeps resolution current (environment, profile), while the parsed service
    models are shared between sessions; parsing them is most of the cost of making a client.
    """
    session = botocore.session.Session()
    session.register_component("data_loader", _service_model_loader())
    return session.create_client("s3", config=config)


class S3ArtifactStore(ArtifactStore):
    """Artifacts as objects ``<prefix>/<key>`` in `bucket`; see the module docstring for integrity and atomicity."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold: int | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = 4,
        timeouts: StoreTimeouts | None = None,
    ) -> None:
        self._bucket = check_bucket(bucket)
        self._prefix = check_prefix(prefix.removeprefix("/").removesuffix("/"))
        self._multipart_threshold = (
            multipart_threshold_from_env() if multipart_threshold is None else multipart_threshold
        )
        if self._multipart_threshold < 1:
            raise ArtifactStoreConfigError(f"multipart threshold must be positive, got {self._multipart_threshold}")
        if part_size < MIN_PART_SIZE:
            raise ArtifactStoreConfigError(f"S3 part size must be at least {MIN_PART_SIZE} bytes, got {part_size}")
        if max_concurrency < 1:
            raise ArtifactStoreConfigError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self._part_size = part_size
        self._max_concurrency = max_concurrency
        self.timeouts = timeouts or StoreTimeouts.from_env()
        self._client: Any = new_s3_client(
            self.timeouts.botocore_config(max_pool_connections=max(10, max_concurrency + 2))
        )
        # Mirror boto3's managed transfers: with the default "when_supported" checksum policy, parts carry a CRC32
        # the server checks; with "when_required" (older MinIO/Ceph) none is sent.
        calculation = getattr(self._client.meta.config, "request_checksum_calculation", None)
        self._part_checksum: str | None = "CRC32" if calculation == "when_supported" else None

    @classmethod
    def from_url(cls, url: str) -> S3ArtifactStore:
        """Open ``s3://bucket/prefix``."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix)

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def url(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    def _object_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self._bucket}/{self._object_key(validate_key(key))}"

    @contextlib.contextmanager
    def _s3_errors(self, action: str, target: str) -> Iterator[None]:
        """Turn botocore failures into artifact errors that name the action and the URI (never credentials)."""
        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "unknown"))
            if code in _NOT_FOUND_CODES:
                raise ArtifactNotFoundError(f"artifact {target} does not exist") from exc
            if code == "NoSuchBucket":
                raise ArtifactStoreConfigError(f"S3 bucket {self._bucket!r} of {self.url} does not exist") from exc
            message = str(error.get("Message", "") or "").strip()
            raise self._unavailable(f"S3 {action}", target, f"{code}: {message}" if message else code) from exc
        except BotoCoreError as exc:
            raise self._unavailable(f"S3 {action}", target, exc) from exc

    # --- writing ---

    def _put_object(self, key: str, data: bytes, sha256: str) -> ArtifactInfo:
        uri = self.uri(key)
        with self._s3_errors("upload", uri):
            self._client.put_object(
                Bucket=self._bucket, Key=self._object_key(key), Body=data, Metadata={SHA256_METADATA: sha256}
            )
        logger.debug("stored %s (%d bytes, sha256 %s, single PUT)", uri, len(data), sha256)
        return ArtifactInfo(uri=uri, key=key, sha256=sha256, size=len(data))

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> ArtifactInfo:
        if isinstance(data, bytes | bytearray | memoryview) and memoryview(data).nbytes <= self._multipart_threshold:
            key = validate_key(key)
            payload = bytes(data)
            return self._put_object(key, payload, hashlib.sha256(payload).hexdigest())
        return super().put_bytes(key, data)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> ArtifactInfo:
        # No staging copy: hash the file in place, then upload it (re-hashed on the way, see module docstring).
        key = validate_key(key)
        source = require_source_file(path, key)
        sha256, size = file_sha256(source)
        return self._upload_file(key, source, sha256, size)

    def _publish(self, key: str, staged: Path, sha256: str, size: int) -> ArtifactInfo:
        return self._upload_file(key, staged, sha256, size)

    def _upload_file(self, key: str, path: Path, sha256: str, size: int) -> ArtifactInfo:
        if size <= self._multipart_threshold:
            data = path.read_bytes()
            if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
                raise ArtifactSourceError(f"{path} changed while it was being stored as {self.uri(key)}")
            return self._put_object(key, data, sha256)
        uri = self.uri(key)
        object_key = self._object_key(key)
        create: dict[str, Any] = {"Bucket": self._bucket, "Key": object_key, "Metadata": {SHA256_METADATA: sha256}}
        if self._part_checksum:
            create["ChecksumAlgorithm"] = self._part_checksum
        with self._s3_errors("upload", uri):
            upload_id = self._client.create_multipart_upload(**create)["UploadId"]
        try:
            parts = self._upload_parts(key, object_key, upload_id, path, sha256, size)
            with self._s3_errors("upload", uri):
                self._client.complete_multipart_upload(
                    Bucket=self._bucket, Key=object_key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException:
            self._abort_upload(object_key, upload_id, uri)
            raise
        logger.debug("stored %s (%d bytes, sha256 %s, %d parts)", uri, size, sha256, len(parts))
        return ArtifactInfo(uri=uri, key=key, sha256=sha256, size=size)

    def _upload_parts(
        self, key: str, object_key: str, upload_id: str, path: Path, sha256: str, size: int
    ) -> list[dict[str, Any]]:
        """Upload `path` in parts, at most `max_concurrency` in flight; return the part list in order."""
        part_size = max(self._part_size, -(-size // MAX_PARTS))
        uri = self.uri(key)
        digest = hashlib.sha256()
        read = 0
        parts: list[dict[str, Any]] = []
        pending: deque[Future[dict[str, Any]]] = deque()
        with ThreadPoolExecutor(max_workers=self._max_concurrency, thread_name_prefix="s3-part") as pool:
            try:
                with path.open("rb") as source:
                    number = 0
                    while chunk := source.read(part_size):
                        number += 1
                        digest.update(chunk)
                        read += len(chunk)
                        if len(pending) >= self._max_concurrency:
                            parts.append(pending.popleft().result())
                        pending.append(pool.submit(self._upload_part, uri, object_key, upload_id, number, chunk))
                while pending:
                    parts.append(pending.popleft().result())
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        if read != size or digest.hexdigest() != sha256:
            raise ArtifactSourceError(f"{path} changed while it was being stored as {uri}")
        return parts

    def _upload_part(self, uri: str, object_key: str, upload_id: str, number: int, chunk: bytes) -> dict[str, Any]:
        request: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": object_key,
            "UploadId": upload_id,
            "PartNumber": number,
            "Body": chunk,
        }
        if self._part_checksum:
            request["ChecksumAlgorithm"] = self._part_checksum
        with self._s3_errors(f"upload of part {number}", uri):
            response = self._client.upload_part(**request)
        part = {"PartNumber": number, "ETag": response["ETag"]}
        checksum_field = f"Checksum{self._part_checksum}" if self._part_checksum else None
        if checksum_field and checksum_field in response:
            part[checksum_field] = response[checksum_field]
        return part

    def _abort_upload(self, object_key: str, upload_id: str, uri: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=object_key, UploadId=upload_id)
        except (ClientError, BotoCoreError) as exc:
            # The parts stay invisible either way; a lifecycle rule reclaims them.
            logger.warning("could not abort multipart upload %s of %s: %s", upload_id, uri, exc)

    # --- reading ---

    def _open_verified(self, key: str) -> VerifiedStream:
        uri = self.uri(key)
        with self._s3_errors("download", uri):
            response = self._client.get_object(Bucket=self._bucket, Key=self._object_key(key))
        return VerifiedStream(
            _BodyReader(response["Body"], lambda exc: self._unavailable("S3 download", uri, exc)),
            uri=uri,
            expected_sha256=response.get("Metadata", {}).get(SHA256_METADATA),
            expected_size=response.get("ContentLength"),
        )

    def _head(self, key: str) -> dict[str, Any]:
        uri = self.uri(key)
        with self._s3_errors("lookup", uri):
            head: dict[str, Any] = self._client.head_object(Bucket=self._bucket, Key=self._object_key(key))
            return head

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ArtifactNotFoundError:
            return False
        return True

    def info(self, key: str) -> ArtifactInfo:
        head = self._head(key)
        sha256 = head.get("Metadata", {}).get(SHA256_METADATA)
        size = int(head["ContentLength"])
        if not sha256:
            # Written by another tool: hash the bytes instead.
            with self._open_verified(key) as stream:
                sha256, size = copy_and_hash(stream)
        return ArtifactInfo(uri=self.uri(key), key=key, sha256=sha256, size=size)

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        root = f"{self._prefix}/" if self._prefix else ""
        keys: list[str] = []
        with self._s3_errors("listing", f"{self.url}/{prefix}"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=root + prefix):
                keys.extend(item["Key"][len(root) :] for item in page.get("Contents", []))
        # Probe objects in flight (or left by a killed probe) are the store's, not artifacts.
        return sorted(key for key in keys if key.split("/", 1)[0] not in RESERVED_TOP_LEVEL)

    def age_s(self, key: str) -> float:
        modified: datetime = self._head(key)["LastModified"]
        return max(0.0, time.time() - modified.timestamp())

    def staging_leftovers(self, older_than_s: float) -> builtins.list[StagingLeftover]:
        """Local staging files, multipart uploads under the prefix started more than `older_than_s` seconds ago
        (their parts cost storage and are invisible to every reader), and old probe objects."""
        found = super().staging_leftovers(older_than_s)
        now = time.time()
        root = f"{self._prefix}/" if self._prefix else ""
        with self._s3_errors("listing of multipart uploads", self.url):
            for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self._bucket, Prefix=root):
                for upload in page.get("Uploads", []):
                    age = now - upload["Initiated"].timestamp()
                    if age > older_than_s:
                        object_key, upload_id = upload["Key"], upload["UploadId"]
                        uri = f"s3://{self._bucket}/{object_key}"
                        found.append(
                            StagingLeftover(
                                "multipart upload",
                                f"{uri} (upload {upload_id[:12]}…)",
                                None,
                                age,
                                functools.partial(self._abort_upload, object_key, upload_id, uri),
                            )
                        )
        with self._s3_errors("listing of probe objects", self.url):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=f"{root}{PROBE_DIR}/"):
                for item in page.get("Contents", []):
                    age = now - item["LastModified"].timestamp()
                    if age > older_than_s:
                        found.append(
                            StagingLeftover(
                                "probe object",
                                f"s3://{self._bucket}/{item['Key']}",
                                int(item.get("Size", 0)),
                                age,
                                functools.partial(self._client.delete_object, Bucket=self._bucket, Key=item["Key"]),
                            )
                        )
        return found

    def delete(self, key: str) -> None:
        uri = self.uri(key)
        with self._s3_errors("delete", uri):
            self._client.delete_object(Bucket=self._bucket, Key=self._object_key(key))
        logger.debug("deleted %s", uri)


class _BodyReader:
    """A response body whose read failures (read timeout, connection cut) become the store's one-line error."""

    def __init__(self, body: Any, wrap: Callable[[Exception], BaseException]) -> None:
        self._body = body  # botocore's StreamingBody (untyped)
        self._wrap = wrap

    def read(self, size: int = -1) -> bytes:
        try:
            data: bytes = self._body.read(size)
        except (BotoCoreError, OSError) as exc:
            raise self._wrap(exc) from exc
        return data

    def close(self) -> None:
        self._body.close()
