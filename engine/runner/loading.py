"""Loading the model and sizing the engine around it: KV pool, model length, EOS ids.

Everything here is decided once, at start-up, from the config and the model directory; the
result is a new frozen config (``dataclasses.replace``) plus the loaded model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache.profile import plan_kv_pool
from loraplex.engine.kv_cache.sizing import KVPoolSizing
from loraplex.engine.lora.layers import target_shapes
from loraplex.engine.models.dtypes import DTYPES, resolve_dtype
from loraplex.engine.models.loader import load_config, load_model
from loraplex.engine.runner.model_runner import kv_block_bytes

logger = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    """The model and the sizes derived from it.

    Attributes:
        config: The config as given, its ``dtype`` resolved (``auto`` made the checkpoint's);
            see :func:`size_kv_pool` for the pool's sizes.
        model: The loaded model.
        max_model_len: The longest sequence before clamping to the KV pool.
        hf_config: Its transformers config.
        device: Where it runs.
        dtype: Its weights' and KV cache's dtype.
        block_bytes: Bytes of one KV block, every layer, K and V.
        eos_token_ids: Tokens that end a sequence (config, generation config, tokenizer).
    """

    config: EngineConfig
    model: torch.nn.Module
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    block_bytes: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def load_engine_model(config: EngineConfig) -> LoadedEngine:
    """Load the model; check ``max_model_len`` against its positions.

    ``--dtype auto`` is resolved here, from the checkpoint's config
    (``engine.models.dtypes.checkpoint_dtype``), before the weights load: the returned config
    names the dtype the weights, the KV pool's sizing and the LoRA slots use.

    Raises:
        ValueError: an unreadable model directory, an unsupported architecture, or a
            ``max_model_len`` past the model's positions.
    """
    device = torch.device(config.device)
    if config.dtype == "auto":
        resolved = resolve_dtype(config.dtype, load_config(config.model))
        logger.info("dtype auto: the checkpoint's %s", resolved)
        config = config.replace(dtype=resolved)
    dtype = DTYPES[config.dtype]
    model, hf_config = load_model(config.model, dtype, device, config.model_impl)
    model_len = model.max_position_embeddings
    max_model_len = config.max_model_len or model_len
    if max_model_len > model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_len} positions")
    block_bytes = kv_block_bytes(
        model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, dtype
    )
    return LoadedEngine(
        config=config,
        model=model,
        hf_config=hf_config,
        device=device,
        dtype=dtype,
        block_bytes=block_bytes,
        eos_token_ids=eos_token_ids(config.model, hf_config),
        max_model_len=max_model_len,
    )


def prepack_cpu_weights(model: torch.nn.Module, config: EngineConfig, what: str = "model") -> int:
    """Pack ``model``'s projections for oneDNN (``--cpu-prepack-weights``) where it applies.

    Applies on the CPU, in float32 or bfloat16, to a model that declares
    ``supports_prepacked_weights`` (it only calls its linears, never reads their weights after
    load). Call before LoRA layers are installed.

    Args:
        model: The loaded model (weights tied already).
        config: The engine config.
        what: The model's role, for the log line.

    Returns:
        The number of linears packed (0 when packing does not apply; logged why).
    """
    from loraplex.engine.models.packed_linear import can_pack, pack_linears

    if not config.cpu_prepack_weights:
        return 0
    param = next(model.parameters())
    reason = can_pack(param.device, param.dtype)
    if reason is None and not getattr(model, "supports_prepacked_weights", False):
        reason = f"{type(model).__name__} does not declare supports_prepacked_weights"
    if reason is not None:
        (logger.info if param.device.type == "cpu" else logger.debug)(
            "%s weights not prepacked: %s", what, reason
        )
        return 0
    count = pack_linears(model)
    logger.info("%s: %d linears prepacked for oneDNN", what, count)
    return count


def load_draft_model(loaded: LoadedEngine) -> torch.nn.Module | None:
    """Load ``--speculative-model`` next to the target; its KV joins the pool's block size.

    The draft's paged KV has one block per target block (``engine.spec_decode.draft``), so
    ``loaded.block_bytes`` grows by the draft's bytes per block before the pool is sized.

    Returns:
        The draft model, or None when the config names none.

    Raises:
        ValueError: an unreadable draft directory, or a draft that cannot propose for the
            target (``engine.spec_decode.draft.check_draft``).
    """
    config = loaded.config
    if config.speculative_model is None:
        return None
    from loraplex.engine.spec_decode.draft import check_draft

    try:
        draft, _ = load_model(
            config.speculative_model, loaded.dtype, loaded.device, config.model_impl
        )
    except FileNotFoundError as exc:
        raise ValueError(f"speculative model: {exc}") from exc
    check_draft(draft, loaded.model, 1)
    loaded.block_bytes += kv_block_bytes(
        draft.num_layers, config.block_size, draft.num_kv_heads, draft.head_dim, loaded.dtype
    )
    return draft


def size_kv_pool(loaded: LoadedEngine, backend: Any) -> tuple[EngineConfig, KVPoolSizing, int]:
    """Size the KV pool (``engine.kv_cache.sizing``) once the weights and LoRA slots are in memory.

    Returns:
        The config with ``num_kv_blocks`` and ``max_model_len`` resolved (the model length
        clamped to what the pool holds), how the pool was sized, and the CPU swap pool's
        blocks (0 without ``swap``).

    Raises:
        ValueError: a pool that cannot be sized, an explicit ``max_model_len`` it cannot
            hold, or a ``swap`` preemption whose swap space holds no block.
    """
    config = loaded.config
    sizing = plan_kv_pool(
        config,
        loaded.model,
        backend,
        max_model_len=loaded.max_model_len,
        block_bytes=loaded.block_bytes,
        device=loaded.device,
        dtype=loaded.dtype,
    )
    logger.info("%s", sizing.describe())
    max_model_len = fit_to_pool(
        loaded.max_model_len,
        sizing.num_blocks,
        config.block_size,
        explicit=config.max_model_len is not None,
    )
    swap = config.preemption == "swap"
    num_cpu_blocks = config.swap_space_bytes // loaded.block_bytes if swap else 0
    if swap and num_cpu_blocks == 0:  # else every preemption would silently recompute
        raise ValueError(
            f"preemption swap: the swap space ({config.swap_space_bytes} bytes) holds no KV block "
            f"({loaded.block_bytes} bytes each); give --swap-space at least one block"
        )
    resolved = config.replace(max_model_len=max_model_len, num_kv_blocks=sizing.num_blocks)
    return resolved, sizing, num_cpu_blocks


def fit_to_pool(max_model_len: int, num_blocks: int, block_size: int, *, explicit: bool) -> int:
    """``max_model_len`` no longer than the KV pool holds (``num_blocks * block_size`` tokens).

    One sequence of ``max_model_len`` tokens must fit the pool alone, or it could outgrow it.
    The model's own length is clamped, with a message; an explicit ``max_model_len`` that does
    not fit is refused (as vLLM does), never silently shortened.

    Raises:
        ValueError: an explicit ``max_model_len`` longer than the pool holds.
    """
    capacity = num_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit the KV pool: {num_blocks} blocks of "
            f"{block_size} tokens hold {capacity}; give more KV memory or a smaller "
            "max_model_len"
        )
    logger.warning(
        "max_model_len clamped from the model's %d to %d tokens: the KV pool (%d blocks of %d) "
        "cannot hold one longer sequence; give it more memory (--kv-cache-memory, "
        "--cpu-kv-cache-share, --gpu-memory-utilization or --num-kv-blocks) to serve more",
        max_model_len,
        capacity,
        num_blocks,
        block_size,
    )
    return capacity


def attention_cost(model: Any) -> float:
    """``1 / alpha``: a token's attention work per context position over its other work.

    Per token and layer, the projections cost ``2 * in * out`` FLOPs each (q, k, v, o, gate,
    up, down), and attention costs ``4 * num_heads * head_dim`` per position it attends to (the
    ``q.k`` and ``p.v`` products). For the tiny LLaVA ``alpha`` is ~350 positions; for an
    8B Llama ~30,000: context length weighs on small models far more.
    """
    layer0 = [shape for (layer, _), shape in target_shapes(model).items() if layer == 0]
    linear = sum(2 * fan_in * fan_out for fan_in, fan_out in layer0)
    if not linear:
        return 0.0
    return 4.0 * model.num_heads * model.head_dim / linear


def eos_token_ids(model_dir: str, hf_config: Any) -> tuple[int, ...]:
    """Every id that ends a sequence, where transformers takes them from.

    The model config's ``eos_token_id`` (and its text config's, for LLaVA), the directory's
    ``generation_config.json`` (a checkpoint may list extra stop ids there, e.g. Llama 3's
    ``<|eot_id|>``), and the tokenizer's ``eos_token_id``.
    """
    ids: list[int] = []
    sources = [
        getattr(hf_config, "eos_token_id", None),
        getattr(getattr(hf_config, "text_config", None), "eos_token_id", None),
    ]
    generation = Path(model_dir) / "generation_config.json"
    if generation.exists():
        from transformers import GenerationConfig

        try:
            sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
        except (OSError, ValueError) as exc:
            logger.warning("ignoring an unreadable generation_config.json: %s", exc)
    try:
        from transformers import AutoTokenizer

        sources.append(AutoTokenizer.from_pretrained(model_dir).eos_token_id)
    except (OSError, ValueError, KeyError):
        pass  # the processor loader reports an unusable tokenizer
    for source in sources:
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, list | tuple):
            ids.extend(int(x) for x in source)
    return tuple(dict.fromkeys(ids))
