"""Shared fixtures: real Postgres and SQLite ledgers, a real S3 server (weed mini)."""

pytest_plugins = ["tests.fixtures.ledger", "tests.fixtures.s3server"]
