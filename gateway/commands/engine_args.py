"""The engine flags shared by ``serve`` and ``generate`` (CONTRACT.md), to an EngineConfig."""

from __future__ import annotations

import argparse

from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_sizing import parse_size


def _size(text: str) -> int:
    """The argparse type of ``--kv-cache-memory``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--device``, ... ``--preemption`` to a subcommand's parser."""
    d = EngineConfig(model="")
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (default: the built-in tiny LLaVA)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the base model's name in requests' model field and /v1/models "
        "(default: the model directory's name)",
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="data directory (default: $LORAPLEX_DATA_DIR or ./.loraplex)",
    )
    g.add_argument(
        "--device", choices=["cpu", "cuda"], default=d.device, help="where the model runs"
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=d.dtype,
        help="weights, activations and KV cache",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the sampling of requests that give none",
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks in the pool; wins over every other sizing flag (default: sized from "
        "memory, see --kv-cache-memory and docs/kv_sizing.md)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="bytes of the KV pool (K and V, all layers), e.g. 4GiB, 512MiB or 1073741824 "
        "(default: CUDA: --gpu-memory-utilization of the device less weights and the peak "
        "activations of a profiling step; CPU: --cpu-kv-cache-share of MemAvailable after the "
        "weights, at most max-num-seqs sequences of max-model-len tokens)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="CUDA: share of the device's total memory the engine may use; what weights and "
        "activations leave of it is KV cache (default %(default)s)",
    )
    g.add_argument(
        "--cpu-kv-cache-share",
        type=float,
        default=d.cpu_kv_cache_share,
        help="CPU: share of MemAvailable (read after loading the weights) the KV pool may take "
        "(default %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output, in tokens (default: the model's own limit)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens one step computes (prefill chunks + decodes)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="while a sequence decodes, a step's prefills do at most this much work, in "
        "token-equivalents (default: max-num-batched-tokens / 4; 0: no cap)",
    )
    g.add_argument(
        "--tenant-prefill-tokens",
        type=int,
        default=None,
        help="while more than one tenant has work, a step's prefills do at most this much "
        "work, in token-equivalents (default: max-num-batched-tokens / 16; 0: no cap)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV of earlier requests' identical prefixes (same adapter, images and "
        "cache salt)",
    )
    g.add_argument(
        "--prefix-hash",
        choices=["sha256", "xxhash"],
        default=d.prefix_hash,
        help="hash of the prefix cache's block keys (xxhash: faster, not collision-resistant)",
    )
    g.add_argument(
        "--mm-hash",
        choices=["perceptual", "exact"],
        default=d.mm_hash,
        help="image keys for prefix caching: exact (default; only pixel-identical images share "
        "KV) or perceptual (re-encodings share KV, but so can images that differ in a digit "
        "of text or a small object; see docs/image_keys.md)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        help="LoRA adapters on the device at once (distinct adapters in one step)",
    )
    g.add_argument(
        "--max-cpu-loras", type=int, default=d.max_cpu_loras, help="adapters kept in host memory"
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=d.max_lora_rank,
        help="largest LoRA rank accepted (also bounds an upload's size)",
    )
    g.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default=d.attention_backend,
        help="paged attention: torch (any device) or triton (GPU kernels; the gpu extra)",
    )
    g.add_argument(
        "--preemption",
        choices=["recompute", "swap"],
        default=d.preemption,
        help="when the KV pool is full: recompute (free a victim's blocks) or swap (copy its KV "
        "to host memory and back)",
    )
    g.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: ngram (prompt lookup in the sequence's own tokens) or "
        "draft (a smaller model, --speculative-model); outputs are the same token for token "
        "(default: off; docs/speculative.md)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="most proposals a sequence verifies per step, 1-16; each sequence adapts its own "
        "count to its acceptance (default: 4 with --speculative-method)",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        metavar="DIR",
        help="draft: the draft model's directory, a text-only checkpoint with the served "
        "model's tokenizer (default: none)",
    )
    g.add_argument(
        "--grammar-workers",
        type=int,
        default=d.grammar_workers,
        metavar="N",
        help="processes of the grammar sandbox, where every new structured-output schema or "
        f"regex is compiled before the engine does (default: {d.grammar_workers}; "
        "docs/structured_output.md)",
    )
    g.add_argument(
        "--grammar-timeout",
        type=float,
        default=d.grammar_cpu_seconds,
        metavar="S",
        help="CPU seconds one schema's compilation may take in the sandbox; past it the "
        f"request gets a 400 (default: {d.grammar_cpu_seconds:g})",
    )
    g.add_argument(
        "--grammar-memory",
        type=lambda text: 0 if text.strip() == "0" else _size(text),
        default=d.grammar_memory_bytes,
        metavar="SIZE",
        help="address space of one sandbox worker, e.g. 2GiB; a schema that needs more gets "
        "a 400 (default: 2GiB; 0: no limit)",
    )


def config_from_args(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    """Build the frozen engine config from parsed flags.

    Raises:
        ValueError: an invalid combination (EngineConfig's checks).
    """
    return EngineConfig(
        model=model_dir,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_share=args.cpu_kv_cache_share,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        tenant_prefill_tokens=args.tenant_prefill_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_hash=args.prefix_hash,
        mm_hash=args.mm_hash,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        attention_backend=args.attention_backend,
        preemption=args.preemption,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        grammar_workers=args.grammar_workers,
        grammar_cpu_seconds=args.grammar_timeout,
        grammar_memory_bytes=args.grammar_memory,
    )
