"""``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes) and ``GET /version``.

``/tokenize`` takes vLLM's two forms: ``{"model", "prompt", "add_special_tokens"}`` (the text as
it is, BOS included unless ``add_special_tokens`` is false) or ``{"model", "messages", ...}``,
which gives exactly the prompt ``/v1/chat/completions`` would feed the engine for the same
messages and tools (the model's chat template, image placeholders expanded). ``model`` is the
base model or one of the caller's adapters, resolved as chat resolves it (404 otherwise).
Answer: ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``). ``/detokenize`` takes ``{"model", "tokens"}`` and answers
``{"prompt"}``; an id outside the vocabulary is a 400 naming ``tokens``.

Both need a tenant key, pass the key's rate limits, and write one usage row each (the request
counted, 0 prompt and 0 completion tokens: nothing was generated); tokenizing runs on the
tenants' shared input workers, never on the event loop. ``/version`` needs no key.
"""

from __future__ import annotations

import uuid
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Literal

import msgspec
from litestar import Request, Response, get, post
from litestar.di import Provide

from loraplex.engine.client.fair_pool import PoolBusyError
from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.chat.body import convert_body
from loraplex.gateway.domains.chat.schemas import CONTEXT_LENGTH_EXCEEDED, check_messages, utf8_len
from loraplex.gateway.domains.chat.service import (
    ChatDeps,
    admit_rate,
    resolve_model,
)
from loraplex.gateway.domains.chat.tools import check_tool_messages
from loraplex.gateway.errors import APIError, bad_request, pool_busy
from loraplex.gateway.transport.json_body import decode_object
from loraplex.gateway.usage.ledger import UsageLedger


class TokenizePromptBody(msgspec.Struct, forbid_unknown_fields=True):
    """``/tokenize`` with a text prompt."""

    model: str
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(msgspec.Struct, forbid_unknown_fields=True):
    """``/tokenize`` with chat messages (the chat template applies, as in chat)."""

    model: str
    messages: list[dict[str, Any]]
    add_generation_prompt: Literal[True] = True  # chat always adds it
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``/detokenize``."""

    model: str
    tokens: list[int]


def _documented_tokenize(data: TokenizePromptBody | TokenizeChatBody) -> None:  # pragma: no cover
    """Names the body's types for ``/docs`` (the handler parses the raw body itself)."""


def _documented_detokenize(data: DetokenizeBody) -> None:  # pragma: no cover
    """Names the body's type for ``/docs``."""


@post(
    "/tokenize",
    status_code=200,
    dependencies={
        "documented_body": Provide(_documented_tokenize, sync_to_thread=False),
    },
)
async def tokenize(request: Request, chat_deps: Injected[ChatDeps]) -> Response:
    """Token ids of a prompt or of chat messages (see the module doc).

    Raises:
        APIError: 400 naming the field, 404 unknown model, 429 rate limited, 503 engine down.
    """
    return await _metered(request, chat_deps, _tokenize)


@post(
    "/detokenize",
    status_code=200,
    dependencies={
        "documented_body": Provide(_documented_detokenize, sync_to_thread=False),
    },
)
async def detokenize(request: Request, chat_deps: Injected[ChatDeps]) -> Response:
    """The text of token ids (see the module doc).

    Raises:
        APIError: 400 naming the field, 404 unknown model, 429 rate limited, 503 engine down.
    """
    return await _metered(request, chat_deps, _detokenize)


@get("/version", exclude_from_auth=True, sync_to_thread=False)
def version() -> dict[str, str]:
    """``{"version": ...}``: the installed loraplex's version."""
    try:
        return {"version": package_version("loraplex")}
    except PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "0+unknown"}


async def _metered(request: Request, deps: ChatDeps, handle: Any) -> Response:
    """Rate limit, run ``handle(deps, principal, data, ledger)``, write the usage row."""
    principal: TenantPrincipal = request.user
    if not deps.engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_unavailable")
    deps.usage.admit()
    body = await request.body()
    ticket = await admit_rate(deps, principal)
    ledger = UsageLedger(deps, principal, ticket, f"tok-{uuid.uuid4().hex}")
    try:
        data = decode_object(body)
        answer = await handle(deps, principal, data, ledger)
    except BaseException as exc:
        error_type = exc.code or "invalid_request_error" if isinstance(exc, APIError) else None
        ledger.close("error", error_type or "internal_error")
        await ledger.wait_durable(strict=False)
        raise
    ledger.close("ok")
    await ledger.wait_durable()
    return Response(answer, media_type="application/json")


async def _tokenize(
    deps: ChatDeps, principal: TenantPrincipal, data: dict, ledger: UsageLedger
) -> dict[str, Any]:
    engine = deps.engine
    kind = TokenizeChatBody if "messages" in data else TokenizePromptBody
    req = convert_body(data, kind)
    ledger.model = req.model
    ledger.adapter_digest = await resolve_model(deps, principal.tenant_id, req.model)
    limits = engine.input_limits
    tenant = principal.tenant_id
    try:
        if isinstance(req, TokenizeChatBody):
            if not req.messages:
                raise bad_request("'messages' must be a non-empty array", param="messages")
            images, text_bytes = check_messages(req.messages, max_parts=engine.max_model_len)
            text_bytes += check_tool_messages(req.messages)  # the same 400s as chat's
            _check_size(text_bytes, images, "messages", engine.max_model_len, limits)
            try:
                ids = (await engine.process(req.messages, tenant=tenant)).prompt_token_ids
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
        else:
            _check_size(utf8_len(req.prompt), 0, "prompt", engine.max_model_len, limits)
            ids = await engine.tokenize(
                req.prompt, add_special_tokens=req.add_special_tokens, tenant=tenant
            )
    except PoolBusyError:
        raise pool_busy() from None
    strs = None
    if req.return_token_strs:
        strs = [b.decode("utf-8", errors="replace") for b in engine.token_bytes(list(ids))]
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": list(ids),
        "token_strs": strs,
    }


async def _detokenize(
    deps: ChatDeps, principal: TenantPrincipal, data: dict, ledger: UsageLedger
) -> dict[str, Any]:
    engine = deps.engine
    req = convert_body(data, DetokenizeBody)
    ledger.model = req.model
    ledger.adapter_digest = await resolve_model(deps, principal.tenant_id, req.model)
    if len(req.tokens) > engine.max_model_len:
        raise bad_request(
            f"'tokens' holds {len(req.tokens)} ids; at most {engine.max_model_len}",
            param="tokens",
        )
    try:
        text = await engine.detokenize(req.tokens, tenant=principal.tenant_id)
    except ValueError as exc:
        raise bad_request(str(exc), param="tokens") from None
    except PoolBusyError:
        raise pool_busy() from None
    return {"prompt": text}


def _check_size(text_bytes: int, images: int, param: str, max_model_len: int, limits) -> None:
    """Refuse, before tokenizing, text that cannot be fewer than ``max_model_len`` tokens."""
    if limits.max_token_bytes <= 0:
        return
    floor = -(-text_bytes // limits.max_token_bytes) + images * limits.image_tokens
    if floor > max_model_len:
        raise bad_request(
            f"the input is at least {floor} tokens; this model takes at most {max_model_len}",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
