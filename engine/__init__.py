"""loraplex engine package."""
