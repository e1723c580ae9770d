"""``POST /v1/chat/completions`` bodies: parsed and checked into a :class:`ChatRequest`.

Everything the gateway can refuse without the engine is refused here, with a 400 that names the
field (OpenAI's ``param``): malformed JSON (syntax, invalid UTF-8, nesting too deep), a missing
or empty ``messages``, wrong types, an ``image_url`` that is not a ``data:`` URL (nothing is
ever fetched), out-of-range values, ``max_tokens`` over the server's limit, ``n`` over
``max_n``, a ``response_format`` (or vLLM ``guided_*`` field) of the wrong shape
(``gateway.domains.chat.response_format``). The body's type is
:class:`~gateway.domains.chat.body.ChatCompletionBody`: an unknown field, or one that would
change the output in a way this server cannot honour, is a 400 naming it; an explicit ``null``
means "not given". A client ``cache_salt`` (1 to 256 characters) only splits the tenant's
own prefix cache: :meth:`ChatRequest.engine_cache_salt` puts the tenant's id first.

Numeric fields and their ranges (a value outside gets a 400 naming the field; JSON has no NaN,
and a number out of float range such as ``1e999`` is malformed JSON)::

    max_completion_tokens / max_tokens   integer, 1 .. --max-tokens-limit (and the model length);
                                         0 (the prefill alone) only with prompt_logprobs, or
                                         Completions' echo
    prompt_logprobs                      integer, 0 .. 20 (vLLM's; not with stream)
    n                                    integer, 1 .. max_n (8)
    temperature                          number, 0 .. 100 (0: greedy)
    top_p                                number, (0, 1]
    top_k                                integer, -1 .. 2**31 - 1 (-1 or 0: off)
    seed                                 integer, -2**63 .. 2**64 - 1
    top_logprobs                         integer, 0 .. 20 (needs logprobs: true)
    stop                                 string or at most 16 strings of 1 .. 1024 characters
    presence_penalty / frequency_penalty number, -2 .. 2
    repetition_penalty                   number, (0, 100] (vLLM's; 1: off)
    logit_bias                           at most 300 token ids -> number, -100 .. 100
    min_p                                number, 0 .. 1
    min_tokens                           integer, 0 .. max_tokens
    stop_token_ids                       at most 64 token ids

Every token id (``stop_token_ids``, ``logit_bias`` keys, a Completions token-id prompt) is in
``[0, vocab_size)`` (:func:`check_token_ids`), whatever its size, before anything is encoded
for the engine core. Messages follow OpenAI's rules (:func:`check_message_fields`: the role,
``content`` required but on an assistant message with ``tool_calls``) and their tool calls
carry JSON-object ``arguments`` (``gateway.domains.chat.tools.check_tool_messages``).

Cheap bounds run before any expensive step: at most ``max_model_len`` messages and content
parts (a chat template spends at least one token on each), and :meth:`ChatRequest.check_size`
refuses a prompt whose text is too long for the model before it is tokenized (each token stands
for at most ``max_token_bytes`` bytes of text, so the byte count bounds the token count from
below).

The prompt's exact length is known only after the chat template runs, so ``max_tokens`` against
the model length is checked later by :meth:`ChatRequest.sampling_params`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from loraplex.engine.sampling.params import MAX_LOGPROBS, SamplingParams
from loraplex.gateway.domains.chat.body import (
    ChatCompletionBody,
    GenerationFields,
    StreamOptions,
    convert_body,
)
from loraplex.gateway.domains.chat.response_format import parse_structured_output
from loraplex.gateway.domains.chat.service_tier import service_tier_of
from loraplex.gateway.domains.chat.tools import ToolRequest, check_tool_messages, parse_tools
from loraplex.gateway.errors import APIError, bad_request
from loraplex.gateway.transport.json_body import decode_object

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_CACHE_SALT_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, less the deprecated one
TOKEN_ID_LIMIT = 2**63  # token ids cross to the engine core as int64 (msgpack) at most


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat request.

    Attributes:
        model: The ``model`` field as sent (the base model's name or an adapter's).
        messages: OpenAI chat messages (structure checked, images not yet decoded).
        max_tokens: ``max_completion_tokens`` or ``max_tokens``; None: as many as fit.
        max_tokens_param: Which of the two fields set it (for error messages).
        stream: Answer with server-sent events.
        include_usage: ``stream_options.include_usage``: a last chunk with the usage.
        continuous_usage: ``stream_options.continuous_usage_stats`` (vLLM's): every chunk
            carries the usage so far.
        logprobs: Return each token's logprob.
        top_logprobs: Alternatives per token (0..20) when ``logprobs``.
        sampling: ``SamplingParams`` fields other than ``max_tokens`` and ``logprobs``.
        images: ``image_url`` parts in the messages.
        text_bytes: UTF-8 bytes of every string a chat template may render (contents, text
            parts, roles and other string fields of the messages).
        structured_param: The field that asked for structured output (``response_format``,
            ``guided_json`` ...), named by a 400 when the engine cannot enforce it; "" if none.
        cache_salt: The client's ``cache_salt`` (vLLM's), None if not given.
        tools: The tools offered and ``tool_choice`` (``gateway.domains.chat.tools``), None
            without tools.
        prompt: ``POST /v1/completions``: the prompt, as text or token ids (None for chat);
            the first of ``prompts``.
        prompts: Completions: every prompt of the request, in order; more than one is a batch
            (``gateway.domains.chat.batch``). Empty for chat.
        echo: Completions' ``echo``: the prompt's text goes before the completion's.
        add_special_tokens: Completions: tokenize a text prompt with BOS and the like.
        prompt_param: The field a prompt-length error names (``messages`` or ``prompt``).
        prompt_logprobs: vLLM's ``prompt_logprobs`` as asked (alternatives per position), for
            the response's ``prompt_logprobs``; None when not asked. (What the engine computes,
            with Completions' ``echo`` and ``logprobs`` too, is ``sampling["prompt_logprobs"]``.)
        service_tier: The tier that serves it, ``default`` or ``flex``
            (``gateway.domains.chat.service_tier``): the engine priority class and the
            response's ``service_tier``.
    """

    model: str
    messages: list[Any]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    images: int = 0
    text_bytes: int = 0
    structured_param: str = ""
    cache_salt: str | None = None
    tools: ToolRequest | None = None
    prompt: str | list[int] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    add_special_tokens: bool = True
    prompt_param: str = "messages"
    prompt_logprobs: int | None = None
    service_tier: str = "default"

    def engine_cache_salt(self, tenant_id: str) -> str:
        """The engine request's cache salt: the tenant's id, then the client's ``cache_salt``.

        JSON-encoded as a pair when the client sent one, so no (tenant, salt) pair can spell
        another's; a request without one keeps the bare tenant id (its blocks are shared by
        the tenant's other requests without a salt).
        """
        if self.cache_salt is None:
            return tenant_id
        return json.dumps([tenant_id, self.cache_salt])

    def check_size(self, max_model_len: int, max_token_bytes: int, image_tokens: int) -> None:
        """Refuse, before tokenizing, a prompt that cannot fit ``max_model_len`` tokens.

        Args:
            max_model_len: The model length.
            max_token_bytes: The most bytes of text one token can stand for (0: unknown, no
                check).
            image_tokens: Placeholder tokens per image.

        Raises:
            APIError: 400 ``context_length_exceeded`` when even the fewest tokens the text and
                images can become exceed ``max_model_len - 1``.
        """
        if max_token_bytes <= 0:
            return
        floor = -(-self.text_bytes // max_token_bytes) + self.images * image_tokens
        if floor >= max_model_len:
            raise bad_request(
                f"the messages hold {self.text_bytes} bytes of text and {self.images} image(s): "
                f"at least {floor} tokens, and this model allows at most {max_model_len - 1} "
                f"prompt tokens (max_model_len {max_model_len})",
                param=self.prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def sampling_params(self, prompt_tokens: int, max_model_len: int, limit: int) -> SamplingParams:
        """The engine's sampling parameters for a prompt of ``prompt_tokens`` tokens.

        Without ``max_tokens``, as many tokens as the model length leaves (at most ``limit``).

        Raises:
            APIError: 400 ``context_length_exceeded`` when the prompt leaves no room, or when
                prompt plus ``max_tokens`` exceeds ``max_model_len``.
        """
        room = max_model_len - prompt_tokens
        if room < 1:
            raise bad_request(
                f"the prompt is {prompt_tokens} tokens; this model allows at most "
                f"{max_model_len - 1} prompt tokens (max_model_len {max_model_len})",
                param=self.prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else min(limit, room)
        if max_tokens > room:
            raise bad_request(
                f"the prompt is {prompt_tokens} tokens and {self.max_tokens_param} is "
                f"{max_tokens}: together they exceed this model's max_model_len of "
                f"{max_model_len}; ask for at most {room} tokens",
                param=self.max_tokens_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return _sampling(
            max_tokens=max_tokens,
            logprobs=self.top_logprobs if self.logprobs else None,
            **self.sampling,
        )


def parse_chat_request(
    body: bytes,
    *,
    max_tokens_limit: int,
    max_n: int,
    max_parts: int = 1 << 20,
    vocab_size: int = 0,
) -> ChatRequest:
    """Parse and check a request body.

    Args:
        body: The raw JSON body.
        max_tokens_limit: Largest ``max_tokens`` a request may ask for.
        max_n: Largest ``n``.
        max_parts: Most messages, and most content parts in all, a request may hold (the
            model length: a chat template spends at least one token on each).
        vocab_size: Token ids (``stop_token_ids``, ``logit_bias``) must be below it (0:
            unknown, only below :data:`TOKEN_ID_LIMIT`).

    Returns:
        The checked request.

    Raises:
        APIError: 400 naming the field at fault.
    """
    data = decode_object(body)
    req: ChatCompletionBody = convert_body(data, ChatCompletionBody)
    messages = req.messages
    if not messages:
        raise bad_request("'messages' is required and must be a non-empty array", param="messages")
    if len(messages) > max_parts:
        raise bad_request(
            f"'messages' holds {len(messages)} messages; at most {max_parts} fit this model",
            param="messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    images, text_bytes = check_messages(messages, max_parts=max_parts)
    text_bytes += check_tool_messages(messages)
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise bad_request(
            "'modalities' may only hold 'text': this server generates text", param="modalities"
        )

    logprobs = bool(req.logprobs)
    top_logprobs = req.top_logprobs
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}", param="top_logprobs"
        )
    common = generation_fields(
        req,
        data,
        ("max_completion_tokens", "max_tokens"),
        max_tokens_limit,
        max_n,
        vocab_size,
        allow_zero=req.prompt_logprobs is not None,
    )
    tools = parse_tools(req, common["sampling"].get("structured_output") is not None)
    if tools is not None:
        text_bytes += len(msgspec.json.encode(tools.tools))  # the template renders them
        try:
            forced = tools.structured_output()
            if forced is not None:
                forced.check_bounds()  # the tools' schemas' shape (engine.structured_output.bounds)
        except ValueError as exc:
            raise bad_request(str(exc), param="tools") from None
        if forced is not None:
            common["sampling"]["structured_output"] = forced
            common["structured_param"] = "tools"
    return ChatRequest(
        messages=messages,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        images=images,
        text_bytes=text_bytes,
        tools=tools,
        **common,
    )


def generation_fields(
    req: GenerationFields,
    data: dict[str, Any],
    max_tokens_names: tuple[str, ...],
    max_tokens_limit: int,
    max_n: int,
    vocab_size: int = 0,
    *,
    allow_zero: bool = False,
    zero_fields: str = "'prompt_logprobs'",
) -> dict[str, Any]:
    """The :class:`ChatRequest` fields both Chat Completions and Completions bodies set.

    Args:
        req: The typed body.
        data: The decoded body (``response_format`` and ``guided_*`` are read from it).
        max_tokens_names: The fields that may set ``max_tokens``, the preferred one first.
        max_tokens_limit: Largest ``max_tokens`` a request may ask for.
        max_n: Largest ``n``.
        vocab_size: Token ids (``stop_token_ids``, ``logit_bias``) must be below it (0:
            unknown, only below :data:`TOKEN_ID_LIMIT`).
        allow_zero: ``max_tokens: 0`` (the prefill alone: only the prompt and its logprobs
            are wanted) is allowed: vLLM allows it with ``prompt_logprobs`` and with
            Completions' ``echo``.
        zero_fields: The fields that allow 0, named by the error when it is not allowed.

    Raises:
        APIError: 400 naming the field at fault.
    """
    if not req.model:
        raise bad_request("'model' is required and must be a non-empty string", param="model")
    max_tokens, max_tokens_param = None, max_tokens_names[-1]
    for name in max_tokens_names:  # the newer name wins
        value = getattr(req, name)
        if value is not None:
            max_tokens, max_tokens_param = value, name
            break
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"'prompt_logprobs' must be between 0 and {MAX_LOGPROBS}", param="prompt_logprobs"
            )
        if req.stream:  # vLLM's rule: they come in the whole response only
            raise bad_request(
                "'prompt_logprobs' is not available with 'stream': true", param="prompt_logprobs"
            )
    if max_tokens is not None:
        if max_tokens < 1 and not (max_tokens == 0 and allow_zero):
            raise bad_request(
                f"'{max_tokens_param}' must be at least 1 (0, the prompt alone, only with "
                f"{zero_fields})",
                param=max_tokens_param,
            )
        if max_tokens > max_tokens_limit:
            raise bad_request(
                f"'{max_tokens_param}' is {max_tokens}; this server allows at most "
                f"{max_tokens_limit}",
                param=max_tokens_param,
            )
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise bad_request(f"'n' must be between 1 and {max_n}, got {n}", param="n")
    stream = bool(req.stream)
    options = req.stream_options or StreamOptions()
    if req.stream_options is not None and not stream:
        raise bad_request("'stream_options' needs 'stream': true", param="stream_options")
    if req.cache_salt is not None and not 1 <= len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be 1 to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt"
        )
    sampling = {
        "n": n,
        "temperature": _or(req.temperature, 1.0),
        "top_p": _or(req.top_p, 1.0),
        "top_k": _or(req.top_k, 0),
        "min_p": _or(req.min_p, 0.0),
        "seed": req.seed,
        "stop": req.stop,
        "presence_penalty": _or(req.presence_penalty, 0.0),
        "frequency_penalty": _or(req.frequency_penalty, 0.0),
        "repetition_penalty": _or(req.repetition_penalty, 1.0),
        "logit_bias": req.logit_bias or None,
        "min_tokens": _or(req.min_tokens, 0),
        "ignore_eos": bool(req.ignore_eos),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "skip_special_tokens": _or(req.skip_special_tokens, True),
        "prompt_logprobs": prompt_logprobs,
    }
    # range checks now, not after processing (min_tokens is checked against max_tokens later)
    checked = _sampling(max_tokens=max(1, sampling["min_tokens"]), logprobs=None, **sampling)
    check_token_ids(checked.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(checked.logit_bias or (), vocab_size, "logit_bias")
    structured, structured_param = parse_structured_output(data)
    if structured is not None:
        sampling["structured_output"] = structured
    return {
        "model": req.model,
        "max_tokens": max_tokens,
        "max_tokens_param": max_tokens_param,
        "stream": stream,
        "include_usage": stream and bool(options.include_usage),
        "continuous_usage": stream and bool(options.continuous_usage_stats),
        "sampling": sampling,
        "structured_param": structured_param,
        "cache_salt": req.cache_salt,
        "prompt_logprobs": prompt_logprobs,
        "service_tier": service_tier_of(req.service_tier),
    }


def _or(value: Any, default: Any) -> Any:
    """``value``, or ``default`` when the field was not given (absent or null)."""
    return default if value is None else value


def check_messages(messages: list[Any], *, max_parts: int = 1 << 20) -> tuple[int, int]:
    """Check the messages' structure and image URLs; the engine decodes the images later.

    Args:
        messages: The ``messages`` array.
        max_parts: Most content parts in all messages.

    Returns:
        The number of ``image_url`` parts, and the UTF-8 bytes of every string a chat
        template may render (``ChatRequest.text_bytes``).

    Raises:
        APIError: 400 naming the message or part at fault (``messages[0].content[1]...``).
    """
    images = 0
    text_bytes = 0
    parts = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a string 'role'", param=where)
        check_message_fields(message, where)
        text_bytes += sum(utf8_len(v) for v in message.values() if isinstance(v, str))
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or an array of parts", param=f"{where}.content"
            )
        parts += len(content)
        if parts > max_parts:
            raise bad_request(
                f"the messages hold more than {max_parts} content parts; at most {max_parts} "
                "fit this model",
                param=f"{where}.content",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"{at}.text must be a string", param=f"{at}.text")
                text_bytes += utf8_len(part["text"])
            elif kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                detail = spec.get("detail") if isinstance(spec, dict) else None
                if detail not in (None, "auto"):  # OpenAI's resolution choice: ours is fixed
                    raise bad_request(
                        f"{at}.image_url.detail must be 'auto': this model sees every image at "
                        "its vision encoder's one resolution",
                        param=f"{at}.image_url.detail",
                    )
                if not isinstance(url, str):
                    raise bad_request(
                        f"{at}.image_url.url must be a string", param=f"{at}.image_url"
                    )
                if not url.startswith("data:"):
                    scheme = url.partition(":")[0] if ":" in url else "no scheme"
                    raise bad_request(
                        f"{at}.image_url.url must be a data: URL "
                        f"(data:image/png|jpeg|webp;base64,...), not {scheme[:16]!r}: this "
                        "server never fetches remote images",
                        param=f"{at}.image_url.url",
                        code="invalid_image_url",
                    )
                images += 1
            else:
                raise bad_request(
                    f"{at} must be a part of type 'text' or 'image_url'", param=f"{at}.type"
                )
    return images, text_bytes


def check_message_fields(message: dict[str, Any], where: str) -> None:
    """Check one message's ``role``, whether it may omit ``content``, and its string fields.

    OpenAI's rules: ``role`` is one of :data:`ROLES`; ``content`` may be null or absent only on
    an assistant message that carries ``tool_calls``; ``name`` and (on a ``tool`` message, where
    it is required) ``tool_call_id`` are strings. The legacy ``role: "function"`` and an
    assistant's ``function_call`` belong to the deprecated ``functions`` API, which this server
    refuses (use ``tools``, ``tool_calls`` and ``role: "tool"``).

    Args:
        message: One element of ``messages`` (a dict with a string ``role``).
        where: Its path, ``messages[i]``.

    Raises:
        APIError: 400 naming the field at fault (``messages[i].role``, ``.content``, ...).
    """
    role = message["role"]
    if role not in ROLES:
        if role == "function":
            raise bad_request(
                f"{where}.role 'function' belongs to the deprecated 'functions' API, which this "
                "server does not support: use 'tools' and role 'tool'",
                param=f"{where}.role",
            )
        raise bad_request(
            f"{where}.role must be one of {', '.join(repr(r) for r in ROLES)}, not {role[:32]!r}",
            param=f"{where}.role",
        )
    if message.get("function_call") is not None:
        raise bad_request(
            f"{where}.function_call is deprecated and not supported: use 'tool_calls'",
            param=f"{where}.function_call",
        )
    if message.get("content") is None and not (role == "assistant" and message.get("tool_calls")):
        which = f"a '{role}' message"
        if role == "assistant":
            which = "an assistant message without 'tool_calls'"
        raise bad_request(
            f"{where}.content is required (a string or an array of parts) on {which}",
            param=f"{where}.content",
        )
    for name in ("name", "tool_call_id"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{where}.{name} must be a string", param=f"{where}.{name}")
    if role == "tool" and message.get("tool_call_id") is None:
        raise bad_request(
            f"{where}.tool_call_id is required on a 'tool' message: the id of the call it answers",
            param=f"{where}.tool_call_id",
        )


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Refuse token ids outside the vocabulary before anything is sent to the engine.

    Args:
        ids: Integer token ids (any size: JSON numbers arrive as Python ints).
        vocab_size: Ids must be in ``[0, vocab_size)``; 0 (unknown) means
            ``[0, TOKEN_ID_LIMIT)``, what an engine core can receive (int64).
        param: The field named by the error (``prompt``, ``stop_token_ids``, ``logit_bias``).

    Raises:
        APIError: 400 naming ``param`` for the first id out of range (negative, at or past the
            vocabulary, 2**63, 2**64 or a number of thousands of digits alike).
    """
    limit = vocab_size if 0 < vocab_size <= TOKEN_ID_LIMIT else TOKEN_ID_LIMIT
    for k, t in enumerate(ids):
        if not 0 <= t < limit:
            shown = str(t) if t.bit_length() <= 128 else f"of {t.bit_length()} bits"
            what = "this model's vocabulary" if limit == vocab_size else "int64"
            raise bad_request(
                f"'{param}' holds a token id {shown} (item {k}): token ids must be in "
                f"[0, {limit}) ({what})",
                param=param,
            )


def utf8_len(text: str) -> int:
    """UTF-8 length of ``text`` without encoding it (ASCII is the common, fast case)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _sampling(**fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``, its ``ValueError`` as a 400 naming the field."""
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        raise APIError(400, message, param=name if name in fields else None) from None
