"""Durable state of mass-ops: artifacts (S3 or a local folder) and metadata (SQLAlchemy 2)."""
