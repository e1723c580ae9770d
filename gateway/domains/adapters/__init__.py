"""The adapters domain of the HTTP API (CONTRACT.md)."""

ROUTES: list = []
