"""The model runner and what it runs.

Loading a model and sizing its KV pool, the step's forward pass over the paged cache with per-
request fault isolation, and the vision encoder cache (docs/engine.md).
"""
