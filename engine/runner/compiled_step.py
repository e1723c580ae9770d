"""The compiled step on CPU: the model's forward through ``torch.compile`` (inductor).

What CUDA graphs are to a GPU step (``engine.runner.cuda_graphs``), this is to a CPU one: the
Python of 30 decoder layers and the elementwise kernels between their GEMMs (RMSNorm, rotary,
SiLU-mul, the residual adds) become one compiled program. Inductor fuses the elementwise chains
into vectorised C++ loops and calls the CPU's GEMM library for the projections.

The paged attention and the LoRA deltas stay opaque to the compiler, as in vLLM's piecewise
compilation: each is a ``torch.library`` custom op (``loraplex::paged_attention``,
``loraplex::lora_delta_``) that takes only the tensors it computes on and its layer's index, and
finds the step's KV caches, attention metadata and LoRA layout in the :class:`StepContext` the
runner enters around the call. Inside, the engine's own attention backend and LoRA backend run
exactly as in eager mode, so the compiled step computes what the eager one computes, with the
same kernels for attention and the same LoRA layouts; only the fusion of elementwise ops
changes float rounding (parity and figures: docs/cpu_step.md).

Shapes: the step's token count ``T`` is dynamic: one graph serves every step of 2 tokens or
more (prefill chunks, decode batches), so there is nothing to pad and no bucket to pick. A
one-token step runs the eager forward: dynamo specialises ``T == 1`` into a graph of its own,
and it is a single-sequence decode, where the Python the graph saves is the smallest share.
Compilation happens at engine start on a dummy two-token step (:meth:`CompiledStep.warm_up`),
never in a request's step; inductor's FX-graph and AOT caches (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``) make a restart's compilation shorter.

The projections: with ``--cpu-prepack-weights`` (``engine.models.packed_linear``) each is one
more opaque op (``loraplex::packed_linear``), since a oneDNN blocked weight cannot be a traced
input; without it, inductor calls the GEMM library on the dense weights itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class StepContext:
    """What the opaque ops of one compiled forward read (set by :func:`step_context`).

    Attributes:
        backend: The engine's attention backend.
        meta: The step's attention metadata.
        kv_caches: One ``(key_cache, value_cache)`` per layer.
        lora_backend: The engine's LoRA backend, or None.
        lora_buffers: ``(layer_idx, projection name) -> SlotBuffers`` of the LoRA layers.
    """

    backend: Any
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    lora_backend: Any = None
    lora_buffers: dict[tuple[int, str], Any] | None = None


_CURRENT: StepContext | None = None


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    """Make ``ctx`` the step the opaque ops read, for the duration of one forward."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, ctx
    try:
        yield
    finally:
        _CURRENT = previous


def _current() -> StepContext:
    if _CURRENT is None:
        raise RuntimeError(
            "a compiled-step op ran outside engine.runner.compiled_step.step_context"
        )
    return _CURRENT


@torch.library.custom_op("loraplex::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Write layer ``layer``'s K/V into its paged cache, then attend (the step's backend).

    Args:
        query: ``[T, num_heads, head_dim]``.
        key: ``[T, num_kv_heads, head_dim]``.
        value: ``[T, num_kv_heads, head_dim]``.
        layer: Index into the step's KV caches.
        scale: Softmax scale.
        sliding_window: The layer's window, or -1 for none.

    Returns:
        ``[T, num_heads, head_dim]``, a fresh tensor.

    Raises:
        RuntimeError: called outside :func:`step_context`.
    """
    ctx = _current()
    key_cache, value_cache = ctx.kv_caches[layer]
    out = ctx.backend.forward(
        query,
        key,
        value,
        key_cache,
        value_cache,
        ctx.meta,
        scale,
        sliding_window=None if sliding_window < 0 else sliding_window,
    )
    # A custom op's output may not alias its inputs.
    return out.clone() if out.data_ptr() == query.data_ptr() else out


@paged_attention_op.register_fake
def _(query, key, value, layer, scale, sliding_window):
    return torch.empty_like(query)


@torch.library.custom_op("loraplex::lora_delta_", mutates_args=("out",))
def lora_delta_op(out: torch.Tensor, x: torch.Tensor, layer: int, name: str) -> None:
    """Add the step's LoRA deltas of projection ``(layer, name)`` into ``out`` in place.

    Args:
        out: ``[T, out_features]``, the base projection's output.
        x: ``[T, in_features]``, its input.
        layer: Decoder layer index.
        name: Projection name (``q_proj`` ...).

    Raises:
        RuntimeError: called outside :func:`step_context`.
    """
    ctx = _current()
    backend = ctx.lora_backend
    if backend is not None and backend.active:
        backend.apply(out, x, ctx.lora_buffers[(layer, name)])


@lora_delta_op.register_fake
def _(out, x, layer, name):
    return None


@torch.library.custom_op("loraplex::lora_slices_delta_", mutates_args=("out",))
def lora_slices_delta_op(
    out: torch.Tensor, x: torch.Tensor, layer: int, names: str, offsets: list[int]
) -> None:
    """Add the step's LoRA deltas of a fused projection's slices into ``out`` in place.

    Args:
        out: ``[T, sum out_k]``, the fused projection's output.
        x: ``[T, in_features]``, its input.
        layer: Decoder layer index.
        names: The slices' projection names, comma-separated in order (``q_proj,k_proj,v_proj``;
            a custom op takes no list of strings).
        offsets: Each slice's first output column.

    Raises:
        RuntimeError: called outside :func:`step_context`.
    """
    ctx = _current()
    backend = ctx.lora_backend
    if backend is not None and backend.active:
        buffers = [ctx.lora_buffers[(layer, name)] for name in names.split(",")]
        backend.apply_slices(out, x, buffers, tuple(offsets))


@lora_slices_delta_op.register_fake
def _(out, x, layer, names, offsets):
    return None


class OpaqueAttention:
    """The attention backend a compiled forward sees: one ``loraplex::paged_attention`` call.

    The compiled forward receives its KV caches as layer indices (``kv_caches[i] == (i, i)``)
    and no metadata; this backend turns a layer's call into the custom op, which reads the real
    caches and metadata from the step's :class:`StepContext`.
    """

    name = "compiled"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: int,
        value_cache: int,
        meta: None,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``engine.attention.AttentionBackend.forward``; ``key_cache`` is the layer index.

        Raises:
            ValueError: soft-capping or sinks (no compiled model has them).
        """
        if logits_soft_cap is not None or sinks is not None:
            raise ValueError("the compiled step has no logits soft cap or attention sinks")
        return torch.ops.loraplex.paged_attention(
            query, key, value, key_cache, scale, -1 if sliding_window is None else sliding_window
        )


class CompiledStep:
    """A model's forward compiled by inductor, over the opaque attention and LoRA ops.

    Args:
        model: A native decoder that declares ``supports_compile`` (its forward makes no
            data-dependent branch and calls its attention backend once per layer).
        lora_backend: The engine's LoRA backend, or None.
        lora_buffers: ``(layer_idx, projection name) -> SlotBuffers``, or None.
        num_layers: Decoder layers (``len(kv_caches)``).

    Source: vLLM's ``torch.compile`` integration (the attention as a custom op the graph is
    split at, its caches and metadata in a forward context); here the attention op stays in
    the one graph as an extern call instead of splitting it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lora_backend: Any = None,
        lora_buffers: dict[tuple[int, str], Any] | None = None,
        num_layers: int,
    ) -> None:
        self.model = model
        self.lora_backend = lora_backend
        self.lora_buffers = lora_buffers
        self.layer_refs = [(i, i) for i in range(num_layers)]
        self.attention = OpaqueAttention()
        self.compile_seconds = 0.0
        self._fn = torch.compile(model.forward, dynamic=True, fullgraph=True)

    def accepts(self, num_tokens: int, positions: torch.Tensor, extra: dict) -> bool:
        """Whether a step of ``num_tokens`` with these inputs runs compiled.

        See the module docstring: two tokens or more, ``[T]`` positions, no model extras.
        """
        return num_tokens >= 2 and positions.dim() == 1 and not extra

    def warm_up(self, backend: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Compile now, on a dummy step of two tokens writing block 0's first two slots.

        The same step runs eagerly first.

        Call before any request is admitted (block 0 holds nothing yet; a later prefill
        overwrites what this wrote).

        Returns:
            The seconds it took (the compilation).

        Raises:
            Exception: whatever the compiler raises (the engine then refuses to start).
        """
        device = kv_caches[0][0].device
        start = time.perf_counter()
        # Inputs made in inference mode, as the runner's are (a tensor's dispatch keys are
        # guarded: an ordinary tensor here would compile a graph no step ever uses).
        with torch.inference_mode():
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([0, 1], dtype=torch.long, device=device),
                query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([2], dtype=torch.int32, device=device),
                block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                max_query_len=2,
                max_seq_len=2,
            )
            ids = torch.zeros(2, dtype=torch.long, device=device)
            positions = torch.arange(2, dtype=torch.long, device=device)
            # One eager forward first: it fills the model's lazy caches (the rotary
            # frequencies per device), which the compiled graph would otherwise guard on as
            # absent and recompile for at the first request.
            self.model(ids, positions, kv_caches, meta, backend)
            self(ids, positions, kv_caches, meta, backend)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: Any,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's forward (same arguments and result), through the compiled program."""
        ctx = StepContext(backend, meta, kv_caches, self.lora_backend, self.lora_buffers)
        with step_context(ctx):
            return self._fn(
                input_ids, positions, self.layer_refs, None, self.attention,
                inputs_embeds=inputs_embeds,
            )  # fmt: skip


def compile_refusal(config: Any, model: Any) -> str | None:
    """Why an engine runs its steps eagerly, or None when it compiles them.

    Args:
        config: The ``EngineConfig`` (``cpu_compile``, ``enforce_eager``, ``device``).
        model: The loaded model.
    """
    if not config.cpu_compile:
        return "--cpu-compile is off"
    if config.enforce_eager:
        return "--enforce-eager"
    if config.device != "cpu":
        return "the compiled step is the CPU's (CUDA steps use CUDA graphs)"
    if not getattr(model, "supports_compile", False):
        return f"{type(model).__name__} does not declare supports_compile"
    return None


def build_compiled_step(config: Any, runner: Any, lora_buffers: Any) -> CompiledStep | None:
    """An engine's compiled step, compiled and warmed now, or None (logged why).

    None when it does not apply. Called after the KV cache exists, before any request.

    Args:
        config: The ``EngineConfig``.
        runner: The ``ModelRunner`` (model, backends, KV caches).
        lora_buffers: The LoRA manager's slot buffers, or None.

    Raises:
        Exception: the compilation failed (the engine does not start half-compiled).
    """
    reason = compile_refusal(config, runner.model)
    if reason is not None:
        if config.cpu_compile:
            logger.warning("--cpu-compile asked for, but no compiled step: %s", reason)
        else:
            logger.debug("no compiled step: %s", reason)
        return None
    step = CompiledStep(
        runner.model,
        lora_backend=runner.lora_backend,
        lora_buffers=lora_buffers,
        num_layers=len(runner.kv_caches),
    )
    seconds = step.warm_up(runner.backend, runner.kv_caches)
    logger.info("compiled step ready: %.1f s to compile", seconds)
    return step
