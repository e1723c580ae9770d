"""loraplex kernels package."""
