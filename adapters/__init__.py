"""loraplex adapters package."""
