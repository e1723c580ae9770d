"""The engine core: requests in, one scheduled step at a time, request outputs out.

Synchronous and single-threaded; ``LLM`` drives it to completion for a batch, ``AsyncLLM`` runs
it on a background thread for streaming.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.manager import LoRAManager
from loraplex.engine.attention import get_attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_profile import plan_kv_pool
from loraplex.engine.lora import LoRAStepContext, install_lora, target_shapes
from loraplex.engine.model_runner import ModelRunner, kv_block_bytes
from loraplex.engine.models.loader import load_model
from loraplex.engine.processing import load_processor
from loraplex.engine.request import (
    CompletionOutput,
    EngineRequest,
    RequestOutput,
    Sequence,
)
from loraplex.engine.sampling.detokenizer import IncrementalDetokenizer
from loraplex.engine.sampling.sampler import Sampler, make_generator
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.step_isolation import execute_isolating, sample_rows_isolating
from loraplex.engine.swap import CpuBlockPool
from loraplex.engine.vision_cache import VisionCache
from loraplex.hashing.request_hasher import RequestBlockHasher

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    forked: bool = False
    sent_text: dict[int, int] = field(default_factory=dict)  # seq index -> chars already sent
    sent_tokens: dict[int, int] = field(default_factory=dict)
    error: str | None = None  # set when a fault in its part of a step failed the request


MAX_FAILING_STEPS = 3
"""Steps in a row that fail for every sequence they run before the engine gives up."""


class EngineFaultError(RuntimeError):
    """The engine cannot run steps any more (not one request's fault); it must be restarted."""


class LLMEngine:
    """Model, KV cache, scheduler, runner and sampler, driven one step at a time.

    Args:
        config: The engine configuration.
        adapter_loader: ``digest -> LoraAdapter`` for adapters the engine was not handed
            directly (the gateway's store); adapters added with :meth:`add_lora_dir` are
            reloaded from their directory when the CPU tier evicted them.

    Raises:
        ValueError: an unreadable model directory, an unsupported architecture, or a config
            that cannot hold one sequence of ``max_model_len`` tokens.
    """

    def __init__(
        self, config: EngineConfig, *, adapter_loader: Callable[[str], Any] | None = None
    ) -> None:
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        model, hf_config = load_model(config.model, self.dtype, self.device)
        self.model = model
        self.hf_config = hf_config
        model_len = model.max_position_embeddings
        max_model_len = config.max_model_len or model_len
        if max_model_len > model_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's {model_len} positions"
            )
        self.tokenizer, self.inputs = load_processor(
            config.model,
            model,
            config.mm_hash,
            max_images=config.max_images,
            max_image_pixels=config.max_image_pixels,
            max_image_aspect_ratio=config.max_image_aspect_ratio,
            max_request_image_pixels=config.max_request_image_pixels,
        )
        self.eos_token_ids = _eos_ids(self.tokenizer, hf_config)
        self.lora_context = LoRAStepContext()
        self._adapter_dirs: dict[str, str] = {}
        self._adapter_loader = adapter_loader
        self.lora_manager = LoRAManager(
            target_shapes(model),
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_rank=config.max_lora_rank,
            device=self.device,
            dtype=self.dtype,
            loader=self._load_adapter,
        )
        install_lora(model, self.lora_manager.buffers, self.lora_context)
        backend = get_attention_backend(config.attention_backend)
        block_bytes = kv_block_bytes(
            model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, self.dtype
        )
        # After the weights and LoRA slots, before the pool: what the machine has left.
        self.kv_sizing = plan_kv_pool(
            config,
            model,
            backend,
            max_model_len=max_model_len,
            block_bytes=block_bytes,
            device=self.device,
            dtype=self.dtype,
        )
        num_blocks = self.kv_sizing.num_blocks
        logger.info("%s", self.kv_sizing.describe())
        max_model_len = _fit_to_pool(
            max_model_len, num_blocks, config.block_size, explicit=config.max_model_len is not None
        )
        num_cpu_blocks = (
            config.swap_space_bytes // block_bytes if config.preemption == "swap" else 0
        )
        self.config = config.replace(max_model_len=max_model_len, num_kv_blocks=num_blocks)
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_prefill_token_threshold=(
                config.max_num_batched_tokens // 4
                if config.long_prefill_token_threshold is None
                else config.long_prefill_token_threshold
            ),
            tenant_prefill_tokens=(
                config.max_num_batched_tokens // 16
                if config.tenant_prefill_tokens is None
                else config.tenant_prefill_tokens
            ),
            attention_cost=attention_cost(model),
            max_loras=config.max_loras,
            preemption=config.preemption,
            cpu_pool=CpuBlockPool(num_cpu_blocks) if num_cpu_blocks else None,
        )
        self.scheduler.lora_manager = self.lora_manager
        self.runner = ModelRunner(
            model,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            backend=backend,
            device=self.device,
            dtype=self.dtype,
            num_cpu_blocks=num_cpu_blocks,
            vision_cache=VisionCache(config.vision_cache_entries),
            lora_context=self.lora_context,
            lora_slot_of=self.lora_manager.slot_of,
        )
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.requests: dict[str, _RequestState] = {}
        self._failed_now: dict[str, None] = {}  # requests failed during the current step
        self._failing_steps = 0  # steps in a row whose every sequence failed
        # (step seconds, model forward + logits seconds) of every step, for benchmarks.
        self.step_times: list[tuple[float, float]] = []

    # ----------------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request.

        Raises:
            ValueError: a duplicate id, bad sampling parameters, an empty or too long prompt,
                images that do not match the placeholders, or a prompt the pool cannot hold.
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        request.sampling.validate()
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt is {n_prompt} tokens; this model allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self._check_images(request)
        if request.lora_digest is not None and not self._known_adapter(request.lora_digest):
            raise ValueError(f"unknown adapter {request.lora_digest}")
        blocks_needed = -(-min(n_prompt + 1, self.max_model_len) // self.kv.block_size)
        if blocks_needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"the prompt needs {blocks_needed} KV blocks; the pool has "
                f"{self.kv.pool.num_blocks}"
            )
        hasher = RequestBlockHasher(
            self.kv.block_size,
            algorithm=self.config.prefix_hash,
            lora_digest=request.lora_digest,
            cache_salt=request.cache_salt,
            placeholders=[im.placeholder for im in request.images],
        )
        hasher.extend(request.prompt_token_ids)
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids), hasher)
        self.requests[rid] = _RequestState(request, [seq])
        self.scheduler.add(seq)

    # ------------------------------------------------------------------------ adapters
    @property
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """``projection name -> (in_features, out_features)`` an adapter may target."""
        return {name: shape for (_, name), shape in target_shapes(self.model).items()}

    def add_lora_dir(self, path: str) -> Any:
        """Validate a PEFT LoRA directory and make it available by its digest.

        Returns:
            The validated ``LoraAdapter`` (``.digest`` goes in ``EngineRequest.lora_digest``).

        Raises:
            AdapterError: the adapter is invalid for this model (a ValueError).
        """
        adapter = self._read_adapter_dir(path)
        self._adapter_dirs[adapter.digest] = str(path)
        self.lora_manager.add(adapter)
        return adapter

    def add_lora(self, adapter: Any) -> None:
        """Put an already validated adapter in the CPU tier (hot add)."""
        self.lora_manager.add(adapter)

    def remove_lora(self, digest: str) -> bool:
        """Hot remove; refused (False) while a running sequence uses the adapter."""
        self._adapter_dirs.pop(digest, None)
        return self.lora_manager.remove(digest)

    def _read_adapter_dir(self, path: str) -> Any:
        from loraplex.adapters.validation import load_adapter_dir

        return load_adapter_dir(
            path,
            target_shapes=self.lora_shapes,
            num_layers=self.model.num_layers,
            max_rank=self.config.max_lora_rank,
        )

    def _load_adapter(self, digest: str) -> Any:
        """The LoRA manager's loader: from the registered directory, else the store."""
        path = self._adapter_dirs.get(digest)
        if path is not None:
            adapter = self._read_adapter_dir(path)
            if adapter.digest != digest:
                raise AdapterError(f"the adapter at {path} changed on disk")
            return adapter
        if self._adapter_loader is not None:
            return self._adapter_loader(digest)
        raise AdapterError(f"unknown adapter {digest}")

    def _known_adapter(self, digest: str) -> bool:
        return (
            digest in self._adapter_dirs
            or digest in self.lora_manager.cpu_digests
            or self.lora_manager.slot_of(digest) is not None
            or self._adapter_loader is not None
        )

    def _check_images(self, request: EngineRequest) -> None:
        image_token = getattr(self.model, "image_token_id", None)
        ids = request.prompt_token_ids
        n_slots = sum(1 for t in ids if t == image_token) if image_token is not None else 0
        covered = 0
        for i, image in enumerate(request.images):
            ph = image.placeholder
            if ph.end > len(ids) or any(t != image_token for t in ids[ph.offset : ph.end]):
                raise ValueError(f"image {i}'s placeholder does not match the prompt's tokens")
            if ph.length != self.model.num_image_tokens:
                raise ValueError(
                    f"image {i} has {ph.length} placeholder tokens, the model "
                    f"needs {self.model.num_image_tokens}"
                )
            covered += ph.length
        if covered != n_slots:
            raise ValueError(
                f"the prompt has {n_slots} image placeholder tokens but the "
                f"{len(request.images)} image(s) cover {covered}: more images than "
                "placeholders or the reverse"
            )

    def _new_sequence(self, request, index, token_ids, hasher) -> Sequence:
        params = request.sampling
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed + index, self.device)
        return Sequence(
            seq_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
            request=request,
            index=index,
            token_ids=token_ids,
            hasher=hasher,
            generator=generator,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                params,
                prompt_token_ids=request.prompt_token_ids,
                eos_token_ids=self.eos_token_ids,
            ),
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request at any time; its blocks are freed at once.

        Returns:
            The request's final output (finish reason ``"abort"``), None for an unknown id.
        """
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                seq.detokenizer.finish("abort")
        self.scheduler.abort(state.seqs)
        return self._output(state)

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return bool(self.requests)

    # --------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step.

        A fault raised by one request's part of the step (its forward pass, its sampling, its
        detokenization) fails that request alone (``finish_reason="error"``, ``error`` set on
        its output); every other request of the step goes on as if it had not been there
        (``engine.step_isolation``).

        Returns:
            An output for every request that produced tokens or finished this step.

        Raises:
            EngineFaultError: ``MAX_FAILING_STEPS`` steps in a row failed for every sequence
                they ran (the engine itself is broken, not a request), or a step failed with
                no sequence to blame.
        """
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return []
        logits = self._execute(sched)
        touched = self._process(sched, logits)
        outputs = []
        for rid in touched:
            state = self.requests[rid]
            try:
                outputs.append(self._output(state))
            except Exception as exc:
                self._fail_request(rid, exc, "building the output")
                outputs.append(self._output(state))
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self.step_times.append((time.perf_counter() - t0, self.runner.last_forward_seconds))
        return outputs

    def _execute(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """The step's logits; a sequence whose forward pass fails alone fails its request.

        Blocks that a failed sequence was filling this step lose their cached hashes (their KV
        may be half written), and a sequence of the step that reads one of them (a prefix hit
        taken this step) is preempted to be recomputed rather than sampled.
        """
        step = execute_isolating(self.runner, self.kv, sched)
        if not step.culprits:
            self._failing_steps = 0
            return step.logits
        if step.kept:
            self._failing_steps = 0
        else:
            self._failing_steps += 1
            if self._failing_steps >= MAX_FAILING_STEPS:
                raise EngineFaultError(
                    f"{self._failing_steps} steps in a row failed for every sequence"
                ) from step.culprits[0][1]
        bad_blocks: set[int] = set()
        for item, exc in step.culprits:
            first = item.start // self.kv.block_size
            bad_blocks.update(self.kv.uncache_from(item.seq.seq_id, first))
            self._fail_request(item.seq.request.request_id, exc, "the forward pass")
        kept, rows = [], []
        for item, row in zip(step.kept, step.rows or [], strict=True):
            if item.seq.is_finished:  # a sibling of a culprit: its request failed
                continue
            if bad_blocks.intersection(self.kv.get_block_ids(item.seq.seq_id)):
                self.scheduler.requeue(item.seq)
                continue
            kept.append(item)
            if row is not None:
                rows.append(row)
        sched.scheduled = kept
        return torch.cat(rows) if rows else None

    def _fail_request(self, rid: str, exc: BaseException, where: str) -> None:
        """Finish every sequence of a request with ``"error"`` (its blocks freed at once)."""
        state = self.requests.get(rid)
        if state is None or state.error is not None:
            return
        logger.error(
            "request %s failed in %s: %s: %s", rid, where, type(exc).__name__, exc, exc_info=exc
        )
        state.error = f"the request failed in {where}"
        self.scheduler.abort(state.seqs, reason="error")
        self._failed_now[rid] = None

    def _process(self, sched: SchedulerOutput, logits: torch.Tensor | None) -> list[str]:
        failed, self._failed_now = self._failed_now, {}
        for seq in sched.failed:  # the adapter could not be loaded: finished, never ran
            seq.detokenizer.finish("abort")
            failed[seq.request.request_id] = None
        for seq in sched.capped:  # the whole pool cannot hold its next token
            seq.detokenizer.finish("length")
            failed[seq.request.request_id] = None
        touched = self._sample(sched, logits)
        failed.update(self._failed_now)
        self._failed_now = {}
        return list(dict.fromkeys([*failed, *touched]))

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor | None) -> list[str]:
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for item in sched.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            if not item.sample:
                continue
            rid = item.seq.request.request_id
            state = self.requests[rid]
            if state.request.sampling.n > 1 and not state.forked:
                try:
                    children = self._fork(state)
                except Exception as exc:
                    self._fail_request(rid, exc, "forking its n sequences")
                    row += 1
                    continue
                seqs.extend(children)
                rows.extend([row] * state.request.sampling.n)
            else:
                seqs.append(item.seq)
                rows.append(row)
            row += 1
        if not seqs:
            return []
        picked = logits.index_select(0, torch.tensor(rows, device=logits.device))

        def sample(which: list[int]):
            return self.sampler(
                picked if len(which) == len(seqs) else picked[which],
                [seqs[r].request.sampling for r in which],
                [seqs[r].generator for r in which],
                default_generator=self.generator,
            )

        results, failed_rows = sample_rows_isolating(sample, len(seqs))
        for r, exc in failed_rows.items():
            self._fail_request(seqs[r].request.request_id, exc, "sampling")
        now = time.monotonic()
        touched: dict[str, None] = {}
        for seq, result in zip(seqs, results, strict=True):
            if seq.is_finished:  # its request failed in this step
                continue
            try:
                self._append(seq, result, now)
            except Exception as exc:
                self._fail_request(seq.request.request_id, exc, "detokenization")
            touched[seq.request.request_id] = None
        return list(touched)

    def _append(self, seq: Sequence, result: tuple, now: float) -> None:
        """Add a sampled token to a sequence; finish it on EOS, a stop, or the length limit."""
        token, logprob, _, top = result
        seq.token_ids.append(token)
        seq.hasher.extend([token])
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.request.sampling.logprobs is not None:
            seq.logprobs.append((logprob, top))
        seq.detokenizer.append(token)
        reason = seq.detokenizer.finish_reason
        if reason is None and seq.num_tokens >= self.max_model_len:
            seq.detokenizer.finish("length")  # releases text held back for stop strings
            reason = seq.detokenizer.finish_reason
        if reason is not None:
            seq.stop_reason = seq.detokenizer.stop_reason
            self.scheduler.finish(seq, reason)

    def _fork(self, state: _RequestState) -> list[Sequence]:
        """Fork a request's sequence into ``n`` sharing its prompt blocks."""
        parent = state.seqs[0]
        children = [parent]
        for i in range(1, state.request.sampling.n):
            child = self._new_sequence(
                state.request, i, list(parent.token_ids), parent.hasher.fork()
            )
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child, after=children[-1])
            children.append(child)
        state.seqs = children
        state.forked = True
        return children

    def _output(self, state: _RequestState) -> RequestOutput:
        if state.error is not None:
            return _error_output(state)
        outs = []
        for seq in state.seqs:
            text = seq.detokenizer.text
            sent_t = state.sent_text.get(seq.index, 0)
            sent_k = state.sent_tokens.get(seq.index, 0)
            tokens = seq.output_token_ids
            state.sent_text[seq.index] = len(text)
            state.sent_tokens[seq.index] = len(tokens)
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(tokens),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs)
                    if seq.request.sampling.logprobs is not None
                    else None,
                    text_delta=text[sent_t:],
                    token_ids_delta=list(tokens[sent_k:]),
                )
            )
        first = state.seqs[0]
        ttft = (
            first.first_token_time - state.request.arrival_time
            if first.first_token_time is not None
            else None
        )
        finished = all(s.is_finished for s in state.seqs) and (
            state.forked or state.request.sampling.n == 1 or first.finish_reason == "abort"
        )
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=list(state.request.prompt_token_ids),
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            ttft=ttft,
        )


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


def _error_output(state: _RequestState) -> RequestOutput:
    """The final output of a request that failed: ``finish_reason="error"``, no new text."""
    outs = [
        CompletionOutput(
            index=seq.index,
            text="",
            token_ids=list(seq.output_token_ids),
            finish_reason="error",
        )
        for seq in state.seqs
    ]
    return RequestOutput(
        request_id=state.request.request_id,
        prompt_token_ids=list(state.request.prompt_token_ids),
        outputs=outs,
        finished=True,
        num_cached_tokens=state.seqs[0].num_cached_tokens or 0,
        error=state.error,
    )


def _fit_to_pool(max_model_len: int, num_blocks: int, block_size: int, *, explicit: bool) -> int:
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


def _eos_ids(tokenizer, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (
        getattr(hf_config, "eos_token_id", None),
        getattr(getattr(hf_config, "text_config", None), "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, list | tuple):
            ids.extend(int(x) for x in source)
    return tuple(dict.fromkeys(ids))
