"""Hooks over Airflow connections for mass-ops' own stores: the metadata database and the artifact store.

Both connections are optional. Without them a task uses what the config and the environment say
(MASS_METADATA_URL, MASS_ARTIFACT_URL, the AWS credential chain) — the laptop profile. With them, credentials live
in Airflow's connection store (or its secrets backend) instead of worker environment variables:

- `mass_metadata` (type postgres or sqlite): the metadata database, e.g. `postgresql://user:pass@host:5432/mass`
  with extras such as `sslmode` passed as query parameters;
- `mass_artifacts` (type aws): login/password = access key id/secret, extras `artifact_url` (`s3://bucket/prefix`,
  required), `endpoint_url` (MinIO, Ceph RGW), `region_name`, `aws_session_token`.

The artifact store's S3 client reads credentials only from the standard environment chain, so the hook exposes
them as environment variables for the duration of a stage call (`credentials_env`), never on a command line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from airflow.sdk import BaseHook

if TYPE_CHECKING:
    from mass_ops.store.artifacts import ArtifactStore
    from mass_ops.store.repository import MetadataRepository


def _connection(hook: BaseHook, conn_id: str) -> Any | None:
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return hook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


class MassMetadataHook(BaseHook):
    """The mass-ops metadata database named by an Airflow connection.

    :param mass_metadata_conn_id: connection id (type postgres or sqlite); absent connection = use the config.
    """

    conn_name_attr = "mass_metadata_conn_id"
    default_conn_name = "mass_metadata"
    conn_type = "postgres"
    hook_name = "mass-ops metadata"

    def __init__(self, mass_metadata_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mass_metadata_conn_id = mass_metadata_conn_id

    def get_uri(self) -> str | None:
        """SQLAlchemy URL of the database, or None when the connection is not defined."""
        conn = _connection(self, self.mass_metadata_conn_id)
        if conn is None:
            return None
        kind = (conn.conn_type or "").lower()
        if kind == "sqlite":
            path = conn.host or conn.schema
            if not path:
                raise ValueError(f"connection {self.mass_metadata_conn_id}: a sqlite connection needs the file path")
            return f"sqlite:///{path}"
        if kind not in ("postgres", "postgresql"):
            raise ValueError(
                f"connection {self.mass_metadata_conn_id}: type {conn.conn_type!r} is not postgres or sqlite"
            )
        if not conn.host or not conn.schema:
            raise ValueError(f"connection {self.mass_metadata_conn_id}: a postgres connection needs host and schema")
        auth = ""
        if conn.login:
            auth = quote(conn.login, safe="")
            if conn.password:
                auth += ":" + quote(conn.password, safe="")
            auth += "@"
        port = f":{conn.port}" if conn.port else ""
        query = urlencode({k: v for k, v in sorted(conn.extra_dejson.items()) if isinstance(v, str | int)})
        return f"postgresql://{auth}{conn.host}{port}/{quote(conn.schema, safe='')}" + (f"?{query}" if query else "")

    def get_repository(self, fallback_url: str) -> MetadataRepository:
        """The metadata repository of the connection, else of `fallback_url` (the config's)."""
        from mass_ops.store.repository import MetadataRepository

        return MetadataRepository.from_url(self.get_uri() or fallback_url)


class MassArtifactHook(BaseHook):
    """The mass-ops artifact store (S3-compatible) named by an Airflow AWS connection.

    :param mass_artifacts_conn_id: connection id (type aws); absent connection = use the config and environment.
    """

    conn_name_attr = "mass_artifacts_conn_id"
    default_conn_name = "mass_artifacts"
    conn_type = "aws"
    hook_name = "mass-ops artifacts"

    def __init__(self, mass_artifacts_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mass_artifacts_conn_id = mass_artifacts_conn_id

    def get_url(self) -> str | None:
        """`s3://bucket/prefix` from the connection's `artifact_url` extra; None without a connection."""
        conn = _connection(self, self.mass_artifacts_conn_id)
        if conn is None:
            return None
        url = conn.extra_dejson.get("artifact_url")
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise ValueError(f"connection {self.mass_artifacts_conn_id}: extra artifact_url must be s3://BUCKET/PREFIX")
        return url

    def environment(self) -> dict[str, str]:
        """AWS_* variables for boto3's standard chain, from the connection ({} without one)."""
        conn = _connection(self, self.mass_artifacts_conn_id)
        if conn is None:
            return {}
        extra = conn.extra_dejson
        env = {
            "AWS_ACCESS_KEY_ID": conn.login,
            "AWS_SECRET_ACCESS_KEY": conn.password,
            "AWS_SESSION_TOKEN": extra.get("aws_session_token"),
            "AWS_ENDPOINT_URL_S3": extra.get("endpoint_url"),
            "AWS_DEFAULT_REGION": extra.get("region_name"),
        }
        return {k: str(v) for k, v in env.items() if v}

    @contextlib.contextmanager
    def credentials_env(self) -> Iterator[dict[str, str]]:
        """Export the connection's credentials into this process's environment for the block, then restore it."""
        with exported(self.environment()) as env:
            yield env

    def get_store(self, fallback_url: str) -> ArtifactStore:
        """The artifact store of the connection's URL, else `fallback_url`; use inside `credentials_env()`."""
        from mass_ops.store.artifact_backends import open_artifact_store

        return open_artifact_store(self.get_url() or fallback_url)


@contextlib.contextmanager
def exported(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Set `env` in os.environ for the block; previous values (or absence) are restored afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield dict(env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def storage_from_connections(
    metadata_conn_id: str = MassMetadataHook.default_conn_name,
    artifacts_conn_id: str = MassArtifactHook.default_conn_name,
) -> dict[str, str]:
    """The `storage` overrides the defined connections imply ({} when neither is defined)."""
    storage = {}
    metadata = MassMetadataHook(metadata_conn_id).get_uri()
    if metadata:
        storage["metadata_url"] = metadata
    artifacts = MassArtifactHook(artifacts_conn_id).get_url()
    if artifacts:
        storage["artifact_url"] = artifacts
    return storage
