"""The paged KV cache: blocks, the block pool with automatic prefix caching, the manager.

Pure Python (no torch): the tensors live in the model runner; this package decides which
physical block holds which tokens.
"""

from loraplex.engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from loraplex.engine.kv_cache.block_pool import BlockPool
from loraplex.engine.kv_cache.block_table import BlockTable
from loraplex.engine.kv_cache.manager import BlockCopy, KVCacheManager, PrefixMatch, SlotAllocation
from loraplex.engine.kv_cache.stats import HitCounts, PrefixCacheStats

__all__ = [
    "BlockCopy",
    "BlockPool",
    "BlockTable",
    "FreeBlockQueue",
    "HitCounts",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "PrefixMatch",
    "SlotAllocation",
]
