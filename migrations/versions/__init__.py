"""Alembic revisions, oldest first (``0001_initial`` creates every table)."""
