"""The Litestar application: configuration, shared state, auth, errors and the app factory."""
