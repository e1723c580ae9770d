"""CUDA graphs for pure-decode steps: a graph per batch-size bucket, replayed with the step's data.

The step's data: token ids, positions, slot mapping, block tables and LoRA slots.

A decode step of a small batch launches a few hundred kernels (projections, norms, rotary,
attention and LoRA per layer), each too short to hide the host's launch cost; a CUDA graph
records the launches once and replays them in one call. What a graph recorded is fixed: tensor
shapes, pointers, grids and every host-side decision. So a graph is captured per batch size
``S`` of a *bucket*, over static input buffers, and a step of ``B <= S`` sequences copies its
values into those buffers (``copy_``, never rebinding them), pads rows ``B..S`` and replays the
smallest bucket that fits (vLLM's ``cudagraph_capture_sizes`` and padding, at loraplex's size).

**What qualifies**: every scheduled sequence computes exactly one query token (a decode, or a
one-token prefill chunk) with no image span and no speculative proposal, and there are at most
as many as the largest bucket. Anything else (prefill, chunked prefill, images, a verification
of ``1 + k`` positions, a larger batch) runs eagerly. Logits and sampling are never in the
graph: the graph's output is the final hidden states, the runner computes the sampled rows'
logits from its first ``B`` rows.

**Static buffers** (``S_max`` = the largest bucket, ``M`` = blocks of ``max_model_len``):
token ids, positions and slot mapping ``[3, S_max]`` int64; context lengths ``[S_max]`` int32;
``query_start_loc`` ``[S_max + 1]`` int32 (``0..S_max``, constant: one query per row); block
tables ``[S_max, M]`` int32; and for the Triton LoRA backend the LoRA batch's
``sorted_tokens`` ``[S_max]`` int32 and ``blocks`` ``[S_max, 3]`` int32 (``kernels.lora_ops``).
Bucket ``S`` reads views ``[:S]`` of them. Only the columns a step needs are rewritten: the
kernels never read a block table past a row's context length.

**Padding rows** write no KV (slot ``-1``: the Triton cache write and the torch reference both
skip it), have context length 1 over block 0 (a finite read of whatever block 0 holds, so no
NaN: nothing in the forward mixes rows) and no adapter. Their output rows are dropped.

**Graph safety** (what the captured path may not do): a host read of device values
(``.item()``, ``.tolist()``), a Python branch on the step's values, or launches sized by them.
The Triton attention backend qualifies (grids come from shapes; the split-KV count is chosen
at capture from ``max_model_len``, and the kernel bounds each split by the real context
length). The torch reference does not (``paged_attention_ref`` reads ``seq_lens`` on the host
to group decodes), so with ``--attention-backend torch`` steps run eagerly. The Triton LoRA
backend captures over a fixed-capacity batch (:meth:`TritonLoRABackend.set_static_batch`:
empty blocks return at once, ranks come from each projection's ``rank_tensor``); each bucket
has two graphs, with and without LoRA launches, so a base-only step pays nothing for LoRA.
Only models that declare ``supports_cuda_graphs`` (the native Llama family and LLaVA) are
captured; the transformers backend runs eagerly.

**Padded eager**: with ``capture=False`` the same buffers, padding and slicing run the model
eagerly at the bucket's size (any device, any backend): how the CPU tests prove that padding
changes no token.

Sources: NVIDIA CUDA graphs (``torch.cuda.CUDAGraph``, ``torch.cuda.graph_pool_handle``);
vLLM's CUDA graph capture of decode batches.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from loraplex.engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_DEFAULT_CAPTURE = 256
"""Largest bucket of the default sizes (vLLM's default capture sizes stop at 512 tokens)."""

LORA_BLOCK_M = 16
"""Tokens per LoRA block in a captured batch (the kernels' smallest ``BLOCK_M``)."""

WARMUP_RUNS = 2
"""Eager runs of a bucket before its capture (Triton compiles, caches fill, allocator settles)."""


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """The default buckets: 1, 2, 4, then multiples of 8, up to the first >= the batch limit.

    Args:
        max_num_seqs: Most sequences in one step.

    Returns:
        Ascending sizes, the last one at least ``min(max_num_seqs, MAX_DEFAULT_CAPTURE)``.

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    top = min(max_num_seqs, MAX_DEFAULT_CAPTURE)
    sizes: list[int] = []
    for size in [1, 2, 4, *range(8, MAX_DEFAULT_CAPTURE + 1, 8)]:
        sizes.append(size)
        if size >= top:
            break
    return sizes


def capture_sizes(requested: Sequence[int] | None, max_num_seqs: int) -> list[int]:
    """The buckets to capture: ``requested`` (``--cuda-graph-sizes``) or the default ones.

    Sizes past the first one that holds ``max_num_seqs`` sequences could never be used and are
    dropped.

    Args:
        requested: Batch sizes, or None for :func:`default_capture_sizes`.
        max_num_seqs: Most sequences in one step.

    Returns:
        Ascending distinct sizes.

    Raises:
        ValueError: an empty list, or a size that is not a positive integer.
    """
    if requested is None:
        return default_capture_sizes(max_num_seqs)
    sizes = sorted(set(requested))
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"CUDA graph sizes must be positive integers, got {list(requested)}")
    cut = bisect.bisect_left(sizes, max_num_seqs)
    if cut < len(sizes) - 1:
        logger.info(
            "CUDA graph sizes %s exceed max_num_seqs=%d: not captured", sizes[cut + 1 :],
            max_num_seqs,
        )  # fmt: skip
        sizes = sizes[: cut + 1]
    return sizes


def pick_bucket(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest size in ascending ``sizes`` that holds ``batch`` rows, None if none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def one_query_each(items: Sequence[Any]) -> bool:
    """Whether a step is pure decode: every sequence one query token, no image, no proposal."""
    return all(
        item.num_new_tokens == 1 and not item.spec_token_ids and not item.image_spans
        for item in items
    )


class DecodeGraphRunner:
    """Static buffers, one graph (or a padded eager run) per bucket, and the copy-in/slice-out.

    Args:
        model: The runner's model (``forward(input_ids, positions, kv_caches, meta, backend)``
            returning ``[T, hidden]``).
        backend: The attention backend.
        lora_backend: The LoRA backend, None when the model serves no adapters.
        kv_caches: The runner's per-layer ``(key_cache, value_cache)``.
        sizes: Ascending buckets (:func:`capture_sizes`).
        block_size: Tokens per KV block.
        max_model_len: Longest sequence: the block tables' width is ``ceil(max_model_len /
            block_size)`` blocks.
        device: The model's device.
        capture: Capture a CUDA graph per bucket (:meth:`capture` must then be called before a
            step), else run the padded batch eagerly.

    Raises:
        ValueError: no sizes, or ``capture`` off a CUDA device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        lora_backend: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to pad decode steps to")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.backend = backend
        self.lora_backend = lora_backend
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture_graphs = capture
        self.static_lora = lora_backend is not None and hasattr(lora_backend, "set_static_batch")
        n = self.max_batch
        self._longs = torch.zeros((3, n), dtype=torch.long, device=device)  # ids, pos, slots
        self.input_ids, self.positions, self.slot_mapping = self._longs.unbind(0)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.lora_token_slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.lora_sorted = torch.zeros(n, dtype=torch.int32, device=device)
        self.lora_blocks = torch.zeros((n, 3), dtype=torch.int32, device=device)
        self._meta = {size: self._metadata(size) for size in self.sizes}
        self._lora_batch = {size: self._static_lora_batch(size) for size in self.sizes}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0  # steps that replayed a graph (or ran padded eagerly)
        self._use_lora = False  # the prepared step's variant

    # ------------------------------------------------------------------------- buffers
    def _metadata(self, size: int) -> AttentionMetadata:
        """Bucket ``size``'s attention metadata: views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            # The split-KV choice is fixed at capture: sized for the longest context.
            max_seq_len=self.max_blocks * self.block_size,
            num_decode_tokens=size,
        )

    def _static_lora_batch(self, size: int) -> Any:
        """Bucket ``size``'s fixed-capacity LoRA batch (Triton backend), else None."""
        if not self.static_lora:
            return None
        from loraplex.kernels.lora_ops import LoRABatch

        return LoRABatch(
            token_slots=self.lora_token_slots[:size],
            sorted_tokens=self.lora_sorted[:size],
            blocks=self.lora_blocks[:size],
            block_m=LORA_BLOCK_M,
            slots=(),
        )

    def accepts(self, items: Sequence[Any]) -> bool:
        """Whether a step's scheduled sequences run here: pure decode, within a bucket."""
        limit = self.max_blocks * self.block_size
        return (
            0 < len(items) <= self.max_batch
            and one_query_each(items)
            and all(item.start < limit for item in items)
        )

    def prepare(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        lora_slots: Sequence[int],
    ) -> int:
        """Copy one decode step into the static buffers (in place) and set the LoRA state.

        Args:
            token_ids: ``B`` token ids, one per sequence.
            positions: Their positions (the context length after the step is ``position + 1``).
            tables: Each sequence's block ids (at least ``position // block_size + 1`` of them).
            lora_slots: Each sequence's adapter slot (-1: base model).

        Returns:
            The bucket the step runs at (rows ``B..bucket`` are padding).

        Raises:
            ValueError: more sequences than the largest bucket, or a position past the tables'
                width.
            IndexError: a table shorter than its position needs.
        """
        num = len(token_ids)
        size = pick_bucket(self.sizes, num)
        if size is None or num == 0:
            raise ValueError(f"a decode step of {num} sequences fits no bucket of {self.sizes}")
        pad = size - num
        bs = self.block_size
        lens = [p + 1 for p in positions]
        needs = [-(-n // bs) for n in lens]
        width = max(needs)
        if width > self.max_blocks:
            raise ValueError(f"position {max(positions)} past {self.max_blocks} blocks")
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        longs = torch.tensor(
            [[*token_ids, *[0] * pad], [*positions, *[0] * pad], [*slots, *[-1] * pad]],
            dtype=torch.long,
        )
        rows = [list(t[:k]) + [0] * (width - k) for t, k in zip(tables, needs, strict=True)]
        rows.extend([[0] * width] * pad)
        self._longs[:, :size].copy_(longs)
        self.seq_lens[:size].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32))
        self.block_tables[:size, :width].copy_(torch.tensor(rows, dtype=torch.int32))
        padded_slots = [*lora_slots, *[-1] * pad]
        self._set_lora(size, padded_slots, any(s >= 0 for s in lora_slots))
        return size

    def _set_lora(self, size: int, padded_slots: list[int], use_lora: bool) -> None:
        """The LoRA backend's state for a padded step (static batch for the Triton backend)."""
        self._use_lora = use_lora and self.lora_backend is not None
        if self.lora_backend is None:
            return
        if not self._use_lora:
            self.lora_backend.clear()
        elif self.static_lora:
            from loraplex.kernels.lora_ops import lora_blocks

            order, blocks, _, _ = lora_blocks(padded_slots, LORA_BLOCK_M)
            spare = size - len(blocks)  # a block holds >= 1 token: never negative
            self.lora_token_slots[:size].copy_(torch.tensor(padded_slots, dtype=torch.long))
            self.lora_sorted[:size].copy_(
                torch.tensor(order + [0] * (size - len(order)), dtype=torch.int32)
            )
            self.lora_blocks[:size].copy_(
                torch.tensor(blocks + [(0, 0, 0)] * spare, dtype=torch.int32).reshape(size, 3)
            )
            self.lora_backend.set_static_batch(self._lora_batch[size])
        else:
            self.lora_backend.update_metadata(padded_slots, self.device)

    # ------------------------------------------------------------------------- forward
    def _forward(self, size: int) -> torch.Tensor:
        """The model over bucket ``size``'s static buffers: ``[size, hidden]``."""
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self._meta[size],
            self.backend,
        )

    def run(self, size: int, num: int) -> torch.Tensor:
        """Replay (or run padded eagerly) the prepared bucket; the real rows of its output.

        Args:
            size: What :meth:`prepare` returned.
            num: The step's real sequences ``B``.

        Returns:
            ``[B, hidden]``: a view of the graph's output buffer, valid until the next replay.

        Raises:
            RuntimeError: graphs on, but the bucket was not captured.
        """
        self.replays += 1
        if not self.capture_graphs:
            return self._forward(size)[:num]
        key = (size, self._use_lora)
        graph = self.graphs.get(key)
        if graph is None:
            raise RuntimeError(f"no CUDA graph captured for bucket {key} (call capture first)")
        graph.replay()
        return self.outputs[key][:num]

    # ------------------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph(s), largest first, into one shared memory pool.

        Each bucket is captured with all rows padding (no KV is written), after
        ``WARMUP_RUNS`` eager runs; with a LoRA backend, once with the LoRA launches and once
        without. Logs the time taken and the device memory the graphs hold.

        Raises:
            RuntimeError: a capture failed (the message names the bucket and says how to run
                without graphs).
        """
        if not self.capture_graphs:
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        variants = [False, True] if self.lora_backend is not None else [False]
        for size in reversed(self.sizes):
            for use_lora in variants:
                try:
                    self._capture_one(size, use_lora, pool)
                except Exception as exc:
                    raise RuntimeError(
                        f"CUDA graph capture failed for decode batch {size}"
                        f"{' with LoRA' if use_lora else ''}: {exc}; --enforce-eager runs "
                        "without CUDA graphs"
                    ) from exc
        if self.lora_backend is not None:
            self.lora_backend.clear()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info(
            "captured %d CUDA graphs for decode batches %s in %.1f s, %.0f MiB",
            len(self.graphs), self.sizes, self.capture_seconds, self.capture_bytes / 2**20,
        )  # fmt: skip

    def _capture_one(self, size: int, use_lora: bool, pool: Any) -> None:
        """Warm up, then capture bucket ``size`` (all rows padding)."""
        self.seq_lens[:size].fill_(1)
        self.slot_mapping[:size].fill_(-1)  # every row padding: no KV write even in warm-up
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.block_tables[:size, 0].zero_()
        self._set_lora(size, [-1] * size, False)
        if use_lora:  # the LoRA launches, over empty blocks
            self._use_lora = True
            if self.static_lora:
                self.lora_sorted[:size].zero_()
                self.lora_blocks[:size].zero_()
                self.lora_token_slots[:size].fill_(-1)
                self.lora_backend.set_static_batch(self._lora_batch[size])
            else:
                raise RuntimeError(f"the {self.lora_backend.name} LoRA backend is not capturable")
        for _ in range(WARMUP_RUNS):
            self._forward(size)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(size)
        torch.cuda.synchronize(self.device)
        self.graphs[(size, use_lora)] = graph
        self.outputs[(size, use_lora)] = out


def graphs_refusal(config: Any, model: Any, backend: Any, lora_backend: Any) -> str | None:
    """Why an engine runs without CUDA graphs, or None when it captures them.

    Args:
        config: The ``EngineConfig``.
        model: The loaded model.
        backend: The attention backend.
        lora_backend: The LoRA backend (or None).
    """
    if config.enforce_eager:
        return "--enforce-eager"
    if config.device != "cuda":
        return "graphs are CUDA only"
    if getattr(backend, "name", None) != "triton":
        return (
            f"the {getattr(backend, 'name', '?')} attention backend reads context lengths on "
            "the host (not capturable); --attention-backend triton captures decode steps"
        )
    if not getattr(model, "supports_cuda_graphs", False):
        return f"{type(model).__name__} does not declare supports_cuda_graphs"
    if lora_backend is not None and not hasattr(lora_backend, "set_static_batch"):
        return f"the {lora_backend.name} LoRA backend is not capturable"
    return None


def build_decode_graphs(
    config: Any, runner: Any, *, capture: bool = True
) -> DecodeGraphRunner | None:
    """An engine's decode graphs: captured now, or None (logged) when graphs do not apply.

    Called after the KV cache is allocated (the graphs read its tensors).

    Args:
        config: The ``EngineConfig`` (``enforce_eager``, ``cuda_graph_sizes``,
            ``max_num_seqs``, ``max_model_len``, ``block_size``, ``device``).
        runner: The ``ModelRunner`` (model, backends, KV caches, device).
        capture: False: no graphs, but the padded eager path on any device and backend (tests).

    Raises:
        RuntimeError: a capture failed.
    """
    if capture:
        reason = graphs_refusal(config, runner.model, runner.backend, runner.lora_backend)
        if reason is not None:
            log = logger.debug if config.device != "cuda" else logger.info
            log("no CUDA graphs (%s): every step runs eagerly", reason)
            return None
    graphs = DecodeGraphRunner(
        runner.model,
        runner.backend,
        runner.lora_backend,
        runner.kv_caches,
        sizes=capture_sizes(config.cuda_graph_sizes, config.max_num_seqs),
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        device=runner.device,
        capture=capture,
    )
    graphs.capture()
    return graphs
