"""How many KV blocks the pool gets: a pure decision from memory figures and the config.

The rules, first that applies (docs/kv_sizing.md):

1. ``num_kv_blocks`` given: exactly that many blocks.
2. ``kv_cache_memory_bytes`` given: as many blocks as fit in that many bytes.
3. CUDA, automatic (vLLM's ``--gpu-memory-utilization``): the budget is
   ``gpu_memory_utilization * total`` device memory; the weights (with the LoRA slots) and the
   peak activation memory of a profiling forward pass over ``max_num_batched_tokens`` tokens
   come off it, and the rest goes to KV blocks. The pool never takes more than is free on the
   device after the profiling pass minus that peak (another process's memory, the CUDA
   context): where vLLM refuses to start when another process holds memory, this takes less.
4. CPU, automatic (the role of vLLM's ``VLLM_CPU_KVCACHE_SPACE``): ``cpu_kv_cache_share`` of
   ``MemAvailable`` (``/proc/meminfo``, read after the weights are loaded), capped at what the
   running batch could ever hold at once: ``max_num_seqs`` sequences of ``max_model_len``
   tokens. Past the cap a block could only keep a finished request's prefix cached; on a CPU
   host that RAM is worth more to the OS, the page cache and the database. On CUDA the memory
   is reserved for the server anyway (as in vLLM), so the surplus serves the prefix cache.

An automatic pool that cannot hold one sequence of ``min(max_model_len, MIN_AUTO_TOKENS)``
tokens is refused with a message naming the figures and the flags, rather than starting a
server that can only serve toy prompts. Explicit sizes (rules 1 and 2) are taken as given; a
``max_model_len`` longer than the pool is clamped or refused afterwards
(``llm_engine._fit_to_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1024**3
MiB = 1024**2

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_SHARE = 0.5
MIN_AUTO_TOKENS = 1024
"""An automatic pool must hold one sequence of this many tokens (or ``max_model_len`` if less)."""

Rule = Literal["num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization", "cpu_kv_cache_share"]


@dataclass(frozen=True)
class MemoryFigures:
    """What the machine reported, in bytes, for an automatic pool.

    Attributes:
        available_bytes: CPU: ``MemAvailable`` after the weights are loaded. CUDA: the device's
            total memory.
        weights_bytes: Bytes the weights (and LoRA slots) take on the device; subtracted on
            CUDA only (on CPU ``MemAvailable`` is read after loading, so they are already out).
        activation_bytes: CUDA: peak memory of the profiling forward pass above the weights;
            0 on CPU (not profiled).
        free_bytes: CUDA: free device memory after the profiling pass (``cudaMemGetInfo``);
            None on CPU.
    """

    available_bytes: int
    weights_bytes: int = 0
    activation_bytes: int = 0
    free_bytes: int | None = None


@dataclass(frozen=True)
class KVPoolSizing:
    """The decision and how it was reached (for the start-up line, stats and docs).

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Tokens per block.
        block_bytes: Bytes of one block, K and V of every layer.
        rule: Which rule decided (see the module docstring).
        budget_bytes: Bytes the rule allowed the pool (before rounding down to blocks and
            before the cap).
        share: The fraction applied (utilization or CPU share); None for explicit sizes.
        available_bytes: The memory the share is of; None for explicit sizes.
        cap_blocks: The CPU cap when it cut the pool, else None.
    """

    num_blocks: int
    block_size: int
    block_bytes: int
    rule: Rule
    budget_bytes: int
    share: float | None = None
    available_bytes: int | None = None
    cap_blocks: int | None = None

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool's tensors take."""
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for the start-up output, e.g. ``KV pool of 512 blocks (16 tokens each) ...``."""
        head = (
            f"KV pool of {self.num_blocks} blocks ({self.block_size} tokens each, "
            f"{self.num_tokens} tokens) = {_gib(self.pool_bytes)}"
        )
        if self.rule == "num_kv_blocks":
            return f"{head} (--num-kv-blocks)"
        if self.rule == "kv_cache_memory":
            return f"{head} (--kv-cache-memory {_gib(self.budget_bytes)})"
        where = "device memory" if self.rule == "gpu_memory_utilization" else "RAM available"
        flag = (
            "--gpu-memory-utilization"
            if self.rule == "gpu_memory_utilization"
            else ("--cpu-kv-cache-share")
        )
        tail = f" ({flag} {self.share:g} of {_gib(self.available_bytes or 0)} {where}"
        if self.rule == "gpu_memory_utilization":
            tail += ", less weights and activations"
        if self.cap_blocks is not None:
            tail += "; capped at max-num-seqs x max-model-len"
        return head + tail + ")"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def size_kv_pool(
    *,
    block_bytes: int,
    block_size: int,
    device: Literal["cpu", "cuda"],
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    cpu_kv_cache_share: float = DEFAULT_CPU_KV_CACHE_SHARE,
    memory: MemoryFigures | None = None,
) -> KVPoolSizing:
    """Decide the pool's size (the rules of the module docstring).

    Args:
        block_bytes: Bytes of one block, K and V of every layer (``kv_block_bytes``).
        block_size: Tokens per block.
        device: ``"cpu"`` or ``"cuda"``.
        max_model_len: Longest sequence in tokens (the model's, before any clamping to the
            pool): the CPU cap and the minimum are computed from it.
        max_num_seqs: Most sequences in one step (the CPU cap).
        num_kv_blocks: Explicit block count; wins over everything.
        kv_cache_memory_bytes: Explicit pool size in bytes.
        gpu_memory_utilization: Share of total device memory the server may use (CUDA).
        cpu_kv_cache_share: Share of ``MemAvailable`` the pool may take (CPU).
        memory: The machine's figures; needed only for an automatic pool.

    Returns:
        The decision, with the figures it came from.

    Raises:
        ValueError: an explicit size of less than one block, a share outside ``(0, 1]``,
            missing figures for an automatic pool, or an automatic pool too small for one
            sequence of ``min(max_model_len, MIN_AUTO_TOKENS)`` tokens.
    """
    if block_bytes <= 0 or block_size <= 0:
        raise ValueError("block_bytes and block_size must be positive")
    if num_kv_blocks is not None:
        if num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_kv_blocks}")
        return KVPoolSizing(
            num_kv_blocks, block_size, block_bytes, "num_kv_blocks", num_kv_blocks * block_bytes
        )
    if kv_cache_memory_bytes is not None:
        blocks = kv_cache_memory_bytes // block_bytes
        if blocks <= 0:
            raise ValueError(
                f"kv_cache_memory {kv_cache_memory_bytes} bytes is less than one KV block "
                f"({block_bytes} bytes)"
            )
        return KVPoolSizing(
            blocks, block_size, block_bytes, "kv_cache_memory", kv_cache_memory_bytes
        )
    if memory is None:
        raise ValueError("an automatic KV pool needs the machine's memory figures")
    if device == "cuda":
        share = gpu_memory_utilization
        _check_share(share, "gpu_memory_utilization")
        budget = int(share * memory.available_bytes) - memory.weights_bytes
        budget -= memory.activation_bytes
        if memory.free_bytes is not None:
            budget = min(budget, memory.free_bytes - memory.activation_bytes)
        rule: Rule = "gpu_memory_utilization"
        cap = None
    else:
        share = cpu_kv_cache_share
        _check_share(share, "cpu_kv_cache_share")
        budget = int(share * memory.available_bytes)
        rule = "cpu_kv_cache_share"
        cap = max_num_seqs * -(-max_model_len // block_size)
    budget = max(budget, 0)
    blocks = budget // block_bytes
    capped = None
    if cap is not None and blocks > cap:
        blocks, capped = cap, cap
    need_tokens = min(max_model_len, MIN_AUTO_TOKENS)
    need = -(-need_tokens // block_size)
    if blocks < need:
        raise ValueError(
            _too_small(rule, share, memory, budget, blocks, need, need_tokens, block_bytes)
        )
    return KVPoolSizing(
        blocks, block_size, block_bytes, rule, budget, share, memory.available_bytes, capped
    )


def _check_share(share: float, name: str) -> None:
    if not 0.0 < share <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in (0, 1], got {share}")


def _too_small(
    rule: Rule,
    share: float,
    memory: MemoryFigures,
    budget: int,
    blocks: int,
    need: int,
    need_tokens: int,
    block_bytes: int,
) -> str:
    if rule == "gpu_memory_utilization":
        source = (
            f"{share:g} of {memory.available_bytes / GiB:.2f} GiB device memory less "
            f"{memory.weights_bytes / GiB:.2f} GiB weights and {memory.activation_bytes / GiB:.2f} "
            f"GiB activations"
        )
        if memory.free_bytes is not None:
            source += f" (free now: {memory.free_bytes / GiB:.2f} GiB)"
        fix = "raise --gpu-memory-utilization, lower --max-num-batched-tokens"
    else:
        source = f"{share:g} of {memory.available_bytes / MiB:.0f} MiB RAM available"
        fix = "free memory, raise --cpu-kv-cache-share"
    return (
        f"not enough memory for the KV cache: {source} leaves {budget / MiB:.1f} MiB, "
        f"{blocks} blocks of {block_bytes} bytes; one {need_tokens}-token sequence needs {need} "
        f"blocks ({need * block_bytes / MiB:.1f} MiB). {fix[0].upper()}{fix[1:]}, or set the "
        "pool's size with --kv-cache-memory or --num-kv-blocks"
    )


_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024 * GiB}


def parse_size(text: str) -> int:
    """Bytes from ``"4GiB"``, ``"512 MiB"``, ``"1.5gib"`` or a plain byte count ``"1073741824"``.

    Binary units only (KiB, MiB, GiB, TiB; B for bytes), case-insensitive: "GB" is refused
    rather than guessed at (10**9 or 2**30).

    Raises:
        ValueError: not a positive size in those units.
    """
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number) :]
    if unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use bytes or a number with KiB, MiB, GiB or TiB")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"bad size {text!r}: use bytes or a number with KiB, MiB, GiB or TiB"
        ) from None
    if not 0 < value < float("inf"):  # NaN too
        raise ValueError(f"bad size {text!r}: must be positive")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"bad size {text!r}: less than one byte")
    return size
