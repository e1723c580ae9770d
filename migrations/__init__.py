"""Alembic environment and revisions for the usage database (shipped with the distribution)."""
