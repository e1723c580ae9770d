"""Block hashing for automatic prefix caching, extra keys, and image keys.

One module per idea, imported one way: :mod:`.block_hash` (a block's hash, its canonical
encoding) <- :mod:`.block_encoder` (the same bytes on the hot path) <- :mod:`.request_hasher`
(one request's hash chain, which also takes :mod:`.extra_keys`); the image modules
(:mod:`.image_header` <- :mod:`.image_decode` <- :mod:`.image_keys`, :mod:`.image_limits`,
:mod:`.errors`) stand apart.

Depends only on the standard library, msgpack, xxhash, pillow, imagehash and numpy: never on
``engine`` (docs/architecture.md's import rules).
"""
