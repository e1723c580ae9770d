"""Batched prompts of ``POST /v1/completions``: one engine request per prompt, one answer.

A Completions ``prompt`` may be a list of prompts (OpenAI's and vLLM's batched form). Each
prompt becomes its own :class:`~engine.request.EngineRequest` (id ``<response id>-<i>``, the
same sampling, adapter, cache salt and tenant), so the prompts run side by side in the engine's
continuous batch. :func:`fan_in` merges their output streams into the one stream a
``ChatRun`` reads, as if the request were one with ``prompts x n`` choices:

- choice ``j`` of prompt ``i`` becomes choice ``i * n + j`` (OpenAI's and vLLM's indexing);
- the merged outputs' ``prompt_token_ids`` is every prompt's tokens in order, so the usage
  row's ``prompt_tokens`` (and ``usage.prompt_tokens``) is their sum; ``num_cached_tokens`` is
  the sum of each prompt's cached tokens; completion tokens add up per choice as for ``n``;
- with ``prompt_logprobs`` asked, the merged ``prompt_logprobs`` lines up with the merged
  ``prompt_token_ids``: every prompt's list (None first) in order, sent once, in the output
  where the last prompt's came; :func:`prompt_spans` says which part is each choice's prompt;
- the merged stream finishes when every prompt has finished.

One prompt failing fails the request: a prompt finished with an error (a fault in its part of
a step) or aborted by the engine ends the merged stream with that finished output (the run
answers 500 / 503 as for one prompt), and an exception from one prompt's stream (refused,
engine death) is raised; either way every other prompt's engine request is aborted at once
(its stream closed: ``engine.client.front.generate`` aborts it and frees its KV blocks at the
next step boundary). Cancelling the reader (client gone, shutdown) aborts them all the same
way. The usage row counts what every prompt produced up to then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.gateway.domains.chat.schemas import ChatRequest, utf8_len


def per_prompt(chat: ChatRequest) -> list[ChatRequest]:
    """One request per prompt of ``chat``, each as if it held that prompt alone.

    Returns:
        ``chat`` with ``prompt`` / ``prompts`` / ``text_bytes`` of each prompt, in order.
    """
    return [
        dataclasses.replace(
            chat,
            prompt=p,
            prompts=[p],
            text_bytes=utf8_len(p) if isinstance(p, str) else 0,
        )
        for p in chat.prompts
    ]


def prompt_spans(requests: list[EngineRequest]) -> list[slice]:
    """Per choice index, where its prompt lies in the merged ``prompt_token_ids``.

    Args:
        requests: One engine request per prompt, in prompt order (one request: no batch).

    Returns:
        One slice per choice (``i * n + j`` -> prompt ``i``) into the merged outputs'
        ``prompt_token_ids`` and ``prompt_logprobs`` (:func:`fan_in`); for one request, its
        whole prompt for each of its ``n`` choices.
    """
    spans: list[slice] = []
    at = 0
    for r in requests:
        span = slice(at, at + len(r.prompt_token_ids))
        spans += [span] * r.sampling.n
        at = span.stop
    return spans


def _failed(out: RequestOutput) -> bool:
    """A finished output that ends the whole request: an error, or an engine abort."""
    return out.finished and (
        out.error is not None or any(c.finish_reason == "abort" for c in out.outputs)
    )


async def _forward(outputs: AsyncIterator[RequestOutput], i: int, queue: asyncio.Queue) -> None:
    """Put prompt ``i``'s outputs (or the exception that ended them) into ``queue``.

    Cancelled, the stream is closed, which aborts its engine request.
    """
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                queue.put_nowait((i, out))
        except Exception as exc:  # the reader raises it (and aborts the others)
            queue.put_nowait((i, exc))


async def fan_in(
    generate: Callable[[EngineRequest], AsyncIterator[RequestOutput]],
    requests: list[EngineRequest],
    request_id: str,
) -> AsyncIterator[RequestOutput]:
    """The merged ``DELTA`` outputs of ``requests``, one prompt each, as one request's.

    Args:
        generate: The engine's ``generate`` (one stream per engine request).
        requests: One engine request per prompt, in prompt order; each with the same ``n``.
        request_id: The merged outputs' ``request_id`` (the response id).

    Yields:
        ``RequestOutput`` s (``DELTA``): each one prompt's news, its choices renumbered
        ``i * n + j``, ``prompt_token_ids`` every prompt's tokens, ``num_cached_tokens``
        summed; ``finished`` once every prompt finished, or with the first that failed;
        ``prompt_logprobs`` (when asked) every prompt's, concatenated like
        ``prompt_token_ids``, in one output only: the one where the last prompt's came.

    Raises:
        Exception: what a prompt's stream raised (``ValueError`` for an engine refusal,
            ``EngineDeadError`` ...); the other prompts are aborted first.
    """
    prompt_ids = [t for r in requests for t in r.prompt_token_ids]
    base = [0]
    for r in requests[:-1]:
        base.append(base[-1] + r.sampling.n)
    cached = [0] * len(requests)
    scored: list[list | None] = [None] * len(requests)  # each prompt's prompt logprobs
    unscored = sum(r.sampling.prompt_logprobs is not None for r in requests)
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [
        asyncio.create_task(_forward(generate(r), i, queue), name=f"loraplex-{r.request_id}")
        for i, r in enumerate(requests)
    ]
    running = len(requests)
    try:
        while running:
            i, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            running -= out.finished
            cached[i] = out.num_cached_tokens
            failed = _failed(out)
            shift = base[i]
            prompt_logprobs = None
            if out.prompt_logprobs is not None and scored[i] is None:
                scored[i] = out.prompt_logprobs
                unscored -= 1
                if unscored == 0:  # every prompt's, in prompt order, as prompt_token_ids
                    prompt_logprobs = [e for entries in scored for e in entries or []]
            yield RequestOutput(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                outputs=[dataclasses.replace(c, index=c.index + shift) for c in out.outputs],
                finished=failed or running == 0,
                num_cached_tokens=sum(cached),
                ttft=out.ttft,
                queue_time=out.queue_time,
                error=out.error,
                prompt_logprobs=prompt_logprobs,
            )
            if failed:
                return
    finally:  # done, failed, or cancelled: no prompt's engine request outlives the request
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
