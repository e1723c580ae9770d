"""Persistence: the ORM models, engine and session set-up, and schema migrations."""
