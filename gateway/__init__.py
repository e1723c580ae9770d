"""loraplex gateway package."""
