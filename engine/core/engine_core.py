"""The engine core: requests in, one one-way step at a time, per-sequence outputs out.

::

    step():  sched = scheduler.schedule()                       # what to run
             out   = runner.execute(sched)                      # forward pass + sampling
             outs  = scheduler.update_from_output(sched, out)   # tokens, finishes, KV trims
             runner.apply_kv_trims(sched.kv_trims)              # the KV manager's trims
             return outs

Synchronous and single-threaded. The client side (``LLM`` in process, the front
``engine.client.front.AsyncLLM`` over a core client) owns tokenization, detokenization, stop
strings and ``RequestOutput``s (``engine.client.output_processor``): the core deals only in
token ids.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.registry import AdapterRegistry
from loraplex.engine.attention import check_backend_runs, get_attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.core.breadcrumb import STEP, Breadcrumb
from loraplex.engine.core.kv_tiers import build_kv_tier_connector
from loraplex.engine.core.validation import RequestLimits, validate_request
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_cache.events import KVEvent, KVEventLog
from loraplex.engine.kv_cache.swap import CpuBlockPool
from loraplex.engine.lora.backend import select_lora_backend
from loraplex.engine.lora.layers import install_lora
from loraplex.engine.lora.slots import LoRAManager
from loraplex.engine.lora.targets import served_targets
from loraplex.engine.models.source import resolve_model_source
from loraplex.engine.request import EngineRequest
from loraplex.engine.runner.compiled_step import build_compiled_step
from loraplex.engine.runner.cuda_graphs import build_decode_graphs
from loraplex.engine.runner.loading import (
    attention_cost,
    load_draft_model,
    load_engine_model,
    prepack_cpu_weights,
    size_kv_pool,
)
from loraplex.engine.runner.model_runner import ModelRunner
from loraplex.engine.runner.vision_cache import VisionCache
from loraplex.engine.sampling.sampler import Sampler
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.output import EngineCoreOutput
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_decode import NgramProposer
from loraplex.engine.spec_decode.draft import DraftProposer, check_draft
from loraplex.engine.structured_output.grammar import StructuredOutputError
from loraplex.engine.structured_output.manager import StructuredOutputManager
from loraplex.engine.structured_output.sandbox import GrammarSandboxBusyError, SandboxLimits

logger = logging.getLogger(__name__)

MAX_FAILING_STEPS = 3
"""Steps in a row that fail for every sequence they run before the engine gives up."""

GRAMMAR_WAIT_S = 0.02
"""How long an idle step waits for a grammar being compiled before it returns."""


KV_LOAD_MIN_BUDGET_S = 0.001
"""While requests run, KV tier loads get at least this many seconds of credit a step (beside
``kv_load_step_share`` of the step), so a load progresses whatever the step time."""


RECENT_STEPS = 1024
"""Steps whose timings :class:`StepStats` keeps one by one (the totals count every step)."""


class StepStats:
    """Per-step timings of a core, bounded: running totals and a ring of the latest steps.

    A long-running core takes millions of steps; the totals are what benchmarks and figures
    read, the ring (``recent``) what a look at the last steps needs.

    Args:
        recent: How many of the latest steps ``recent`` keeps.

    Attributes:
        num_steps: Steps recorded since the last :meth:`reset`.
        step_seconds: Their wall time, in seconds (schedule, run, update).
        forward_seconds: Of it, the model's forward passes and logits, in seconds.
        recent: ``(step seconds, forward seconds)`` of the latest steps, oldest first.
    """

    def __init__(self, recent: int = RECENT_STEPS) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=recent)
        self.reset()

    def record(self, step_seconds: float, forward_seconds: float) -> None:
        """Add one step's timings."""
        self.num_steps += 1
        self.step_seconds += step_seconds
        self.forward_seconds += forward_seconds
        self.recent.append((step_seconds, forward_seconds))

    def reset(self) -> None:
        """Start counting afresh (a benchmark after its warm-up)."""
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.recent.clear()


class EngineFaultError(RuntimeError):
    """The engine cannot run steps any more (not one request's fault); it must be restarted."""


def apply_cpu_threads(config: EngineConfig) -> str:
    """Bind this process to ``config.cpu_threads_bind``'s CPUs and size torch's thread pool.

    A CPU list (one engine's: the replica set hands each replica its own) restricts every
    thread of this process (``engine.core.cpu_bind.bind_process``; in an engine core process
    ``bind_core_process`` did it, and pinned the OpenMP threads, before torch loaded), before
    the model's first parallel region makes torch's OpenMP pool; ``auto`` was resolved
    to a list, or to ``nobind``, by the engine core process's entry point
    (``engine.core.process.run_core``) and binds nothing in any other process. Threads:
    ``num_cpu_threads``, else one per bound CPU, else torch's default.

    Returns:
        What was done, for people: ``"2 torch threads on CPUs 0-1"``, ``"2 torch threads,
        not bound"``.

    Raises:
        ValueError: several CPU lists (one engine takes one), or a CPU this process may not
            run on.
    """
    from loraplex.engine.core.cpu_bind import (
        AUTO,
        NOBIND,
        bind_process,
        bound_within,
        check_allowed,
        check_count,
        format_cpu_list,
        parse_bind,
    )

    cpus = None
    if config.cpu_threads_bind not in (AUTO, NOBIND):
        lists = parse_bind(config.cpu_threads_bind)
        check_count(lists, 1)
        cpus = lists[0]
        if not bound_within(cpus):  # not done yet (run_core binds, and pins, first)
            check_allowed(lists)
            bind_process(cpus)
    threads = config.num_cpu_threads or (len(cpus) if cpus else None)
    if threads is not None:
        torch.set_num_threads(threads)
    where = f" on CPUs {format_cpu_list(cpus)}" if cpus else ", not bound"
    n = torch.get_num_threads()
    return f"{n} torch thread{'' if n == 1 else 's'}{where}"


class EngineCore:
    """Model, KV cache, scheduler and runner, driven one step at a time.

    Args:
        config: The engine configuration.
        adapter_loader: ``digest -> LoraAdapter`` for adapters the engine was not handed
            directly (the gateway's store); adapters added with :meth:`add_lora_dir` are
            reloaded from their directory when the CPU tier evicted them.
        breadcrumb: Where the core says which request it runs native code for
            (``engine.core.breadcrumb``; its process's client reads it after a crash); none in
            process.

    ``config.model`` may be a directory, a Hub id or a GGUF file
    (``engine.models.source.resolve_model_source``); a client hands a core its resolved config.

    Raises:
        ValueError: a model source that names nothing loadable (``ModelSourceError``), an
            unreadable model directory, an unsupported architecture, or a config that cannot
            hold one sequence of ``max_model_len`` tokens.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        adapter_loader: Callable[[str], Any] | None = None,
        breadcrumb: Breadcrumb | None = None,
    ) -> None:
        config = resolve_model_source(config)  # a no-op on a config resolved by the client
        self.cpu_threads = apply_cpu_threads(config)
        self.breadcrumb = breadcrumb if breadcrumb is not None else Breadcrumb()
        loaded = load_engine_model(config)
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.eos_token_ids = loaded.eos_token_ids
        self.adapter_limits = AdapterLimits(
            targets=served_targets(self.model, self.hf_config), max_rank=config.max_lora_rank
        )
        prepack_cpu_weights(self.model, config)  # before the LoRA layers wrap the projections
        self.adapters = AdapterRegistry(self.adapter_limits, adapter_loader)
        self.lora_manager = LoRAManager(
            self.adapter_limits.targets.shapes(),
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_rank=config.max_lora_rank,
            device=self.device,
            dtype=self.dtype,
            loader=self.adapters.load,
        )
        # The LoRA backend is chosen once, here: Triton kernels with the Triton attention backend.
        lora_backend = select_lora_backend(config.attention_backend)
        install_lora(self.model, self.lora_manager.buffers, lora_backend)
        backend = get_attention_backend(config.attention_backend, config.cpu_decode_attention)
        check_backend_runs(backend, self.model)
        # After the weights and LoRA slots, before the pool: what the machine has left.
        draft_model = load_draft_model(loaded)  # its KV is part of every block's bytes
        if draft_model is not None:
            check_backend_runs(backend, draft_model, "speculative model")
            prepack_cpu_weights(draft_model, config, "speculative model")
        config, self.kv_sizing, num_cpu_blocks = size_kv_pool(loaded, backend)
        if draft_model is not None:
            check_draft(draft_model, self.model, config.max_model_len)
        self.config = config
        self.max_model_len = config.max_model_len
        num_blocks = config.num_kv_blocks
        self.structured = StructuredOutputManager(
            config.model,
            self.model.vocab_size,
            self.eos_token_ids,
            sandbox=SandboxLimits(
                workers=config.grammar_workers,
                cpu_seconds=config.grammar_cpu_seconds,
                memory_bytes=config.grammar_memory_bytes,
            ),
            breadcrumb=self.breadcrumb,
        )
        # Requests waiting for their grammar (vLLM's WAITING_FOR_FSM), and those refused since.
        self._awaiting_grammar: dict[str, tuple[EngineRequest, Future]] = {}
        self._rejected: list[tuple[str, str, str]] = []
        self.kv_events = KVEventLog() if config.enable_kv_events else None
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, events=self.kv_events
        )
        if self.kv_events is not None:
            log = self.kv_events
            self.lora_manager.on_residency = lambda digest, resident: (
                log.adapter_loaded if resident else log.adapter_unloaded
            )(digest)
        batched = config.max_num_batched_tokens
        # An image attended bidirectionally (Gemma 3) is computed in one step, never split.
        self.atomic_images = bool(getattr(self.model, "bidirectional_image_spans", False))
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            budget=PrefillBudget(
                batched,
                long_prefill_token_threshold=(
                    batched // 4
                    if config.long_prefill_token_threshold is None
                    else config.long_prefill_token_threshold
                ),
                tenant_prefill_tokens=(
                    batched // 16
                    if config.tenant_prefill_tokens is None
                    else config.tenant_prefill_tokens
                ),
                attention_cost=attention_cost(self.model),
            ),
            max_loras=config.max_loras,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            preemption=config.preemption,
            cpu_pool=CpuBlockPool(num_cpu_blocks) if num_cpu_blocks else None,
            lora_manager=self.lora_manager,
            num_speculative_tokens=config.spec_k,
            draft_model=draft_model is not None,
            breadcrumb=self.breadcrumb,
            atomic_image_spans=self.atomic_images,
            batch_yield_s=config.batch_yield_s,
        )
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.runner = ModelRunner(
            self.model,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            backend=backend,
            device=self.device,
            dtype=self.dtype,
            sampler=Sampler(generator, self.eos_token_ids),
            num_cpu_blocks=num_cpu_blocks,
            vision_cache=VisionCache(config.vision_cache_entries),
            lora_backend=lora_backend,
            proposer=(
                NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                if config.speculative_method == "ngram"
                else None
            ),
            num_speculative_tokens=config.spec_k,
            draft=None
            if draft_model is None
            else DraftProposer(
                draft_model,
                num_kv_blocks=num_blocks,
                block_size=config.block_size,
                backend=backend,
                device=self.device,
                dtype=self.dtype,
                max_catch_up_tokens=config.max_num_batched_tokens,
            ),
        )
        # After the KV cache exists: CUDA graphs of pure-decode steps, or None (logged why).
        self.runner.decode_graphs = build_decode_graphs(config, self.runner)
        # The CPU's analogue: the forward compiled by inductor (--cpu-compile), or None.
        self.runner.compiled_step = build_compiled_step(
            config, self.runner, self.lora_manager.buffers
        )
        self.request_limits = RequestLimits(
            max_model_len=self.max_model_len,
            vocab_size=self.model.vocab_size,
            image_token_id=getattr(self.model, "image_token_id", None),
            num_image_tokens=getattr(self.model, "num_image_tokens", 0),
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            max_image_span=batched if self.atomic_images else None,
        )
        # KV tiers below the pool (host memory, disk, a shared store), or None.
        self.kv_tiers = build_kv_tier_connector(config, self.model, self.kv, self.runner.kv_caches)
        self._failing_steps = 0  # steps in a row whose every sequence failed
        # Step and model forward + logits seconds: totals and the latest steps (bounded).
        self.step_stats = StepStats()

    # ----------------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request.

        A request with a structured-output spec whose grammar is not compiled yet waits for it
        off the step (the grammar sandbox vets it, a background thread compiles it); it joins
        the scheduler at the first step after, or is rejected then (:meth:`take_rejected`).

        Raises:
            ValueError: a duplicate id, an unknown adapter, or what
                ``engine.core.validation.validate_request`` refuses; ``StructuredOutputError``
                for a spec already known to be refused.
        """
        rid = request.request_id
        if (
            rid in self.scheduler.requests
            or rid in self._awaiting_grammar
            or (self.kv_tiers is not None and rid in self.kv_tiers)
        ):
            raise ValueError(f"request id {rid!r} is already in flight")
        validate_request(request, self.request_limits)
        digest = request.lora_digest
        if digest is not None and not (
            self.adapters.known(digest) or self.lora_manager.holds(digest)
        ):
            raise ValueError(f"unknown adapter {digest}")
        spec = request.sampling.structured_output
        if spec is None:
            self._queue(request, None)
            return
        grammar = self.structured.prepare(spec, request.tenant, rid)
        if grammar.done():
            self._queue(request, grammar.result())  # a refusal raises here, synchronously
        else:
            self._awaiting_grammar[rid] = (request, grammar)

    def _queue(self, request: EngineRequest, template: Any) -> None:
        """Give a request its first sequence (and its grammar's matcher) in the scheduler."""
        hasher = request.block_hasher(self.kv.block_size, self.config.prefix_hash)
        seq = Sequence(
            seq_id=request.request_id,
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            hasher=hasher,
        )
        if template is not None:
            with self.breadcrumb.on(STEP, request.request_id):
                seq.grammar = template.deep_copy()
        if self.kv_tiers is not None and self.kv_tiers.start_load(seq):
            return  # waits for its blocks from a KV tier; queued by a later step's poll
        self.scheduler.add(seq)

    def _admit_ready_grammars(self) -> None:
        """Queue the requests whose grammar is ready; reject those whose grammar was refused."""
        for rid, (request, grammar) in list(self._awaiting_grammar.items()):
            if not grammar.done():
                continue
            del self._awaiting_grammar[rid]
            error = grammar.exception()
            if error is None:
                self._queue(request, grammar.result())
            elif isinstance(error, StructuredOutputError):
                self._rejected.append((rid, str(error), "structured"))
            elif isinstance(error, GrammarSandboxBusyError):
                self._rejected.append((rid, str(error), "overloaded"))
            else:
                logger.error("preparing the grammar of request %s failed: %s", rid, error)
                self._rejected.append((rid, type(error).__name__, "fault"))

    def take_rejected(self) -> list[tuple[str, str, str]]:
        """Requests refused since the last call: ``(request_id, message, kind)``.

        ``kind`` is ``"structured"`` (a spec the sandbox or the compiler refused: the
        client's 400), ``"overloaded"`` (the sandbox could not judge it in time: a 503) or
        ``"fault"`` (the sandbox could not run: a 500). The core has forgotten them.
        """
        rejected, self._rejected = self._rejected, []
        return rejected

    def abort_request(self, request_id: str) -> bool:
        """Abort a request at any time; its blocks are freed at once.

        Returns:
            False for an unknown (or finished) request.
        """
        if self._awaiting_grammar.pop(request_id, None) is not None:
            return True
        if self.kv_tiers is not None and self.kv_tiers.abort(request_id):
            return True
        return bool(self.scheduler.finish_request(request_id, "abort"))

    def finish_request(
        self, request_id: str, reason: str, stop_reason: int | str | None, index: int | None
    ) -> bool:
        """End a request's sequence (or all of them) for the client: a stop string it found.

        Returns:
            False when nothing was left to finish.
        """
        return bool(self.scheduler.finish_request(request_id, reason, stop_reason, index))

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight (waiting for its grammar included)."""
        return bool(
            self.scheduler.requests
            or self._awaiting_grammar
            or self._rejected
            or (self.kv_tiers is not None and self.kv_tiers.busy)
        )

    # ------------------------------------------------------------------------ adapters
    @property
    def lora_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """``(layer, target name) -> (in_features, out_features)`` an adapter may target."""
        return self.adapter_limits.targets.shapes()

    def add_lora_dir(self, path: str) -> Any:
        """Validate a PEFT LoRA directory and make it available by its digest.

        Returns:
            The validated ``LoraAdapter`` (``.digest`` goes in ``EngineRequest.lora_digest``).

        Raises:
            AdapterError: the adapter is invalid for this model (a ValueError).
        """
        adapter = self.adapters.add_dir(path)
        self.lora_manager.add(adapter)
        return adapter

    def add_lora(self, adapter: Any) -> None:
        """Put an already validated adapter in the CPU tier (hot add)."""
        self.lora_manager.add(adapter)

    def remove_lora(self, digest: str) -> bool:
        """Hot remove; refused (False) while a running sequence uses the adapter."""
        self.adapters.forget(digest)
        return self.lora_manager.remove(digest)

    # --------------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run and update one step.

        A fault raised by one request's part of the step (its forward pass, its sampling)
        fails that request alone (``finish_reason="error"``); every other request of the step
        goes on as if it had not been there.

        Returns:
            An output for every sequence that produced a token or finished this step.

        Raises:
            EngineFaultError: ``MAX_FAILING_STEPS`` steps in a row failed for every sequence
                they ran (the engine itself is broken, not a request).
        """
        t0 = time.perf_counter()
        if self._awaiting_grammar:
            self._admit_ready_grammars()
        tiers = self.kv_tiers
        if tiers is not None:  # loaded requests join; offloaded blocks are unpinned
            tiers.poll(self.scheduler.add, self._kv_load_budget())
        sched = self.scheduler.schedule()
        if sched.is_empty():
            if sched.finished_seq_ids or sched.dropped_seq_ids:  # aborted while nothing ran
                self.runner.update_states(sched)
            if self._awaiting_grammar:  # nothing else to do: wait a little, do not spin
                futures = [g for _, g in self._awaiting_grammar.values()]
                wait_futures(futures, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            elif tiers is not None and tiers.busy:
                tiers.wait(GRAMMAR_WAIT_S)
            return []
        if tiers is not None:  # the step's sequences, finished ones too, for the offload
            seqs = self.scheduler.seqs
            step_seqs = {i.seq_id: seqs[i.seq_id] for i in sched.scheduled if i.seq_id in seqs}
        result = self.runner.execute(sched)
        if sched.scheduled and len(result.failed) >= len(sched.scheduled):
            self._failing_steps += 1
            if self._failing_steps >= MAX_FAILING_STEPS:
                raise EngineFaultError(
                    f"{self._failing_steps} steps in a row failed for every sequence: "
                    + "; ".join(sorted(set(result.failed.values())))
                )
        elif sched.scheduled:
            self._failing_steps = 0
        outputs = self.scheduler.update_from_output(sched, result)
        if sched.kv_trims:
            self.runner.apply_kv_trims(sched.kv_trims)
        if tiers is not None:
            tiers.offload_step(sched, step_seqs)
        self.step_stats.record(time.perf_counter() - t0, result.forward_seconds)
        return outputs

    def _kv_load_budget(self) -> float | None:
        """Seconds of KV tier loading before this step: None (all) when nothing else runs.

        Otherwise ``kv_load_step_share`` of the last step's time (at least 1 ms), so the
        running requests' steps take at most about that much longer while a load goes on.
        """
        sched = self.scheduler
        if not sched.running and not sched.waiting:
            return None
        recent = self.step_stats.recent
        last = recent[-1][0] if recent else 0.0
        return max(KV_LOAD_MIN_BUDGET_S, self.config.kv_load_step_share * last)

    def drain_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call, oldest first (none unless ``enable_kv_events``)."""
        return self.kv_events.drain() if self.kv_events is not None else []

    # -------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """A snapshot of scheduler and cache figures."""
        return {
            "kv_blocks_total": self.kv.pool.num_blocks,
            "kv_block_size": self.kv.block_size,
            "kv_cache_bytes": self.kv_sizing.pool_bytes,
            "kv_blocks_in_use": self.kv.pool.num_used,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "prefix_cache_queried_tokens": self.kv.stats.total.queried_tokens,
            "prefix_cache_hit_tokens": self.kv.stats.total.hit_tokens,
            "lora_slots_in_use": self.lora_manager.slots_in_use,
            "lora_loads": self.lora_manager.num_loads,
            "requests_waiting_for_grammar": len(self._awaiting_grammar),
            **self.structured.stats(),
            **self.scheduler.spec_stats.as_dict(),
            **(self.kv_tiers.snapshot() if self.kv_tiers is not None else {}),
        }

    def shutdown(self) -> None:
        """Stop the helpers the core started (the grammar sandbox's workers and thread)."""
        self.structured.shutdown()
        if self.kv_tiers is not None:
            self.kv_tiers.close()
