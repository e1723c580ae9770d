"""The client side of the engine core: token ids in, text and ``RequestOutput``s out.

vLLM v1's ``OutputProcessor``, at our size. The engine core (``engine.core.engine_core``) deals
only in token ids and decides every finish it can see from them (EOS, stop token ids,
``max_tokens``, the model length, faults); this processor, on the client's side of the core (in
process for ``LLM``, in the front ``engine.client.front.AsyncLLM`` for serving), owns per request:

- one :class:`IncrementalDetokenizer` per output index, and with it the stop-string search;
  a stop string found ends that output here and goes back to the core as a
  ``engine.core.wire.FinishRequest`` (the one way back: the core then frees the sequence's blocks);
- the time to first token;
- what each output carries (``engine.request.RequestOutputKind``): only what is new since the
  previous output (``DELTA``, streaming) or, once, everything (``FINAL_ONLY``). Nothing is
  re-copied per step: a ``DELTA`` output holds the step's tokens, text and logprobs alone, and
  the prompt is the request's own list.

A fault detokenizing one request fails that request alone (``finish_reason="error"``; the core
is told to finish it), never the step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.client.detokenizer import IncrementalDetokenizer
from loraplex.engine.core.wire import FinishRequest
from loraplex.engine.request import (
    CompletionOutput,
    EngineRequest,
    RequestOutput,
    RequestOutputKind,
)
from loraplex.engine.scheduling.output import EngineCoreOutput, Logprob

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs became.

    Attributes:
        request_outputs: One per request with news (``DELTA``) or finished (``FINAL_ONLY``).
        finish: Finishes to send back to the core (``engine.core.wire.FinishRequest``: the
            reason ``"stop"`` with the stop string, or ``"error"``; the output index, None
            for the whole request).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    finish: list[FinishRequest] = field(default_factory=list)


@dataclass
class _Output:
    """One output index of a request."""

    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)  # FINAL_ONLY: everything
    logprobs: list[Logprob] = field(default_factory=list)  # FINAL_ONLY: everything
    # DELTA: what this batch added, until the request's output is built.
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] = field(default_factory=list)
    touched: bool = False


@dataclass
class _Request:
    request: EngineRequest
    outputs: dict[int, _Output] = field(default_factory=dict)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    core_finished: bool = False  # the core forgot the request
    prompt_logprobs: list | None = None  # [None, *the core's], until an output carries them


class OutputProcessor:
    """Turns the core's per-sequence token outputs into per-request ``RequestOutput``s.

    Args:
        tokenizer: The served model's tokenizer (fast, ideally).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(self, request: EngineRequest) -> None:
        """Start tracking a request (before the core sees it).

        Raises:
            ValueError: its id is already in flight.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = _Request(request)

    def remove(self, request_id: str) -> None:
        """Forget a request the core refused (or never saw)."""
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while any tracked request has not had its final output."""
        return bool(self.requests)

    def _output(self, state: _Request, index: int) -> _Output:
        out = state.outputs.get(index)
        if out is None:
            out = state.outputs[index] = _Output(
                IncrementalDetokenizer(self.tokenizer, state.request.sampling)
            )
        return out

    # ------------------------------------------------------------------------- process
    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply a step's (or several steps') core outputs.

        Outputs of a request that is not tracked, or of an index that already finished here
        (a stop string found while the core ran on), are dropped.
        """
        result = ProcessedOutputs()
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for core in core_outputs:
            state = self.requests.get(core.request_id)
            if state is None:
                continue
            touched[core.request_id] = state
            try:
                self._apply(state, core, now, result)
            except Exception as exc:  # this request's detokenization: it fails alone
                logger.error(
                    "request %s failed in detokenization: %s: %s",
                    core.request_id,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                self._fail(state, "the request failed in detokenization")
                result.finish.append(FinishRequest(core.request_id, "error", None, None))
        for rid, state in touched.items():
            out = self._request_output(state)
            if out is not None:
                result.request_outputs.append(out)
                if out.finished:
                    del self.requests[rid]
        return result

    def _apply(
        self, state: _Request, core: EngineCoreOutput, now: float, result: ProcessedOutputs
    ) -> None:
        if core.request_finished:
            state.core_finished = True
        if core.error is not None and core.finish_reason == "error" and state.error is None:
            state.error = core.error  # a fault failed it (an abort's error is its reason)
        state.num_cached_tokens = core.num_cached_tokens
        if state.first_scheduled_time is None:
            state.first_scheduled_time = core.first_scheduled_time
        if core.prompt_logprobs is not None:  # the first prompt token has none (vLLM)
            state.prompt_logprobs = [None, *core.prompt_logprobs]
        out = self._output(state, core.index)
        if out.finish_reason is not None:  # ended here by a stop string: late news
            return
        out.touched = True
        tokens = core.new_token_ids
        if tokens and state.first_token_time is None:
            state.first_token_time = now
        want_logprobs = state.request.sampling.logprobs is not None
        kept = len(tokens)
        text = ""
        last = len(tokens) - 1
        for k, token in enumerate(tokens):
            text += out.detokenizer.append(token, stop_token=k == last and core.ends_on_stop_token)
            if out.detokenizer.stop_matched is not None:
                kept = k + 1
                break
        new_ids = tokens[:kept]
        new_logprobs = (core.new_logprobs or [])[:kept] if want_logprobs else []
        matched = out.detokenizer.stop_matched
        if matched is None and core.finish_reason is not None:
            text += out.detokenizer.finish()  # flush; the tail may still hold a stop string
            matched = out.detokenizer.stop_matched
            out.finish_reason = core.finish_reason
            # An abort's reason (its adapter could not be loaded) is the output's stop reason.
            out.stop_reason = core.error if core.finish_reason == "abort" else core.stop_reason
        if matched is not None:
            if core.finish_reason is None:  # the core runs on: tell it
                result.finish.append(FinishRequest(state.request.request_id, "stop", matched,
                                                   core.index))  # fmt: skip
            out.finish_reason, out.stop_reason = "stop", matched
        out.num_tokens += len(new_ids)
        if state.request.output_kind is RequestOutputKind.FINAL_ONLY:
            out.token_ids.extend(new_ids)
            out.logprobs.extend(new_logprobs)
        else:
            out.delta_text += text
            out.delta_ids.extend(new_ids)
            out.delta_logprobs.extend(new_logprobs)

    def _finished(self, state: _Request) -> bool:
        if state.error is not None:
            return all(o.finish_reason is not None for o in state.outputs.values())
        done = [o.finish_reason is not None for o in state.outputs.values()]
        if state.core_finished:
            return all(done)
        return len(done) >= state.request.sampling.n and all(done)

    def _request_output(self, state: _Request) -> RequestOutput | None:
        """The request's output after this batch (None: ``FINAL_ONLY`` and not finished)."""
        finished = self._finished(state)
        final_only = state.request.output_kind is RequestOutputKind.FINAL_ONLY
        if final_only and not finished:
            return None
        want_logprobs = state.request.sampling.logprobs is not None
        outs = []
        for index in sorted(state.outputs):
            o = state.outputs[index]
            if final_only:
                text, ids, lps = o.detokenizer.text, o.token_ids, o.logprobs
            elif o.touched:
                text, ids, lps = o.delta_text, o.delta_ids, o.delta_logprobs
                o.delta_text, o.delta_ids, o.delta_logprobs = "", [], []
            else:
                continue
            o.touched = False
            outs.append(
                CompletionOutput(
                    index=index,
                    text=text if state.error is None else "",
                    token_ids=ids,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    logprobs=lps if want_logprobs else None,
                    num_tokens=o.num_tokens,
                )
            )
        ttft = (
            None
            if state.first_token_time is None
            else state.first_token_time - state.request.arrival_time
        )
        scheduled = state.first_scheduled_time
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None  # sent once
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.request.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            ttft=ttft,
            queue_time=None if scheduled is None else scheduled - state.request.arrival_time,
            error=state.error,
            prompt_logprobs=prompt_logprobs,
        )

    # -------------------------------------------------------------------------- endings
    def _fail(self, state: _Request, error: str) -> None:
        state.error = error
        if not state.outputs:
            self._output(state, 0)
        for o in state.outputs.values():
            if o.finish_reason is None:
                o.finish_reason, o.touched = "error", True

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request here (the caller aborts it in the core): its final output.

        Text a detokenizer still held back is released. Returns None for an unknown request.
        """
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        if not state.outputs:
            self._output(state, 0)
        final_only = state.request.output_kind is RequestOutputKind.FINAL_ONLY
        for o in state.outputs.values():
            if o.finish_reason is None:
                tail = o.detokenizer.finish()
                if not final_only:
                    o.delta_text += tail
                o.finish_reason, o.touched = reason, True
        state.core_finished = True
        out = self._request_output(state)
        assert out is not None and out.finished
        return out

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with ``"error"`` (a fault outside the core's step): its final output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self._fail(state, error)
        state.core_finished = True
        del self.requests[request_id]
        return self._request_output(state)
