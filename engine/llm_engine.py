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

from adapters.errors import AdapterError
from adapters.manager import LoRAManager
from engine.attention import get_attention_backend
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.lora import LoRAStepContext, install_lora, target_shapes
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.models.loader import load_model
from engine.processing import load_processor
from engine.request import (
    CompletionOutput,
    EngineRequest,
    RequestOutput,
    Sequence,
)
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.sampler import Sampler, make_generator
from engine.scheduler import Scheduler, SchedulerOutput
from engine.swap import CpuBlockPool
from engine.vision_cache import VisionCache
from hashing.request_hasher import RequestBlockHasher

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    forked: bool = False
    sent_text: dict[int, int] = field(default_factory=dict)  # seq index -> chars already sent
    sent_tokens: dict[int, int] = field(default_factory=dict)


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
        block_bytes = kv_block_bytes(
            model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, self.dtype
        )
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // block_bytes)
        num_cpu_blocks = (
            config.swap_space_bytes // block_bytes if config.preemption == "swap" else 0
        )
        self.config = config.replace(max_model_len=max_model_len, num_kv_blocks=num_blocks)
        self.max_model_len = max_model_len
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
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_loras=config.max_loras,
            preemption=config.preemption,
            cpu_pool=CpuBlockPool(num_cpu_blocks) if num_cpu_blocks else None,
        )
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
        self.scheduler.lora_manager = self.lora_manager
        self.runner = ModelRunner(
            model,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            backend=get_attention_backend(config.attention_backend),
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
        from adapters.validation import load_adapter_dir

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

        Returns:
            An output for every request that produced tokens or finished this step.
        """
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return []
        logits = self.runner.execute(sched, self.kv)
        touched = self._process(sched, logits)
        outputs = [self._output(self.requests[rid]) for rid in touched]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self.step_times.append((time.perf_counter() - t0, self.runner.last_forward_seconds))
        return outputs

    def _process(self, sched: SchedulerOutput, logits: torch.Tensor | None) -> list[str]:
        failed: dict[str, None] = {}
        for seq in sched.failed:  # the adapter could not be loaded: finished, never ran
            seq.detokenizer.finish("abort")
            failed[seq.request.request_id] = None
        touched = self._sample(sched, logits)
        return list(dict.fromkeys([*failed, *touched]))

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor | None) -> list[str]:
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for item in sched.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            if not item.sample:
                continue
            state = self.requests[item.seq.request.request_id]
            if state.request.sampling.n > 1 and not state.forked:
                seqs.extend(self._fork(state))
                rows.extend([row] * state.request.sampling.n)
            else:
                seqs.append(item.seq)
                rows.append(row)
            row += 1
        if not seqs:
            return []
        idx = torch.tensor(rows, device=logits.device)
        result = self.sampler(
            logits.index_select(0, idx),
            [s.request.sampling for s in seqs],
            [s.generator for s in seqs],
            default_generator=self.generator,
        )
        now = time.monotonic()
        touched: dict[str, None] = {}
        for i, seq in enumerate(seqs):
            token = result.token_ids[i]
            seq.token_ids.append(token)
            seq.hasher.extend([token])
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.request.sampling.logprobs is not None:
                seq.logprobs.append((result.logprobs[i], result.top_logprobs[i]))
            seq.detokenizer.append(token)
            reason = seq.detokenizer.finish_reason
            if reason is None and seq.num_tokens >= self.max_model_len:
                seq.detokenizer.finish("length")  # releases text held back for stop strings
                reason = seq.detokenizer.finish_reason
            if reason is not None:
                seq.stop_reason = seq.detokenizer.stop_reason
                self.scheduler.finish(seq, reason)
            touched[seq.request.request_id] = None
        return list(touched)

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
