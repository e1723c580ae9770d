"""The machine's memory figures for an automatic KV pool (``engine.kv_cache.sizing``).

CPU: ``MemAvailable`` from ``/proc/meminfo``, lowered to the cgroup's remaining limit where the
process runs in a memory-limited container (``MemAvailable`` reports the host's memory there).
CUDA: total and free device memory, the bytes the weights take, and the peak memory of one
profiling forward pass over ``max_num_batched_tokens`` tokens (vLLM's profile run: dummy
prompts of at most ``max_model_len`` tokens, no cached context, every sequence sampling).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache.sizing import KVPoolSizing, MemoryFigures, size_kv_pool


def mem_available_bytes(
    meminfo: str | Path = "/proc/meminfo", cgroup_root: str | Path = "/sys/fs/cgroup"
) -> int:
    """Bytes of RAM this process could still take without swapping.

    ``MemAvailable`` (the kernel's estimate, page cache that can be dropped included), or, where
    a cgroup v2 (``memory.max``) or v1 (``memory/memory.limit_in_bytes``) limit applies, the
    limit minus the cgroup's current usage if that is less. Without ``/proc/meminfo`` (not
    Linux): free physical pages (``sysconf``), an underestimate.

    Raises:
        OSError: neither source can be read.
    """
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    root = Path(cgroup_root)
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():  # "max" (v2) means no limit
            available = min(available, max(0, int(limit_text) - usage))
        break
    return available


@torch.inference_mode()
def profile_forward(
    model: torch.nn.Module,
    backend: AttentionBackend,
    *,
    num_tokens: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One dummy step of ``num_tokens`` prompt tokens through the model, with its own small cache.

    The tokens are split into prompts of at most ``max_model_len`` (vLLM's profile run), each
    prefilled from position 0 and sampled, so the step's activations and logits are as large as
    a real step of that many tokens without cached context.

    Returns:
        ``[num_prompts, vocab]`` float32 logits (for tests; callers drop them).
    """
    lengths = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
    blocks = [-(-n // block_size) for n in lengths]
    shape = (sum(blocks), block_size, model.num_kv_heads, model.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(model.num_layers)
    ]
    slots, positions, tables, first = [], [], [], 0
    for n, b in zip(lengths, blocks, strict=True):
        table = list(range(first, first + b))
        first += b
        tables.append(table + [0] * (max(blocks) - b))
        positions.extend(range(n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    hidden = model(ids, pos, caches, meta, backend)
    rows = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long, device=device)
    return model.compute_logits(hidden.index_select(0, rows)).float()


def measure_memory(
    model: torch.nn.Module,
    backend: AttentionBackend,
    *,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> MemoryFigures:
    """The figures ``kv_sizing.size_kv_pool`` needs for an automatic pool on ``device``.

    Call after the weights and LoRA slots are on the device and before the KV pool is.
    On CUDA this runs :func:`profile_forward` once (a second or so of start-up); on CPU it only
    reads ``/proc/meminfo``.

    Raises:
        OSError: CPU memory cannot be read.
        torch.OutOfMemoryError: the profiling step itself does not fit on the device.
    """
    if device.type != "cuda":
        return MemoryFigures(available_bytes=mem_available_bytes())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(
        model,
        backend,
        num_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        device=device,
        dtype=dtype,
    )
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryFigures(
        available_bytes=total,
        weights_bytes=weights,
        activation_bytes=max(0, activation),
        free_bytes=free,
    )


def plan_kv_pool(
    config: EngineConfig,
    model: torch.nn.Module,
    backend: AttentionBackend,
    *,
    max_model_len: int,
    block_bytes: int,
    device: torch.device,
    dtype: torch.dtype,
) -> KVPoolSizing:
    """The engine's one call: measure the machine only when no explicit size was given.

    Args:
        config: The engine configuration (the sizing fields).
        model: The loaded model, LoRA slots installed.
        backend: The attention backend (for the CUDA profiling step).
        max_model_len: The longest sequence before clamping to the pool.
        block_bytes: Bytes of one KV block, K and V of all layers.
        device: The model's device.
        dtype: The KV cache dtype.

    Raises:
        ValueError: the pool cannot be sized (``kv_sizing.size_kv_pool``).
    """
    explicit = config.num_kv_blocks is not None or config.kv_cache_memory_bytes is not None
    memory = None
    if not explicit:
        memory = measure_memory(
            model,
            backend,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
        )
    return size_kv_pool(
        block_bytes=block_bytes,
        block_size=config.block_size,
        device=config.device,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_share=config.cpu_kv_cache_share,
        memory=memory,
    )


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for the KV pool; on CPU backed by an anonymous memory map.

    The kernel hands out anonymous pages zeroed on first touch (``MAP_ANONYMOUS``), so a
    CPU pool of several GiB costs nothing at start-up and only the blocks ever written take
    RAM, where ``torch.zeros`` writes every byte first (18 s for a 5.6 GiB pool on a busy
    2-core machine). Other devices: ``torch.zeros``.
    """
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    # The tensor holds the map (frombuffer keeps a reference): it lives as long as the tensor.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
