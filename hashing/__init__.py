"""Block hashing for automatic prefix caching, extra keys, and image keys.

Depends only on the standard library, msgpack, xxhash, pillow, imagehash and numpy: never on
``engine`` (docs/architecture.md's import rules).
"""
