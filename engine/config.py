"""The engine's frozen configuration (CONTRACT.md's engine flags, one field each)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from loraplex.engine.kv_sizing import DEFAULT_CPU_KV_CACHE_SHARE, DEFAULT_GPU_MEMORY_UTILIZATION
from loraplex.hashing.image_limits import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_REQUEST_IMAGE_PIXELS,
)

Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from; only the top (``LLM``/``AsyncLLM``) takes it whole.

    A value known only at run time (the model's max length, the pool size from a memory budget)
    makes a new config with :meth:`replace`, never a mutation.

    Attributes:
        model: Hugging Face model directory (config.json, *.safetensors, tokenizer files).
        served_model_name: Name clients use for the base model; the directory name when None.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: Weights and activations: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: Seed of the engine's default sampling generator.
        block_size: Tokens per KV block.
        num_kv_blocks: Blocks in the pool; wins over every other sizing field. None: sized
            from ``kv_cache_memory_bytes``, or from the machine (``engine.kv_sizing``).
        kv_cache_memory_bytes: Bytes for K and V of all layers when ``num_kv_blocks`` is None;
            None: a share of the machine's memory (the next two fields).
        gpu_memory_utilization: CUDA, automatic pool: share of the device's total memory the
            engine may use; weights and the peak activations of a profiling step come off it
            and the rest is KV cache (vLLM's flag of the same name).
        cpu_kv_cache_share: CPU, automatic pool: share of ``MemAvailable`` (read after the
            weights are loaded) the pool may take, capped at ``max_num_seqs`` sequences of
            ``max_model_len`` tokens.
        max_model_len: Longest prompt + output, in tokens; None for the model's own limit.
        max_num_seqs: Most sequences in one step.
        max_num_batched_tokens: Token budget of one step (prefill chunks + decodes).
        long_prefill_token_threshold: In a step that also decodes, the step's prefills do at
            most this much work, in token-equivalents (a token at context position ``p`` costs
            ``1 + p / alpha``, ``alpha`` from the model's shapes: attention grows with the
            context), so long prompts cannot make every decoding sequence's next token wait for
            thousands of prefill tokens (Sarathi-Serve's stall-free batching; vLLM has a flag of
            the same name). None: ``max_num_batched_tokens // 4``; 0: no cap.
        tenant_prefill_tokens: While more than one tenant has work, the step's prefills do at
            most this much work (token-equivalents): what another tenant's long prompts may add
            to a step a tenant waits for. None: ``max_num_batched_tokens // 16``; 0: no cap.
        enable_prefix_caching: Automatic prefix caching.
        prefix_hash: Block hash algorithm, ``"sha256"`` or ``"xxhash"``.
        mm_hash: Image key mode: ``"exact"`` (default: SHA-256 of the decoded pixels) or
            ``"perceptual"`` (re-encodings share KV, but pictures that differ in a digit of
            text or a small object may too; docs/image_keys.md).
        max_loras: Device LoRA slots (a step never holds more distinct adapters).
        max_cpu_loras: Adapters kept in host memory.
        max_lora_rank: Largest LoRA rank accepted.
        attention_backend: ``"torch"`` or ``"triton"``.
        preemption: ``"recompute"`` (free the victim's blocks) or ``"swap"`` (copy its KV to a
            CPU pool and back).
        swap_space_bytes: Size of the CPU swap pool.
        vision_cache_entries: Image encodings kept by image key (LRU).
        max_images: Most images in one request.
        max_image_pixels: Most pixels (``width * height``) of one image.
        max_image_aspect_ratio: Largest longer side over shorter side of one image: CLIP-style
            processors resize the shorter side to their input size S, so the work is about
            ``ratio * S**2`` (``hashing.image_decode.DEFAULT_MAX_ASPECT_RATIO``).
        max_request_image_pixels: Most pixels of all of one request's images together.
            The image bounds are checked on the images' headers before anything is decoded.
        speculative_method: ``"ngram"`` (prompt lookup, ``engine.spec_decode.ngram``),
            ``"draft"`` (a draft model, ``engine.spec_decode.draft``) or None for no
            speculative decoding.
        speculative_model: ``draft``: the draft model's directory (a smaller text-only
            checkpoint with the target's tokenizer).
        num_speculative_tokens: Most proposals a sequence verifies in one step (the adaptive
            controller may use fewer: ``engine.spec_decode.adaptive``); None: 4 when a method
            is set.
        prompt_lookup_min: ``ngram``: shortest suffix matched.
        prompt_lookup_max: ``ngram``: longest suffix matched (tried first).
        num_cpu_threads: Threads torch uses for CPU work in the engine (None: torch's
            default, every core); replicas sharing one machine split its cores.
        enable_kv_events: Record KV events (``engine.kv_events``: block hashes stored and
            removed, adapters loaded and unloaded) for a router; set by the replica set,
            off for one engine (nobody would drain them).
        unresponsive_timeout_s: An engine core in its own process that sends nothing (not even
            its heartbeat, every 0.1 s from a thread of its own) for this long is out of the
            routing table and ``/health`` until it is heard again.
        dead_timeout_s: Silent this long, it is declared dead: killed, its requests end with
            503, and a new one starts (``engine.core_client``).
        step_timeout_s: A core whose one step has run this long is hung (it still beats, but
            its loop is stuck): killed and replaced the same way.
        grammar_workers: Processes of the grammar sandbox (``engine.grammar_sandbox``), which
            compiles every new structured-output spec before the core does.
        grammar_cpu_seconds: CPU seconds one spec's compilation may take in the sandbox; past
            it the spec is refused (a 400) and the worker replaced.
        grammar_memory_bytes: Address space of one sandbox worker (``RLIMIT_AS``; 0: none).
    """

    model: str
    served_model_name: str | None = None
    device: Device = "cpu"
    dtype: DType = "float32"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cpu_kv_cache_share: float = DEFAULT_CPU_KV_CACHE_SHARE
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    tenant_prefill_tokens: int | None = None
    enable_prefix_caching: bool = True
    prefix_hash: Literal["sha256", "xxhash"] = "sha256"
    mm_hash: Literal["perceptual", "exact"] = "exact"
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    attention_backend: Literal["torch", "triton"] = "torch"
    preemption: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = 256 * 1024 * 1024
    vision_cache_entries: int = 256
    max_images: int = DEFAULT_MAX_IMAGES
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_image_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    max_request_image_pixels: int = DEFAULT_MAX_REQUEST_IMAGE_PIXELS
    speculative_method: Literal["ngram", "draft"] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    enable_kv_events: bool = False
    num_cpu_threads: int | None = None
    unresponsive_timeout_s: float = 1.0
    dead_timeout_s: float = 10.0
    step_timeout_s: float = 600.0
    grammar_workers: int = 1
    grammar_cpu_seconds: float = 5.0
    grammar_memory_bytes: int = 2 * 1024**3

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("cpu", "cuda"), f"device must be cpu or cuda, got {self.device!r}"),
            (
                self.dtype in ("float32", "bfloat16", "float16"),
                f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}",
            ),
            (self.block_size > 0, f"block_size must be positive, got {self.block_size}"),
            (
                self.num_kv_blocks is None or self.num_kv_blocks > 0,
                f"num_kv_blocks must be positive, got {self.num_kv_blocks}",
            ),
            (
                self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                0.0 < self.cpu_kv_cache_share <= 1.0,
                f"cpu_kv_cache_share must be in (0, 1], got {self.cpu_kv_cache_share}",
            ),
            (self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens > 0,
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}",
            ),
            (
                self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
                "long_prefill_token_threshold must be >= 0",
            ),
            (
                self.tenant_prefill_tokens is None or self.tenant_prefill_tokens >= 0,
                "tenant_prefill_tokens must be >= 0",
            ),
            (
                self.max_model_len is None or self.max_model_len > 0,
                f"max_model_len must be positive, got {self.max_model_len}",
            ),
            (self.prefix_hash in ("sha256", "xxhash"), f"bad prefix_hash {self.prefix_hash!r}"),
            (self.mm_hash in ("perceptual", "exact"), f"bad mm_hash {self.mm_hash!r}"),
            (
                self.attention_backend in ("torch", "triton"),
                f"bad attention_backend {self.attention_backend!r}",
            ),
            (self.preemption in ("recompute", "swap"), f"bad preemption {self.preemption!r}"),
            (
                self.max_loras > 0 and self.max_cpu_loras >= self.max_loras,
                "need 0 < max_loras <= max_cpu_loras",
            ),
            (self.max_lora_rank > 0, "max_lora_rank must be positive"),
            (self.max_images >= 0, f"max_images must be >= 0, got {self.max_images}"),
            (self.max_image_pixels > 0, "max_image_pixels must be positive"),
            (self.max_image_aspect_ratio >= 1, "max_image_aspect_ratio must be at least 1"),
            (
                self.max_request_image_pixels >= self.max_image_pixels,
                "max_request_image_pixels must be at least max_image_pixels",
            ),
            (
                self.speculative_method in (None, "ngram", "draft"),
                f"speculative_method must be ngram or draft, got {self.speculative_method!r}",
            ),
            (
                (self.speculative_method == "draft") == (self.speculative_model is not None),
                "speculative_method draft needs a speculative_model, and only it takes one",
            ),
            (
                self.num_speculative_tokens is None
                or (self.speculative_method is not None and 0 < self.num_speculative_tokens <= 16),
                "num_speculative_tokens needs a speculative_method and must be in [1, 16]",
            ),
            (
                self.num_cpu_threads is None or self.num_cpu_threads > 0,
                "num_cpu_threads must be positive",
            ),
            (
                0 < self.unresponsive_timeout_s <= self.dead_timeout_s and self.step_timeout_s > 0,
                "need 0 < unresponsive_timeout_s <= dead_timeout_s and step_timeout_s > 0",
            ),
            (self.grammar_workers > 0, "grammar_workers must be positive"),
            (self.grammar_cpu_seconds > 0, "grammar_cpu_seconds must be positive"),
            (self.grammar_memory_bytes >= 0, "grammar_memory_bytes must be >= 0"),
            (
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                "need 1 <= prompt_lookup_min <= prompt_lookup_max",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def spec_k(self) -> int:
        """Most proposals per step (0: no speculative decoding)."""
        if self.speculative_method is None:
            return 0
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
