"""Metadata and artifact hooks over Airflow connections; absent connections fall back to the config."""

from __future__ import annotations

import json
import os

import pytest
from mass_ops_airflow.hooks import MassArtifactHook, MassMetadataHook, exported, storage_from_connections


def test_postgres_connection_becomes_a_sqlalchemy_url(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_MASS_METADATA",
        json.dumps(
            {
                "conn_type": "postgres",
                "host": "db.internal",
                "port": 5433,
                "login": "mass",
                "password": "p@ss/word",
                "schema": "mass_ops",
                "extra": {"sslmode": "require"},
            }
        ),
    )
    url = MassMetadataHook().get_uri()
    assert url == "postgresql://mass:p%40ss%2Fword@db.internal:5433/mass_ops?sslmode=require"
    from sqlalchemy.engine import make_url

    assert make_url(url).password == "p@ss/word"


def test_sqlite_connection_and_bad_types(monkeypatch, tmp_path):
    monkeypatch.setenv(
        "AIRFLOW_CONN_MASS_METADATA", json.dumps({"conn_type": "sqlite", "host": str(tmp_path / "m.db")})
    )
    assert MassMetadataHook().get_uri() == f"sqlite:///{tmp_path / 'm.db'}"
    monkeypatch.setenv("AIRFLOW_CONN_MASS_METADATA", json.dumps({"conn_type": "mysql", "host": "h", "schema": "s"}))
    with pytest.raises(ValueError, match="is not postgres or sqlite"):
        MassMetadataHook().get_uri()


def test_absent_connections_mean_the_config_decides(monkeypatch, tmp_path):
    monkeypatch.delenv("AIRFLOW_CONN_MASS_METADATA", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_MASS_ARTIFACTS", raising=False)
    assert MassMetadataHook().get_uri() is None
    assert MassArtifactHook().get_url() is None and MassArtifactHook().environment() == {}
    assert storage_from_connections() == {}
    fallback = f"sqlite:///{tmp_path / 'meta.db'}"
    repo = MassMetadataHook().get_repository(fallback)
    assert str(repo.store.url) == fallback


def test_artifact_connection_gives_url_and_credentials(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_MASS_ARTIFACTS",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIAEXAMPLE",
                "password": "secret-key-value",
                "extra": {"artifact_url": "s3://lab/mass", "endpoint_url": "http://minio:9000", "region_name": "x"},
            }
        ),
    )
    hook = MassArtifactHook()
    assert hook.get_url() == "s3://lab/mass"
    assert hook.environment() == {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "secret-key-value",
        "AWS_ENDPOINT_URL_S3": "http://minio:9000",
        "AWS_DEFAULT_REGION": "x",
    }
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "outer")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with hook.credentials_env():
        assert os.environ["AWS_ACCESS_KEY_ID"] == "AKIAEXAMPLE"
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == "secret-key-value"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "outer" and "AWS_SECRET_ACCESS_KEY" not in os.environ
    assert storage_from_connections() == {"artifact_url": "s3://lab/mass"}


def test_artifact_connection_needs_an_s3_url(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MASS_ARTIFACTS", json.dumps({"conn_type": "aws", "extra": {}}))
    with pytest.raises(ValueError, match="artifact_url must be s3://"):
        MassArtifactHook().get_url()


def test_exported_restores_even_on_error(monkeypatch):
    monkeypatch.delenv("MASS_HOOK_TEST", raising=False)
    with pytest.raises(RuntimeError), exported({"MASS_HOOK_TEST": "1"}):
        assert os.environ["MASS_HOOK_TEST"] == "1"
        raise RuntimeError("boom")
    assert "MASS_HOOK_TEST" not in os.environ
