"""Authentication: tenant API keys, the server secret, the admin key, and log redaction."""
