"""Alembic environment and versions of the SQL store (`sluice migrate` runs them)."""
