"""The engine core's structured outputs: grammars vetted, then compiled, all off the step.

::

    EngineCore.add_request(req)   prepare(spec, tenant) -> Future[template]
                                      cached template?          done at once
                                      sandbox verdict           GrammarSandbox.vet (a worker
                                                                process; refusals cached too)
                                      compiled here             a thread of the core, lowered
                                                                priority (llguidance releases
                                                                the GIL while it compiles)
    EngineCore.step()             requests whose future is done join the scheduler (each
                                  sequence gets a deep copy of the template); refused ones
                                  are rejected (a 400)

So the engine's step never waits for a compile and never runs a grammar the sandbox has not
compiled first (vLLM's ``WAITING_FOR_FSM`` requests, with the compile isolated in a process).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from loraplex.engine.core.breadcrumb import COMPILE, Breadcrumb
from loraplex.engine.structured_output.grammar import (
    GrammarCompiler,
    StructuredOutputError,
    StructuredOutputSpec,
    tokenizer_json,
)
from loraplex.engine.structured_output.sandbox import (
    GrammarSandbox,
    GrammarSandboxBusyError,
    SandboxLimits,
    spec_digest,
)
from loraplex.engine.structured_output.worker import COMPILE_STACK_BYTES

logger = logging.getLogger(__name__)

CORE_COMPILE_STACK_BYTES = 8 * COMPILE_STACK_BYTES  # the core's compile thread (see the worker)


class StructuredOutputManager:
    """One compiler for the served model, and the sandbox that vets what it compiles.

    Args:
        model_dir: The served model's directory (its tokenizer is read on first use, on a
            background thread).
        vocab_size: The model's vocabulary size.
        eos_token_ids: The ids that end a sequence.
        hf_tokenizer: The tokenizer if the caller has it loaded (saves reading it again).
        sandbox: The grammar sandbox's limits (None: ``SandboxLimits()``'s defaults).
        breadcrumb: Where each compile is marked with the request that asked for it first
            (``engine.core.breadcrumb``, the compile thread's slot); marks nothing when None.
    """

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        hf_tokenizer: Any = None,
        sandbox: SandboxLimits | None = None,
        breadcrumb: Breadcrumb | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.breadcrumb = breadcrumb if breadcrumb is not None else Breadcrumb()
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.hf_tokenizer = hf_tokenizer
        limits = sandbox if sandbox is not None else SandboxLimits()
        self.sandbox = GrammarSandbox(
            lambda: self.compiler.tokenizer_json, vocab_size, self.eos_token_ids, limits
        )
        self._nice = limits.nice
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # held while the tokenizer is read (seconds)
        self._lock = threading.Lock()  # the in-flight table: held for microseconds
        self._inflight: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (the tokenizer is read and indexed on the first call, ~0.1-1 s).

        Raises:
            ValueError: the model has no fast tokenizer.
        """
        with self._compiler_lock:
            if self._compiler is None:
                tok = self.hf_tokenizer
                if tok is None:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(self.model_dir)
                self._compiler = GrammarCompiler(
                    tokenizer_json(tok), self.vocab_size, self.eos_token_ids
                )
            return self._compiler

    def use_tokenizer(self, hf_tokenizer: Any) -> None:
        """Take an already loaded tokenizer instead of reading the model's on first use."""
        with self._compiler_lock:
            if self._compiler is None:
                self.hf_tokenizer = hf_tokenizer

    def prepare(
        self, spec: StructuredOutputSpec, tenant: str | None = None, request_id: str = ""
    ) -> Future:
        """The compiled template matcher of ``spec``, as a future; never blocks.

        Done at once when the template is cached, or when the sandbox already refused the spec.
        Otherwise the sandbox vets it (in ``tenant``'s turn) and a background thread compiles
        it, marked with ``request_id`` (the first request that asked for it).

        Returns:
            A future of the template (``LLMatcher``; give each sequence a ``deep_copy``). Its
            exception is a :class:`StructuredOutputError` for a spec the sandbox or the
            compiler refuses (a 400), ``GrammarSandboxBusyError`` when the sandbox could not
            judge it in time on a loaded machine (a 503), ``GrammarSandboxError`` when the
            sandbox cannot run.
        """
        compiler = self._compiler
        if compiler is not None:
            template = compiler.cached(spec)
            if template is not None:
                done: Future = Future()
                done.set_result(template)
                return done
        digest = spec_digest(spec.kind, spec.value)
        with self._lock:
            future = self._inflight.get(digest)
            if future is not None:
                return future
            future = Future()
            self._inflight[digest] = future
        try:
            vetted = self.sandbox.vet(spec.kind, spec.value, tenant)
        except RuntimeError as exc:
            self._settle(digest, future, error=exc)
            return future
        vetted.add_done_callback(lambda v: self._vetted(spec, digest, future, v, request_id))
        return future

    def stats(self) -> dict[str, int]:
        """Sandbox figures (``grammar_vetted``, ``grammar_refused``, ...) and compiles."""
        compiled = self._compiler.num_compiled if self._compiler is not None else 0
        return {**self.sandbox.stats, "grammar_compiled": compiled}

    def shutdown(self) -> None:
        """Stop the sandbox's workers and the compile thread."""
        self.sandbox.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------- internals
    def _vetted(
        self,
        spec: StructuredOutputSpec,
        digest: str,
        future: Future,
        vetted: Future,
        request_id: str,
    ) -> None:
        error = vetted.exception()
        if error is not None:
            self._settle(digest, future, error=error)
        elif vetted.result().transient:
            self._settle(digest, future, error=GrammarSandboxBusyError(vetted.result().error))
        elif not vetted.result().ok:
            self._settle(digest, future, error=StructuredOutputError(vetted.result().error))
        else:
            try:
                self._compile_pool().submit(self._compile, spec, digest, future, request_id)
            except RuntimeError as exc:  # shut down
                self._settle(digest, future, error=exc)

    def _compile(
        self, spec: StructuredOutputSpec, digest: str, future: Future, request_id: str
    ) -> None:
        try:
            compiler = self.compiler  # the tokenizer is read outside the mark
            with self.breadcrumb.on(COMPILE, request_id):
                template = compiler.template(spec)
        except StructuredOutputError as exc:
            self._settle(digest, future, error=exc)
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            logger.exception("compiling a vetted %s failed", spec.kind)
            self._settle(digest, future, error=exc)
        else:
            self._settle(digest, future, result=template)

    def _settle(
        self, digest: str, future: Future, result: Any = None, error: BaseException | None = None
    ) -> None:
        with self._lock:
            self._inflight.pop(digest, None)
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _compile_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    1,
                    thread_name_prefix="loraplex-grammar-compile",
                    initializer=_lower_priority,
                    initargs=(self._nice,),
                )
                # Its one thread starts now, with 8x the stack a sandbox job had.
                old = threading.stack_size(CORE_COMPILE_STACK_BYTES)
                try:
                    self._pool.submit(int).result()
                finally:
                    threading.stack_size(old)
            return self._pool


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: a thread's own nice value)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError:  # not permitted here: the compile still runs off the step
        pass
