"""``/v1/responses``: OpenAI's Responses API over the chat pipeline (docs/api.md).

``POST /v1/responses`` runs the chat controller's flow (``gateway.domains.chat.controller``:
auth, rate limits, admission, one usage row per response keyed by its ``resp_`` id, the
client watched, the row durable before the last bytes) with two hooks:

- its parse step checks the Responses body, reads the ``previous_response_id`` conversation
  from the database (the calling tenant's only: anything else is a 404), and translates the
  request into a Chat Completions body (``translate``), parsed by the chat parser;
- its answer step renders the run as a Response object, or as Responses stream events
  (``output``, ``events``), and stores the response (``store``, default true) before the
  answer's last bytes go out.

``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` read and delete the calling
tenant's stored responses; another tenant's id is the same 404 as an unknown one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import Provide
from litestar.params import FromPath

from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.chat.controller import _generate, _tool_parsers, _unless_client_left
from loraplex.gateway.domains.chat.schemas import ChatRequest, parse_chat_request
from loraplex.gateway.domains.chat.service import ChatDeps, ChatRun
from loraplex.gateway.domains.chat.streaming import HEADERS, EventStream
from loraplex.gateway.domains.responses import store
from loraplex.gateway.domains.responses.body import ResponsesBody
from loraplex.gateway.domains.responses.events import event_stream
from loraplex.gateway.domains.responses.output import OutputBuilder, response_object, usage_body
from loraplex.gateway.domains.responses.translate import (
    Translation,
    check_body,
    responses_param,
    translate,
)
from loraplex.gateway.errors import APIError, bad_request, not_found
from loraplex.gateway.transport.json_body import decode_object

ID_PREFIX = "resp_"
_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_JSON_ESCAPE = 6  # a byte of text is at most 6 bytes of JSON ("\u0000")
_UNKNOWN_TOKEN_BYTES = 64  # a token's most bytes, where the tokenizer does not say


def _documented(data: ResponsesBody) -> None:  # pragma: no cover - never called
    """Names the body's type for ``/docs`` (the handler parses the raw body itself)."""


@post(
    "/v1/responses",
    status_code=200,
    dependencies={"documented_body": Provide(_documented, sync_to_thread=False)},
)
async def create_response(request: Request, chat_deps: Injected[ChatDeps]) -> Response:
    """Answer one Responses API request, as a Response object or as stream events.

    Raises:
        APIError: as ``POST /v1/chat/completions``; 404 for a ``previous_response_id`` the
            tenant has not stored; 400 naming an unsupported field, item, tool or format.
    """
    principal: TenantPrincipal = request.user
    turn: dict[str, Translation] = {}

    async def parse(body: bytes, **limits: Any) -> ChatRequest:
        tr = await _translate(chat_deps, principal, body, limits["max_parts"])
        turn["tr"] = tr
        try:
            chat = parse_chat_request(_json(tr.chat), **limits)
        except APIError as exc:
            raise _renamed(exc, tr) from None
        if tr.store:
            _check_storable(chat_deps, tr, chat)
        return chat

    async def answer(
        deps: ChatDeps,
        run: ChatRun,
        chat: ChatRequest,
        response_id: str,
        writable: Callable[[], Any] | None,
    ) -> Response:
        tr = turn["tr"]
        parser = _tool_parsers(deps, chat)()
        if chat.stream:
            first = await _unless_client_left(run, run.next())
            saver = _saver(deps, principal, tr, response_id)
            events = event_stream(run, first, tr, response_id, parser, writable, saver)
            return EventStream(events, headers=HEADERS)
        return await _complete(deps, principal, run, tr, response_id, parser)

    return await _generate(request, chat_deps, ID_PREFIX, parse, answer)


@get("/v1/responses/{response_id:str}")
async def retrieve_response(
    request: Request, response_id: FromPath[str], chat_deps: Injected[ChatDeps]
) -> Response:
    """The calling tenant's stored response ``response_id``, as it was answered.

    Raises:
        APIError: 404 for an id the tenant has not stored (another tenant's included);
            400 for a query parameter (``stream``, ``include`` ...: not supported).
    """
    _no_query(request)
    principal: TenantPrincipal = request.user
    stored = None
    if _ID.fullmatch(response_id):
        stored = await store.load(chat_deps.sessions, principal.tenant_id, response_id)
    if stored is None:
        raise _unknown(response_id, "response_id")
    return Response(stored.body, media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(
    request: Request, response_id: FromPath[str], chat_deps: Injected[ChatDeps]
) -> dict[str, Any]:
    """Delete the calling tenant's stored response: ``{id, object: "response", deleted}``.

    Raises:
        APIError: 404 for an id the tenant has not stored (another tenant's included).
    """
    _no_query(request)
    principal: TenantPrincipal = request.user
    found = False
    if _ID.fullmatch(response_id):
        found = await store.remove(chat_deps.sessions, principal.tenant_id, response_id)
    if not found:
        raise _unknown(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def _json(value: Any) -> bytes:
    """``value`` as JSON bytes (the chat body the chat parser reads; sizes)."""
    return msgspec.json.encode(value)


async def _translate(
    deps: ChatDeps, principal: TenantPrincipal, raw: bytes, max_items: int
) -> Translation:
    """Check the body, load the previous response's conversation, translate (module doc)."""
    body = check_body(decode_object(raw), max_items)
    context: list[dict[str, Any]] = []
    previous = body.previous_response_id
    if previous is not None:
        stored = None
        if _ID.fullmatch(previous):
            stored = await store.load(deps.sessions, principal.tenant_id, previous)
        if stored is None:
            raise _unknown(previous, "previous_response_id")
        context = stored.context
    return translate(body, context, max_items)


def _unknown(response_id: str, param: str) -> APIError:
    return not_found(
        f"no stored response with id {response_id[:64]!r}", code="response_not_found", param=param
    )


def _renamed(exc: APIError, tr: Translation) -> APIError:
    """A chat check's error, naming the Responses field (``translate.responses_param``)."""
    param = responses_param(exc.param, tr.origins)
    message = exc.message
    if exc.param and param != exc.param:
        message = message.replace(exc.param, param)
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def _check_storable(deps: ChatDeps, tr: Translation, chat: ChatRequest) -> None:
    """Refuse, before it runs, a response that could outgrow ``store.MAX_STORED_BYTES``.

    Counted: the conversation and the echoed request fields as JSON, plus the most the output
    can add (twice: in the Response object and in the stored conversation).
    """
    skip = 1 if tr.body.instructions is not None else 0
    known = len(_json(tr.chat["messages"][skip:])) + len(_json(tr.body))
    max_tokens = chat.max_tokens or deps.config.max_tokens_limit
    per_token = (deps.engine.input_limits.max_token_bytes or _UNKNOWN_TOKEN_BYTES) * _JSON_ESCAPE
    bound = known + 2 * max_tokens * per_token
    if bound > store.MAX_STORED_BYTES:
        raise bad_request(
            f"this conversation could reach {bound} bytes once answered, and a stored response "
            f"is at most {store.MAX_STORED_BYTES}: send 'store': false (and the whole "
            "conversation in 'input'), or a shorter input or 'max_output_tokens'",
            param="store",
        )


def _saver(
    deps: ChatDeps, principal: TenantPrincipal, tr: Translation, response_id: str
) -> Callable[[dict[str, Any], OutputBuilder], Any]:
    """Stores a finished response (``store: true``; else does nothing)."""

    async def save(body: dict[str, Any], builder: OutputBuilder) -> None:
        if not tr.store:
            return
        skip = 1 if tr.body.instructions is not None else 0
        context = [*tr.chat["messages"][skip:], builder.message()]
        encoded, conversation = store.encode(body, context)
        await store.save(deps.sessions, principal.tenant_id, response_id, encoded, conversation)

    return save


async def _complete(
    deps: ChatDeps,
    principal: TenantPrincipal,
    run: ChatRun,
    tr: Translation,
    response_id: str,
    parser: Any,
) -> Response:
    """Wait for the whole answer, record and store it, and return the Response object."""
    created = int(time.time())
    out = await _unless_client_left(run, run.final())
    await run.durable()  # 503 if the row could not be made durable
    choice = out.outputs[0]
    builder = OutputBuilder(parser, events=False)
    builder.feed(choice.text, choice.finish_reason)
    incomplete = "max_output_tokens" if choice.finish_reason == "length" else None
    body = response_object(
        tr,
        response_id,
        created,
        "incomplete" if incomplete else "completed",
        builder.output,
        usage=usage_body(len(out.prompt_token_ids), choice.num_tokens, out.num_cached_tokens),
        incomplete=incomplete,
    )
    await _saver(deps, principal, tr, response_id)(body, builder)
    return Response(body, media_type="application/json")


def _no_query(request: Request) -> None:
    for name in request.query_params:
        raise bad_request(
            f"query parameter '{name[:40]}' is not supported on this route", param=name[:40]
        )
