"""Alembic migrations for the ledger (``compilesvc migrate``)."""
