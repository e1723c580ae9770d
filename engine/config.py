"""The engine's frozen configuration: one field per engine setting and ``loraplex`` flag."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from loraplex.engine.kv_cache.sizing import (
    DEFAULT_CPU_KV_CACHE_SHARE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
)
from loraplex.hashing.image_limits import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_REQUEST_IMAGE_PIXELS,
)

Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16", "auto"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from; only the top (the client front) takes it whole.

    A value known only at run time (the model's max length, the pool size from a memory budget)
    makes a new config with :meth:`replace`, never a mutation.

    Each field is written once, here: its name, type and default, and the docstring under it.
    The engine flags of ``loraplex serve`` and ``loraplex generate`` are generated from them
    (``gateway.commands.engine_args``, as vLLM's ``EngineArgs`` reads its config classes'
    attribute docstrings): ``block_size`` is ``--block-size``, a ``Literal`` gives the choices,
    a ``bool`` a ``--x/--no-x`` pair, and the docstring is the flag's help (docs/cli.md).

    Raises:
        ValueError: on construction, an invalid value or combination (``__post_init__``).
    """

    model: str
    """The model: a Hugging Face directory (config.json, *.safetensors, tokenizer files), a Hub
    id (org/name, fetched into the HF cache) or a .gguf file (dequantized once into a cached
    directory); resolved to a directory before anything reads it
    (``engine.models.source.resolve_model_source``)."""
    revision: str | None = None
    """Revision of ``model`` when it is a Hub id: a branch, tag or commit on the Hub. Default:
    main."""
    model_source: str | None = None
    """What ``model`` named before it was resolved to a directory (a Hub id, a .gguf file or
    the directory itself); set by the resolution, which a config carrying it skips, so an
    engine core process or replica handed the config never downloads or converts again."""
    served_model_name: str | None = None
    """The base model's name in requests' model field and /v1/models. Default: the Hub id for a
    Hub model, the file's name without .gguf for a GGUF file, else the directory's name."""
    device: Device = "cpu"
    """Where the model runs."""
    dtype: DType = "float32"
    """Weights, activations and KV cache. auto takes the checkpoint's own (config.json's dtype:
    float32, bfloat16 or float16; anything else, or none, is float32), as vLLM does. The default
    stays float32: the engine's outputs are token-exact against transformers in float32
    (docs/model_sources.md)."""
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    """Model code: native (the engine's own Llama, Mistral, Qwen2 and LLaVA, the fast path),
    transformers (transformers' modeling code over the paged KV cache: any causal-LM or
    image-text-to-text architecture it has), or auto (native where it exists, else
    transformers; docs/transformers_backend.md)."""
    seed: int = 0
    """Seed of the sampling of requests that give none."""
    block_size: int = 16
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; wins over every other sizing setting. Default: sized from memory
    (``kv_cache_memory_bytes``, docs/kv_sizing.md)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of the KV pool (K and V, all layers), e.g. 4GiB, 512MiB or 1073741824. Default:
    on CUDA, ``gpu_memory_utilization`` of the device less the weights and the peak activations of
    a profiling step; on CPU, ``cpu_kv_cache_share`` of MemAvailable after the weights, at most
    ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    """CUDA: share of the device's total memory the engine may use; what the weights and the
    peak activations of a profiling step leave of it is KV cache (vLLM's flag of that name)."""
    cpu_kv_cache_share: float = DEFAULT_CPU_KV_CACHE_SHARE
    """CPU: share of MemAvailable (read after the weights are loaded) the KV pool may take."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens. Default: the model's own limit."""
    max_num_seqs: int = 64
    """Most sequences in one step."""
    max_num_batched_tokens: int = 2048
    """Tokens one step computes (prefill chunks + decodes)."""
    long_prefill_token_threshold: int | None = None
    """While a sequence decodes, a step's prefills do at most this much work, in
    token-equivalents (a token at context position p costs 1 + p / alpha, alpha from the
    model's shapes), so long prompts cannot make every decoding sequence's next token wait for
    thousands of prefill tokens (Sarathi-Serve's stall-free batching; vLLM's flag of that
    name). Default: ``max_num_batched_tokens`` / 4; 0: no cap."""
    tenant_prefill_tokens: int | None = None
    """While more than one tenant has work, a step's prefills do at most this much work
    (token-equivalents): what another tenant's long prompts may add to a step a tenant waits
    for. Default: ``max_num_batched_tokens`` / 16; 0: no cap."""
    batch_yield_s: float = 1.0
    """Priority classes: for this many seconds after an interactive request arrives, batch
    requests' prefills do at most ``tenant_prefill_tokens`` of work in a step, so an
    interactive request that arrives during a batch step waits for a short step
    (docs/engine.md, *Priority classes*). 0: never capped."""
    enable_prefix_caching: bool = True
    """Reuse the KV of earlier requests' identical prefixes (same adapter, images and cache
    salt)."""
    prefix_hash: Literal["sha256", "xxhash"] = "sha256"
    """Hash of the prefix cache's block keys (xxhash: faster, not collision-resistant)."""
    mm_hash: Literal["perceptual", "exact"] = "exact"
    """Image keys for prefix caching: exact (only pixel-identical images share KV) or
    perceptual (re-encodings share KV, but so can images that differ in a digit of text or a
    small object; docs/image_keys.md)."""
    max_loras: int = 4
    """LoRA adapters on the device at once (distinct adapters in one step)."""
    max_cpu_loras: int = 16
    """Adapters kept in host memory."""
    max_lora_rank: int = 64
    """Largest LoRA rank accepted (also bounds an upload's size)."""
    attention_backend: Literal["torch", "triton"] = "torch"
    """Paged attention: torch (any device) or triton (GPU kernels; the gpu extra)."""
    cpu_decode_attention: Literal["gather", "flex"] = "gather"
    """The torch attention backend's decode-only steps on CPU (float32): gather (copy each
    context out of the paged cache into a padded batch, then SDPA) or flex (read the cache in
    place through compiled FlexAttention, the block tables as its block mask; a C++ compiler
    needed, one compilation per batch-size bucket on first use, cached on disk; falls back to
    gather if compiling fails). docs/kernels.md, docs/benchmarks.md."""
    cpu_prepack_weights: bool = True
    """On the CPU (float32 or bfloat16, a native model), pack the projections' weights once at
    load into oneDNN's blocked layout and multiply against it (``engine.models.packed_linear``;
    2-2.7x ``F.linear`` at 8-256 rows in float32). Off: ``F.linear`` on the dense weights."""
    cpu_compile: bool = False
    """On the CPU, run a native model's forward compiled by inductor (``torch.compile``;
    ``engine.runner.compiled_step``): the elementwise ops between GEMMs fused, the attention and
    LoRA deltas opaque ops. Compiled at start (tens of seconds for a 30-layer model; inductor's
    cache, ``TORCHINDUCTOR_CACHE_DIR``, makes restarts faster); off under ``--enforce-eager``.
    docs/cpu_step.md."""
    enforce_eager: bool = False
    """Never capture CUDA graphs nor compile the CPU step (``cpu_compile``): every step runs the
    model eagerly (vLLM's flag of that name).
    Off: on CUDA with the triton attention backend and a native model, pure-decode steps replay
    a graph captured per batch-size bucket at start (docs/cuda_graphs.md); the CPU never uses
    graphs."""
    cuda_graph_sizes: tuple[int, ...] | None = None
    """Batch sizes (sequences of a pure-decode step) to capture a CUDA graph for, e.g.
    1,2,4,8,16; a step of B sequences replays the smallest size >= B, padded. Default: 1, 2, 4,
    then every multiple of 8 up to ``max_num_seqs`` rounded up to 8, at most 256."""
    preemption: Literal["recompute", "swap"] = "recompute"
    """When the KV pool is full: recompute (free a victim's blocks) or swap (copy its KV to
    host memory and back)."""
    swap_space_bytes: int = 256 * 1024 * 1024
    """Size of the host-memory pool that swap preemption copies KV to, e.g. 1GiB."""
    kv_offloading_bytes: int = 0
    """KV tiers (docs/kv_tiers.md): host memory that keeps the KV blocks the engine computes
    (written through as they fill, LRU-evicted past this size), so a prefix the pool evicted
    is loaded back instead of recomputed, e.g. 8GiB (vLLM's ``--kv-offloading-size``; a bare
    number is GiB, as there). 0: no host tier."""
    kv_disk_dir: str | None = None
    """KV tiers: the directory of the local-disk tier (below the host tier), kept across
    restarts and keyed by a fingerprint of the model, dtype, block size and hashing scheme.
    Default: none (``serve`` uses DATA_DIR/kv_tiers when ``kv_disk_bytes`` is set)."""
    kv_disk_bytes: int = 0
    """KV tiers: size of the local-disk tier, LRU-evicted past it, e.g. 100GiB. 0: none."""
    kv_remote_url: str | None = None
    """KV tiers: a store shared by every replica and machine serving the same model, below the
    disk tier, e.g. redis://host:6379/0 (LMCache's ``remote_url``). Default: none."""
    kv_remote_bytes: int = 0
    """KV tiers: bound on the shared store's KV bytes for this model, all replicas together (give
    every replica the same), LRU-evicted past it, e.g. 64GiB; needed with ``kv_remote_url``."""
    kv_load_step_share: float = 0.04
    """KV tiers: while requests run, loading tier blocks back takes at most about this share of
    each step's time (loads run between steps, on the engine thread; docs/kv_tiers.md). Higher:
    a returning prefix loads sooner under traffic, the running requests decode slower."""
    vision_cache_entries: int = 256
    """Image encodings kept by image key (LRU), so a repeated image is encoded once."""
    max_images: int = DEFAULT_MAX_IMAGES
    """Most images in one request."""
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    """Most pixels (width * height) of one image, checked on its header before decoding."""
    max_image_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    """Largest longer side over shorter side of one image: CLIP-style processors resize the
    shorter side to their input size S, so the work is about ratio * S**2."""
    max_request_image_pixels: int = DEFAULT_MAX_REQUEST_IMAGE_PIXELS
    """Most pixels of all of one request's images together."""
    speculative_method: Literal["ngram", "draft"] | None = None
    """Speculative decoding: ngram (prompt lookup in the sequence's own tokens) or draft (a
    smaller model, ``speculative_model``); outputs are the same token for token
    (docs/speculative.md). Default: off."""
    speculative_model: str | None = None
    """Draft: the draft model (a directory, a Hub id at its main revision, or a .gguf file), a
    text-only checkpoint with the served model's tokenizer. Default: none."""
    num_speculative_tokens: int | None = None
    """Most proposals a sequence verifies per step, 1-16; each sequence adapts its own count to
    its acceptance (engine.spec_decode.adaptive). Default: 4 with a ``speculative_method``."""
    prompt_lookup_min: int = 2
    """Ngram: shortest suffix matched."""
    prompt_lookup_max: int = 4
    """Ngram: longest suffix matched (tried first)."""
    enable_kv_events: bool = False
    """Record KV events (engine.kv_cache.events: block hashes stored and removed, adapters loaded
    and unloaded) for a router; set by the replica set, off for one engine (nobody would drain
    them)."""
    num_cpu_threads: int | None = None
    """Threads torch uses for CPU work in the engine (its OpenMP pool). Default: one per CPU
    of ``cpu_threads_bind`` where it binds; else torch's default for one engine, and the CPUs
    split between replicas sharing one machine."""
    cpu_threads_bind: str = "auto"
    """The CPUs an engine core process runs on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: auto
    (one CPU per physical core of the CPUs this process may use, replicas on separate cores
    or NUMA nodes; binds engine core processes only), nobind, or CPU lists such as 0-3 or
    0,2,4-7, one per replica separated by | (engine.core.cpu_bind)."""
    unresponsive_timeout_s: float = 1.0
    """An engine core process that sends nothing (not even its heartbeat, every 0.1 s from a
    thread of its own) for this many seconds leaves the routing table and /health until it
    is heard again."""
    dead_timeout_s: float = 10.0
    """An engine core process silent this many seconds is killed, its requests end with 503
    and a new one starts (engine.client.process); at least 1."""
    step_timeout_s: float = 600.0
    """An engine core in one step for this many seconds is hung (it still beats, but its loop
    is stuck): killed and replaced the same way."""
    grammar_workers: int = 1
    """Processes of the grammar sandbox, where every new structured-output schema or regex is
    compiled before the engine core does (docs/structured_output.md)."""
    grammar_cpu_seconds: float = 5.0
    """CPU seconds one schema's compilation may take in the sandbox; past it the request gets
    a 400 and the worker is replaced."""
    grammar_memory_bytes: int = 2 * 1024**3
    """Address space of one sandbox worker (RLIMIT_AS), e.g. 2GiB; a schema that needs more
    gets a 400; 0: no limit."""

    @property
    def kv_tiers_enabled(self) -> bool:
        """Whether any KV tier is configured (host, disk or remote)."""
        return bool(self.kv_offloading_bytes or self.kv_disk_bytes or self.kv_remote_url)

    def __post_init__(self) -> None:
        if isinstance(self.cuda_graph_sizes, list):  # hashable, as every field
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
        bind_error = _bind_error(self)  # and cpu_threads_bind spelled canonically ("0-3|4-7")
        checks = [
            (self.device in ("cpu", "cuda"), f"device must be cpu or cuda, got {self.device!r}"),
            (
                self.dtype in ("float32", "bfloat16", "float16", "auto"),
                f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}",
            ),
            (
                self.revision is None or bool(self.revision.strip()),
                "revision must not be empty",
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
                math.isfinite(self.batch_yield_s) and self.batch_yield_s >= 0,
                f"batch_yield_s must be a finite number >= 0, got {self.batch_yield_s}",
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
            (
                self.cpu_decode_attention in ("gather", "flex"),
                f"bad cpu_decode_attention {self.cpu_decode_attention!r}",
            ),
            (
                self.cpu_decode_attention == "gather"
                or (
                    self.device == "cpu"
                    and self.attention_backend == "torch"
                    and self.dtype in ("float32", "auto")
                ),
                "cpu_decode_attention flex is the torch backend's, on CPU, in float32: not "
                f"with device {self.device!r}, attention_backend {self.attention_backend!r}, "
                f"dtype {self.dtype!r}",
            ),
            (self.preemption in ("recompute", "swap"), f"bad preemption {self.preemption!r}"),
            (
                self.cuda_graph_sizes is None
                or (
                    len(self.cuda_graph_sizes) > 0
                    and all(
                        isinstance(n, int) and not isinstance(n, bool) and n > 0
                        for n in self.cuda_graph_sizes
                    )
                    and len(set(self.cuda_graph_sizes)) == len(self.cuda_graph_sizes)
                ),
                "cuda_graph_sizes must be distinct positive integers (batch sizes), got "
                f"{self.cuda_graph_sizes!r}",
            ),
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
            (bind_error is None, f"cpu_threads_bind: {bind_error}"),
            (
                0 < self.unresponsive_timeout_s <= self.dead_timeout_s and self.step_timeout_s > 0,
                "need 0 < unresponsive_timeout_s <= dead_timeout_s and step_timeout_s > 0",
            ),
            (self.swap_space_bytes > 0, "swap_space_bytes must be positive"),
            (
                self.kv_offloading_bytes >= 0 and self.kv_disk_bytes >= 0,
                "kv_offloading_bytes and kv_disk_bytes must be >= 0",
            ),
            (
                (self.kv_remote_url is None) == (self.kv_remote_bytes == 0)
                and self.kv_remote_bytes >= 0,
                "kv_remote_url needs kv_remote_bytes (the shared tier's size), and only it",
            ),
            (
                0.0 < self.kv_load_step_share <= 1.0,
                f"kv_load_step_share must be in (0, 1], got {self.kv_load_step_share}",
            ),
            (
                self.kv_remote_url is None
                or self.kv_remote_url.split("://")[0] in ("redis", "rediss", "unix"),
                "kv_remote_url must be a redis://, rediss:// or unix:// URL",
            ),
            (
                self.kv_disk_dir is None or self.kv_disk_bytes > 0,
                "kv_disk_dir needs kv_disk_bytes (the disk tier's size)",
            ),
            (
                not (self.kv_tiers_enabled and self.speculative_method == "draft"),
                "the KV tiers do not keep a draft model's KV: use them without "
                "speculative_method draft",
            ),
            (
                not (self.kv_tiers_enabled and not self.enable_prefix_caching),
                "the KV tiers need prefix caching (their blocks are found by prefix hash)",
            ),
            (
                self.vision_cache_entries >= 0,
                f"vision_cache_entries must be >= 0, got {self.vision_cache_entries}",
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


def _bind_error(config: EngineConfig) -> str | None:
    """Why ``config.cpu_threads_bind`` is malformed, or None after writing its canonical form."""
    from loraplex.engine.core.cpu_bind import normalize_bind

    if not isinstance(config.cpu_threads_bind, str):
        return f"expected a string, got {config.cpu_threads_bind!r}"
    try:
        object.__setattr__(config, "cpu_threads_bind", normalize_bind(config.cpu_threads_bind))
    except ValueError as exc:
        return str(exc)
    return None
