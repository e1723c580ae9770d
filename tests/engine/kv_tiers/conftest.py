import pytest
import torch

from loraplex.engine.kv_cache.tiers import KVLayout
from loraplex.hashing.request_hasher import RequestBlockHasher

BLOCK = 4


@pytest.fixture
def layout():
    """A small float32 layout: 2 layers, 1 KV head of 8, blocks of 4 tokens (512 bytes)."""
    return KVLayout("tiny@0123abcd", "float32", BLOCK, 2, 1, 8, "sha256")


def block(layout: KVLayout, seed: int) -> torch.Tensor:
    """A payload as the engine makes it: a [layers, 2, block, heads, dim] tensor's bytes."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.shape, generator=g, dtype=torch.float32).to(
        getattr(torch, layout.dtype)
    )
    return kv.view(torch.uint8).reshape(-1)


def keys(n: int, *, salt: str | None = None, lora: str | None = None, start: int = 0) -> list:
    """The real block hashes of ``n`` blocks of a prompt (tokens start, start+1, ...)."""
    hasher = RequestBlockHasher(BLOCK, cache_salt=salt, lora_digest=lora)
    return hasher.extend(range(start, start + n * BLOCK))
