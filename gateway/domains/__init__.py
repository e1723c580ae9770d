"""The HTTP API by domain; each package exports ``ROUTES`` (controllers and handlers)."""
