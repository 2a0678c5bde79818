"""mask_url / mask_secrets: no password or signing secret survives, everything else does."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from mass_ops.store.urls import mask_secrets, mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://u:p@h/db", "postgresql://u:***@h/db"),
        (
            "postgresql+psycopg://mass:s3cr3t@db.internal:5432/mass",
            "postgresql+psycopg://mass:***@db.internal:5432/mass",
        ),
        ("postgresql://mass:p@ss@w0rd@db/mass", "postgresql://mass:***@db/mass"),
        ("postgresql://mass@db/mass", "postgresql://mass@db/mass"),
        (
            "postgresql://db/mass?user=u&password=hunter2&sslmode=require",
            "postgresql://db/mass?user=u&password=***&sslmode=require",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc123&x=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&X-Amz-Signature=***&x=1",
        ),
        ("https://h/p?token=t0k&api_key=k3y&sig=s", "https://h/p?token=***&api_key=***&sig=***"),
        ("sqlite:////var/lib/mass/metadata.db", "sqlite:////var/lib/mass/metadata.db"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("not a url at all", "not a url at all"),
    ],
)
def test_mask_url(url: str, masked: str):
    assert mask_url(url) == masked


def test_mask_url_of_a_sqlalchemy_url():
    assert mask_url(make_url("postgresql://u:secret@h/db")) == "postgresql://u:***@h/db"


def test_mask_secrets_in_driver_messages():
    text = "could not connect to host=db port=5432 password=hunter2 via postgresql://u:hunter2@db/x (dsn 'token=abc')"
    masked = mask_secrets(text)
    assert "hunter2" not in masked and "abc" not in masked
    assert "host=db port=5432" in masked and "password=***" in masked and "postgresql://u:***@db/x" in masked
