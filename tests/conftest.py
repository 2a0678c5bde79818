"""Fixtures shared by the whole suite.

Postgres (the machine's server on 127.0.0.1:5432) and moto's standalone S3 server are real services; their
fixtures live in tests/fixtures/ and are registered here once for every test package.
"""

from __future__ import annotations

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.s3"]
