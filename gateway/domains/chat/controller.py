"""``POST /v1/chat/completions``: OpenAI Chat Completions over the engine (docs/api.md).

Order of checks, and what each failure leaves behind::

    auth (401/403, middleware)           no usage row (503 + Retry-After: database unreachable)
    draining or engine down (503)        no usage row
    body read: size (413), too slow (408, the transport's)   no usage row, no slot taken
    usage backlog full (503 + Retry-After)   no usage row (the usage database is unreachable)
    rate limits (429 + Retry-After)      no usage row; counted in loraplex_rate_limited_requests
    admission control (503 + Retry-After: the server, or the tenant's share of it, is full)
                                         no usage row; counted there as limit="overloaded"
    body: JSON and fields (400), model (404), messages and images (400),
          prompt + max_tokens vs max_model_len (400)      usage row "error", 0 tokens
    engine run: see ``service.ChatRun``                    usage row "ok" / "error" / "aborted"

Every request past the rate limiter writes exactly one usage row, keyed by its response id
(the server's own id): every executed request is billed, and a usage write retried after a crash
or a database outage is not billed twice. The client's ``X-Request-Id`` is recorded in the row
(``client_request_id``) and never merges requests: two requests sending the same one are two
rows. The response's last bytes (the JSON body; the final chunk and ``[DONE]`` of a stream) go
out only once the row is durable (``ChatRun.durable``; ``docs/usage.md``); an error answer also
waits for its row. The engine request's cache salt always starts with the tenant's id; a
client ``cache_salt`` can only split the tenant's own cache further.

The client is watched while the engine works (``ChatRun.watch_client``, one task per request):
one that disconnects (before the answer, or mid-stream) gets its engine request aborted and its
usage recorded as ``aborted``.

Served by ``LimitedHttpProtocol`` (``serve``), the request's ``Exchange`` (in its scope) holds
the key's rate-limit ticket until the response is written or the connection cut (a client that
stops reading keeps its slot taken until the write deadline cuts it), and a stream's ``ok`` row
waits for its last write (``ChatRun.deliver``): cut before it, the row says ``aborted`` with the
cut's reason (``write_timeout``, ``evicted_stalled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from litestar import Request, Response, post
from litestar.di import Provide
from litestar.exceptions import HTTPException

from loraplex.engine.client.fair_pool import PoolBusyError
from loraplex.engine.client.inputs import ProcessedPrompt
from loraplex.engine.request import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    EngineRequest,
    RequestOutput,
    RequestOutputKind,
)
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.chat.batch import per_prompt, prompt_spans
from loraplex.gateway.domains.chat.body import ChatCompletionBody, CompletionBody
from loraplex.gateway.domains.chat.completions import parse_completion_request
from loraplex.gateway.domains.chat.responses import (
    completion_body,
    legacy_prompt_logprobs_body,
    prompt_part_of,
    text_completion_body,
)
from loraplex.gateway.domains.chat.schemas import ChatRequest, parse_chat_request
from loraplex.gateway.domains.chat.service import (
    ChatDeps,
    ChatRun,
    admit_rate,
    resolve_model,
)
from loraplex.gateway.domains.chat.service_tier import priority_of
from loraplex.gateway.domains.chat.streaming import HEADERS, EventStream, StreamMeta, chunk_stream
from loraplex.gateway.errors import (
    ERROR_TYPES,
    APIError,
    bad_request,
    error_body,
    overloaded,
    pool_busy,
)
from loraplex.gateway.limits.admission import OverloadedError
from loraplex.gateway.limits.ratelimit import Ticket
from loraplex.gateway.transport import request_id
from loraplex.gateway.transport.http_protocol import Exchange, exchange_of
from loraplex.gateway.usage.ledger import UsageLedger

logger = logging.getLogger(__name__)


def _documented_chat(data: ChatCompletionBody) -> None:  # pragma: no cover - never called
    """Names the body's type for ``/docs``.

    The handler reads and checks the raw body itself (``parse_chat_request``), after the rate
    limiter and admission, so Litestar must not.
    """


def _documented_completion(data: CompletionBody) -> None:  # pragma: no cover - never called
    """As :func:`_documented_chat`, for ``/v1/completions``."""


@post(
    "/v1/chat/completions",
    status_code=200,
    dependencies={
        "documented_body": Provide(_documented_chat, sync_to_thread=False),
    },
)
async def chat_completions(request: Request, chat_deps: Injected[ChatDeps]) -> Response:
    """Answer one chat request, as JSON or as server-sent events (``stream: true``).

    Raises:
        APIError: 400 bad request, 404 unknown model, 413 body too large (Litestar's, mapped),
            429 rate limited, 503 draining, engine unavailable or usage unrecordable (the
            usage database unreachable past the backlog limit); always OpenAI's error body.
    """
    return await _generate(request, chat_deps, "chatcmpl-", parse_chat_request)


@post(
    "/v1/completions",
    status_code=200,
    dependencies={
        "documented_body": Provide(_documented_completion, sync_to_thread=False),
    },
)
async def completions(request: Request, chat_deps: Injected[ChatDeps]) -> Response:
    """Answer one (legacy) Completions request: text or token-id prompts, no chat template.

    A list of prompts is one request: one engine request per prompt, one answer and one usage
    row (``gateway.domains.chat.batch``).

    Raises:
        APIError: as :func:`chat_completions`; ``suffix``, more than ``max_n`` choices (prompts
            x ``n``), mixed prompt kinds and ``best_of`` other than ``n`` are 400s naming the
            field.
    """
    return await _generate(request, chat_deps, "cmpl-", parse_completion_request)


Answer = Callable[[ChatDeps, ChatRun, ChatRequest, str, Callable[[], Any] | None], Any]
"""Renders a started run: ``answer(deps, run, chat, response_id, writable) -> Response``."""


async def _generate(
    request: Request,
    deps: ChatDeps,
    id_prefix: str,
    parse: Any,
    answer: Answer | None = None,
) -> Response:
    """The flow every generation endpoint shares (the order of checks in the module doc).

    Args:
        request: The HTTP request.
        deps: The gateway.
        id_prefix: The response id's prefix (``chatcmpl-``, ``cmpl-``, ``resp_``).
        parse: ``parse(body, max_tokens_limit=, max_n=, max_parts=, vocab_size=)`` to a
            :class:`ChatRequest`, or to an awaitable of one (the Responses API reads its
            ``previous_response_id`` from the database).
        answer: Renders the run (the Responses API's objects and events); None: Chat
            Completions' or Completions' JSON or SSE.
    """
    principal: TenantPrincipal = request.user
    if deps.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if not deps.engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_unavailable")
    deps.usage.admit()
    body = await request.body()  # first: a slowly sent body holds no concurrency slot
    ticket = await admit_rate(deps, principal)
    exchange = exchange_of(request.scope)
    if exchange is not None:  # the slot is held until the response is written or cut
        exchange.on_written(ticket.hold())
    try:
        admission = deps.admission.admit(principal.tenant_id)
    except OverloadedError as exc:
        ticket.release(0)
        deps.metrics.rate_limited.labels(principal.tenant_id, "overloaded").inc()
        raise overloaded(str(exc), exc.retry_after) from None
    client_id = request_id.client_id(request.scope)
    # the server's id: the response's ``id`` and the usage row's key, unique per request;
    # it ends with the x-request-id the response carries unless the client named that one
    server_id = request_id.new_id() if client_id else request_id.request_id(request.scope)
    response_id = id_prefix + server_id
    ledger = UsageLedger(deps, principal, ticket, response_id, client_id)
    ledger.admission = admission
    run: ChatRun | None = None
    try:
        if client_id is None and request_id.sent_id(request.scope) is not None:
            raise bad_request(
                "X-Request-Id must be 1 to 64 printable ASCII characters without spaces",
                param="X-Request-Id",
            )
        chat = _parse(deps, parse, body)
        if inspect.isawaitable(chat):
            chat = await chat
        ledger.model = chat.model
        run = await _start(
            deps, principal, chat, ledger, response_id, exchange, priority_of(chat.service_tier)
        )
        if exchange is not None:
            run.watch_client(request.receive, _cut_reason(exchange))
            exchange.on_written(_ended(run, exchange))
        else:
            run.watch_client(request.receive)
        writable = None if exchange is None else exchange.writable
        if answer is not None:
            return await answer(deps, run, chat, response_id, writable if chat.stream else None)
        if chat.stream:
            return await _stream(deps, run, chat, response_id, writable)
        return await _complete(deps, run, chat, response_id)
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):
            if run is None:
                ledger.close("error", _error_type(exc))
            else:
                run.cancel("shutdown")
            raise
        if run is None:
            ledger.close("error", _error_type(exc))
            await ledger.wait_durable(strict=False)
        else:
            await run.durable(strict=False)
        raise


BATCH_ENDPOINTS = {
    "/v1/chat/completions": ("chatcmpl-", parse_chat_request),
    "/v1/completions": ("cmpl-", parse_completion_request),
}
"""The endpoints a ``/v1/batches`` line may name: its id prefix and body parser."""


def _no_release(_tokens: int) -> None:
    """A batch line's rate-limit ticket releases nothing (batch lines pass no rate limiter)."""


async def run_line(
    deps: ChatDeps,
    principal: TenantPrincipal,
    endpoint: str,
    body: bytes,
    batch_id: str,
) -> tuple[int, str, dict[str, Any]]:
    """Answer one ``/v1/batches`` line through the endpoint's own path, as a JSON body.

    The same parsing, model resolution, prompt processing, engine run, usage row and response
    building as ``POST`` on ``endpoint`` (:func:`_start`, :func:`_answer`); what differs: no
    rate limiter and no admission control (the batch runner bounds its own concurrency), the
    engine request runs at ``PRIORITY_BATCH``, the usage row carries ``batch_id``, and
    ``stream: true`` is refused (a batch line has no connection to stream to).

    Args:
        deps: The generation dependencies.
        principal: The tenant (and the key that created the batch).
        endpoint: ``/v1/chat/completions`` or ``/v1/completions`` (``BATCH_ENDPOINTS``).
        body: The line's ``body``, as JSON bytes.
        batch_id: The batch (recorded in the usage row).

    Returns:
        ``(status code, response id, body)``: 200 and the completion, or the error's status and
        OpenAI's error body, as the endpoint would have answered.

    Raises:
        asyncio.CancelledError: the batch was cancelled or the server stops (the engine request
            is aborted, its row says ``aborted``).
    """
    prefix, parse = BATCH_ENDPOINTS[endpoint]
    response_id = f"{prefix}{uuid.uuid4().hex}"
    ledger = UsageLedger(deps, principal, Ticket(_no_release), response_id, batch_id=batch_id)
    run: ChatRun | None = None
    try:
        chat = _parse(deps, parse, body)
        if chat.stream:
            raise bad_request("'stream' cannot be used in a batch request", param="stream")
        ledger.model = chat.model
        chat = dataclasses.replace(chat, service_tier="flex")  # the batch class serves it
        run = await _start(deps, principal, chat, ledger, response_id, priority=PRIORITY_BATCH)
        out = await run.final()
        await run.durable()
        return 200, response_id, await _answer(deps, chat, run, out, response_id)
    except asyncio.CancelledError:
        if run is None:
            ledger.close("aborted", "batch_cancelled")
        else:
            run.cancel("batch_cancelled")
        raise
    except Exception as exc:
        if run is None:
            ledger.close("error", _error_type(exc))
            await ledger.wait_durable(strict=False)
        else:
            await run.durable(strict=False)
        if isinstance(exc, APIError):
            return exc.status, response_id, error_body(exc.status, exc.message, exc.param, exc.code)
        logger.exception("batch %s: a line failed", batch_id)
        return 500, response_id, error_body(500, "internal server error")


def _parse(deps: ChatDeps, parse: Callable[..., Any], body: bytes) -> Any:
    """``parse(body)`` under the server's bounds, for every path that parses a body.

    ``parse`` is the chat, completions or (translating) Responses parser; the bounds are
    ``max_tokens_limit``, ``max_n``, the model length and the vocabulary size.

    Returns:
        What ``parse`` returns: a :class:`ChatRequest`, or an awaitable of one.

    Raises:
        APIError: 400 naming the field at fault (the parser's).
    """
    return parse(
        body,
        max_tokens_limit=deps.config.max_tokens_limit,
        max_n=deps.config.max_n,
        max_parts=deps.engine.max_model_len,
        vocab_size=deps.engine.input_limits.vocab_size,
    )


async def _start(
    deps: ChatDeps,
    principal: TenantPrincipal,
    chat: ChatRequest,
    ledger: UsageLedger,
    response_id: str,
    exchange: Exchange | None = None,
    priority: int = PRIORITY_INTERACTIVE,
) -> ChatRun:
    """Resolve the model, process the messages, check lengths, and start the engine run.

    A stream with an ``exchange`` defers its ``ok`` row to its last write (``ChatRun.deliver``).
    ``priority``: the engine's scheduling class (batch lines: ``PRIORITY_BATCH``).
    """
    engine = deps.engine
    ledger.adapter_digest = await resolve_model(deps, principal.tenant_id, chat.model)
    if len(chat.prompts) > 1:  # a Completions batch: one engine request per prompt
        engine_requests = await _batch_requests(
            deps, principal, chat, ledger, response_id, priority
        )
    else:
        prompt = await _prompt(deps, principal, chat)
        sampling = chat.sampling_params(
            len(prompt.prompt_token_ids), engine.max_model_len, deps.config.max_tokens_limit
        )
        engine_requests = [
            _engine_request(principal, chat, ledger, response_id, prompt, sampling, priority)
        ]
        ledger.images = len(prompt.images)
    ledger.prompt_tokens = sum(len(r.prompt_token_ids) for r in engine_requests)
    try:
        admission = ledger.admission
        if admission is not None:
            admission.reserve_tokens(
                ledger.prompt_tokens
                + sum(r.sampling.max_tokens * r.sampling.n for r in engine_requests)
            )
    except OverloadedError as exc:
        raise overloaded(str(exc), exc.retry_after) from None
    adapter = None if ledger.adapter_digest is None else chat.model
    ledger.measure(deps.metrics.latency.for_model(principal.tenant_id, adapter))
    deliver = chat.stream and exchange is not None
    batch = engine_requests if len(engine_requests) > 1 else None
    return ChatRun(
        deps, engine_requests[0], ledger, chat.structured_param, deliver=deliver, batch=batch
    )


def _engine_request(
    principal: TenantPrincipal,
    chat: ChatRequest,
    ledger: UsageLedger,
    request_id: str,
    prompt: ProcessedPrompt,
    sampling: SamplingParams,
    priority: int = PRIORITY_INTERACTIVE,
) -> EngineRequest:
    """The engine request of one prompt: the tenant's cache salt, fairness group and class."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt.prompt_token_ids,
        sampling=sampling,
        images=prompt.images,
        lora_digest=ledger.adapter_digest,
        cache_salt=chat.engine_cache_salt(principal.tenant_id),  # the tenant's id first
        tenant=principal.tenant_id,  # the scheduler's fairness group
        output_kind=RequestOutputKind.DELTA,  # non-streamed too: the ledger times each token
        priority=priority,
    )


async def _batch_requests(
    deps: ChatDeps,
    principal: TenantPrincipal,
    chat: ChatRequest,
    ledger: UsageLedger,
    response_id: str,
    priority: int = PRIORITY_INTERACTIVE,
) -> list[EngineRequest]:
    """One engine request per prompt of a Completions batch (``gateway.domains.chat.batch``).

    Every prompt's size is checked before any is tokenized; each must leave room for
    ``max_tokens`` in the model length.

    Raises:
        APIError: 400 naming ``prompt`` (or ``max_tokens``), saying which prompt.
    """
    engine = deps.engine
    chats = per_prompt(chat)
    for i, one in enumerate(chats):  # every prompt's size, before any is tokenized
        with _which_prompt(i):
            one.check_size(engine.max_model_len, engine.input_limits.max_token_bytes, 0)
    requests = []
    for i, one in enumerate(chats):
        with _which_prompt(i):
            prompt = await _prompt(deps, principal, one)
            sampling = one.sampling_params(
                len(prompt.prompt_token_ids), engine.max_model_len, deps.config.max_tokens_limit
            )
        request_id = f"{response_id}-{i}"
        requests.append(
            _engine_request(principal, one, ledger, request_id, prompt, sampling, priority)
        )
    return requests


@contextlib.contextmanager
def _which_prompt(i: int) -> Iterator[None]:
    """A 400 raised inside names prompt ``i`` of the batch in its message."""
    try:
        yield
    except APIError as exc:
        if exc.status != 400:
            raise
        raise bad_request(f"prompt {i}: {exc.message}", param=exc.param, code=exc.code) from None


async def _prompt(deps: ChatDeps, principal: TenantPrincipal, chat: ChatRequest) -> ProcessedPrompt:
    """The prompt's token ids (and images).

    The chat template over the messages, or a Completions prompt tokenized as it is (token-id
    prompts are taken as they are: ``parse_completion_request`` checked their range).
    """
    engine = deps.engine
    limits = engine.input_limits
    chat.check_size(engine.max_model_len, limits.max_token_bytes, limits.image_tokens)
    if chat.prompt is not None:
        ids = chat.prompt
        if isinstance(ids, str):
            try:
                ids = await engine.tokenize(
                    ids, add_special_tokens=chat.add_special_tokens, tenant=principal.tenant_id
                )
            except PoolBusyError:
                raise pool_busy() from None
        if not ids:
            raise bad_request("the prompt is empty once tokenized", param="prompt")
        return ProcessedPrompt(prompt_token_ids=list(ids), images=[])
    if chat.images > limits.max_images:
        raise bad_request(
            f"too many images: the messages hold {chat.images}, at most {limits.max_images} "
            "per request",
            param="messages",
        )
    tools = chat.tools
    if tools is not None and tools.mode == "auto" and limits.tool_call_format is None:
        raise bad_request(
            "this model's chat template teaches no tool-call format this server can parse, so "
            "'tool_choice': 'auto' cannot work; use 'required' or name a function",
            param="tool_choice",
        )
    try:
        prompt = await engine.process(
            chat.messages, tenant=principal.tenant_id, tools=tools.tools if tools else None
        )
    except ValueError as exc:  # InvalidImageError included
        raise bad_request(str(exc), param=_part_of(str(exc))) from None
    except PoolBusyError:
        raise pool_busy() from None
    return prompt


async def _complete(deps: ChatDeps, run: ChatRun, chat: ChatRequest, response_id: str) -> Response:
    """Wait for the whole answer (or the client leaving) and return ``chat.completion``."""
    out = await _unless_client_left(run, run.final())
    await run.durable()  # 503 if the row could not be made durable
    body = await _answer(deps, chat, run, out, response_id)
    return Response(body, media_type="application/json")


async def _answer(
    deps: ChatDeps, chat: ChatRequest, run: ChatRun, out: RequestOutput, response_id: str
) -> dict[str, Any]:
    """The ``text_completion`` or ``chat.completion`` body of a finished request."""
    body = await _answer_body(deps, chat, run, out, response_id)
    body["service_tier"] = chat.service_tier  # the tier that served it
    return body


async def _answer_body(
    deps: ChatDeps, chat: ChatRequest, run: ChatRun, out: RequestOutput, response_id: str
) -> dict[str, Any]:
    if chat.prompt is not None:
        return text_completion_body(
            out,
            response_id=response_id,
            created=int(time.time()),
            model=chat.model,
            want_logprobs=chat.logprobs,
            token_bytes=deps.engine.token_bytes,
            echo=await _echoes(deps, chat, run),
            num_top=chat.top_logprobs,
            prompt_logprobs=chat.prompt_logprobs,
            prompt_spans=prompt_spans(run.requests),
        )
    return completion_body(
        out,
        response_id=response_id,
        created=int(time.time()),
        model=chat.model,
        want_logprobs=chat.logprobs,
        token_bytes=deps.engine.token_bytes,
        tool_calls=_tool_parsers(deps, chat),
        prompt_logprobs=chat.prompt_logprobs,
    )


async def _stream(
    deps: ChatDeps,
    run: ChatRun,
    chat: ChatRequest,
    response_id: str,
    writable: Callable[[], Any] | None = None,
) -> Response:
    """Wait for the first output (so refusals are still plain HTTP errors), then stream.

    ``writable``: the connection's ``Exchange.writable``, awaited before the last write.
    """
    first = await _unless_client_left(run, run.next())
    echo = await _echoes(deps, chat, run)
    echo_logprobs = None
    if echo and chat.logprobs:  # the prompt's part, in the chunk that echoes it
        while first.prompt_logprobs is None and not first.finished:  # a batch: every prompt's
            first.add(await _unless_client_left(run, run.next()))
        token_bytes, num_top = deps.engine.token_bytes, chat.top_logprobs
        part = prompt_part_of(
            first,
            prompt_spans(run.requests),
            lambda ids, lps: legacy_prompt_logprobs_body(ids, lps, num_top, token_bytes),
        )
        echo_logprobs = [part(i) for i in range(run.choices)]
    meta = StreamMeta(
        response_id=response_id,
        created=int(time.time()),
        model=chat.model,
        n=run.choices,
        include_usage=chat.include_usage,
        continuous_usage=chat.continuous_usage,
        want_logprobs=chat.logprobs,
        token_bytes=deps.engine.token_bytes,
        tool_calls=_tool_parsers(deps, chat),
        text_completion=chat.prompt is not None,
        echo=echo,
        echo_logprobs=echo_logprobs,
        service_tier=chat.service_tier,
    )
    return EventStream(chunk_stream(run, first, meta, writable), headers=HEADERS)


def _cut_reason(exchange: Exchange) -> Callable[[], str | None]:
    """Why the server cut the request's connection, once it did (None while it did not)."""
    return lambda: exchange.cut_reason


def _ended(run: ChatRun, exchange: Exchange) -> Callable[[], None]:
    """What the response's end does to the run (``Exchange.on_written``).

    Nothing once its row is recorded (always, when the answer went out whole); else the row
    says ``aborted`` (cut: with the cut's reason).
    """

    def ended() -> None:
        if exchange.lost:
            run.client_gone()
        else:
            run.cancel("client_disconnected")

    return ended


async def _echo(deps: ChatDeps, chat: ChatRequest, prompt_ids: list[int]) -> str:
    """Completions' ``echo``: the prompt's text ("" unless asked for)."""
    if not chat.echo:
        return ""
    if isinstance(chat.prompt, str):
        return chat.prompt
    return await deps.engine.detokenize(prompt_ids)


async def _echoes(deps: ChatDeps, chat: ChatRequest, run: ChatRun) -> str | list[str]:
    """Completions' ``echo`` of the run: the prompt's text, or for a batch one per choice.

    Choice ``i * n + j`` of a batch echoes prompt ``i``.
    """
    if len(run.requests) == 1:
        return await _echo(deps, chat, run.request.prompt_token_ids)
    if not chat.echo:
        return ""
    echoes = []
    for one, request in zip(per_prompt(chat), run.requests, strict=True):
        echoes += [await _echo(deps, one, request.prompt_token_ids)] * request.sampling.n
    return echoes


def _tool_parsers(deps: ChatDeps, chat: ChatRequest) -> Callable[[], Any]:
    """Makes a fresh tool-call parser per choice (None when the request offers no tools)."""
    tools = chat.tools
    if tools is None:
        return lambda: None
    fmt = deps.engine.input_limits.tool_call_format
    return lambda: tools.streamer(fmt)


async def _unless_client_left(run: ChatRun, waiting: Any) -> RequestOutput:
    """Await ``waiting`` (an output of ``run``, which watches the client: ``watch_client``).

    Raises:
        APIError: what ``waiting`` raises, or 503 ``client_disconnected`` once the run was
            cancelled because the client left (nobody reads that answer).
    """
    try:
        return await waiting
    except APIError:
        if run.client_left:
            raise APIError(503, "the client disconnected", code="client_disconnected") from None
        raise


_PART = re.compile(r"^(messages\[\d+\](?:\.content\[\d+\])?)[:. ]")


def _part_of(message: str) -> str:
    """The ``messages[i].content[j]`` a processing error names first, else ``messages``."""
    found = _PART.match(message)
    return found.group(1) if found else "messages"


def _error_type(exc: BaseException) -> str:
    """The usage row's ``error_type`` for a request that failed before the engine."""
    if isinstance(exc, APIError):
        return exc.code or ERROR_TYPES.get(exc.status, "invalid_request_error")
    if isinstance(exc, HTTPException):
        if exc.status_code == 413:
            return "request_too_large"
        return ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    if isinstance(exc, asyncio.CancelledError):
        return "shutdown"
    return "internal_error"
