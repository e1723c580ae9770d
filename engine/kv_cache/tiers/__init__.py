"""KV cache tiers below the paged pool: host memory, local disk and a store shared by replicas.

Blocks evicted from the pool are offered to a ``TieredStore`` (write-through, off the step) and
loaded back into fresh pool blocks on a later prefix hit. Keys are the pool's block hashes;
records of different models, dtypes, block sizes or hash schemes never mix (``KVLayout``
fingerprints). docs/kv_tiers.md describes the formats, bounds and the choice of the shared store.
"""

from loraplex.engine.kv_cache.tiers.base import KVTier, TierStats
from loraplex.engine.kv_cache.tiers.codec import CorruptBlock, decode, encode
from loraplex.engine.kv_cache.tiers.disk import DiskTier
from loraplex.engine.kv_cache.tiers.host import HostTier
from loraplex.engine.kv_cache.tiers.layout import FORMAT_VERSION, KVLayout
from loraplex.engine.kv_cache.tiers.remote import RedisTier
from loraplex.engine.kv_cache.tiers.store import TieredStore

__all__ = [
    "FORMAT_VERSION",
    "CorruptBlock",
    "DiskTier",
    "HostTier",
    "KVLayout",
    "KVTier",
    "RedisTier",
    "TierStats",
    "TieredStore",
    "decode",
    "encode",
]
