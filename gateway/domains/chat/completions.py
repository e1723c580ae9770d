"""``POST /v1/completions`` bodies: OpenAI's (legacy) Completions, checked into a ChatRequest.

The prompt is one string (tokenized as it is, with BOS unless ``add_special_tokens`` is false)
or one list of token ids, or a batch: a list of strings or a list of token-id lists (OpenAI's
and vLLM's forms; a list of one is the same as the one prompt). Each prompt of a batch runs as
its own engine request in the continuous batch (``gateway.domains.chat.batch``); prompt ``i``'s
``j``-th sample is choice ``i * n + j``, as OpenAI and vLLM index them; usage is summed over
the prompts and the request is one usage row. Bounds: prompts x ``n`` at most ``max_n`` (the
bound on ``n``), each prompt non-empty and shorter than the model length, strings and token
lists not mixed (400s naming ``prompt``).
``max_tokens`` defaults to 16 (OpenAI's and vLLM's default for this endpoint). ``logprobs`` is
the number of alternatives per token (0 to 20), reported in the legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``). ``echo`` puts the prompt's text before
each choice's; with ``logprobs`` the prompt's tokens come first in the logprobs too (the first
with a null logprob), computed by the engine in the prefill (vLLM's and OpenAI's behaviour;
the engine's ``prompt_logprobs``). ``max_tokens: 0`` with ``echo`` (or ``prompt_logprobs``)
answers the prompt alone with ``finish_reason: "length"`` and no completion token, what
lm-evaluation-harness's loglikelihood requests ask. ``suffix`` is refused; ``best_of`` is
accepted only equal to ``n``. Every other field is shared with Chat Completions
(``gateway.domains.chat.body``), vLLM's ``prompt_logprobs`` included.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.sampling.params import MAX_LOGPROBS
from loraplex.gateway.domains.chat.body import CompletionBody, convert_body
from loraplex.gateway.domains.chat.schemas import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatRequest,
    check_token_ids,
    generation_fields,
    utf8_len,
)
from loraplex.gateway.errors import APIError, bad_request
from loraplex.gateway.transport.json_body import decode_object

DEFAULT_MAX_TOKENS = 16


def parse_completion_request(
    body: bytes,
    *,
    max_tokens_limit: int,
    max_n: int,
    max_parts: int = 1 << 20,
    vocab_size: int = 0,
) -> ChatRequest:
    """Parse and check a Completions body.

    Args:
        body: The raw JSON body.
        max_tokens_limit: Largest ``max_tokens`` a request may ask for.
        max_n: Largest number of choices: ``n`` times the number of prompts.
        max_parts: The model length: a token-id prompt must be shorter.
        vocab_size: Token ids (a token-id ``prompt``, ``stop_token_ids``, ``logit_bias``)
            must be below it (0: unknown, only below ``2**63``).

    Raises:
        APIError: 400 naming the field at fault (``prompt`` for a token id outside the
            vocabulary, however large).
    """
    data = decode_object(body)
    req: CompletionBody = convert_body(data, CompletionBody)
    n = 1 if req.n is None else req.n
    prompts = _prompts(req.prompt, n if 1 <= n <= max_n else 1, max_n, max_parts, vocab_size)
    if req.best_of is not None and req.best_of not in (1, n):
        raise bad_request(
            "'best_of' other than 'n' is not supported (every sampled completion is returned)",
            param="best_of",
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    common = generation_fields(
        req,
        data,
        ("max_tokens",),
        max_tokens_limit,
        max_n,
        vocab_size,
        allow_zero=bool(req.echo) or req.prompt_logprobs is not None,
        zero_fields="'echo' or 'prompt_logprobs'",
    )
    if common["max_tokens"] is None:
        common["max_tokens"] = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if req.echo and req.logprobs is not None:  # the prompt's part of the logprobs (vLLM's)
        asked = common["sampling"]["prompt_logprobs"]
        common["sampling"]["prompt_logprobs"] = max(req.logprobs, asked or 0)
    return ChatRequest(
        messages=[],
        prompt=prompts[0],
        prompts=prompts,
        echo=bool(req.echo),
        add_special_tokens=req.add_special_tokens is not False,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        text_bytes=sum(utf8_len(p) for p in prompts if isinstance(p, str)),
        prompt_param="prompt",
        **common,
    )


def _prompts(
    value: Any, n: int, max_n: int, max_len: int, vocab_size: int
) -> list[str | list[int]]:
    """The prompts ``value`` holds: one, or a batch (a list of strings or of token-id lists).

    The number of prompts is checked first, so a list of a million prompts costs nothing more.

    Args:
        value: The ``prompt`` field as decoded (a string or a list).
        n: Choices per prompt.
        max_n: Most choices per request (prompts x ``n``).
        max_len: The model length: each token-id prompt must be shorter.
        vocab_size: Each token id must be below it (0: unknown).

    Returns:
        Each prompt, text or token ids, in order (at least one).

    Raises:
        APIError: 400 naming ``prompt``: empty (the list or one of its prompts), strings and
            token lists mixed, more than ``max_n // n`` prompts, a token-id prompt too long or
            holding an id outside ``[0, vocab_size)``.
    """
    if isinstance(value, str) or not value or not isinstance(value[0], str | list):
        return [_prompt(value, max_len, vocab_size)]  # one prompt: text or token ids
    kind = type(value[0])
    if not all(type(p) is kind for p in value):
        raise bad_request(
            "'prompt' must be a string, a list of token ids, a list of strings or a list of "
            "token-id lists; this list mixes kinds",
            param="prompt",
        )
    if len(value) * n > max_n:
        raise bad_request(
            f"'prompt' holds {len(value)} prompts and 'n' is {n}: at most {max_n} choices "
            f"(prompts x n) per request",
            param="prompt",
        )
    prompts = []
    for i, one in enumerate(value):
        try:
            prompts.append(_prompt(one, max_len, vocab_size))
        except APIError as exc:  # say which prompt of several
            if len(value) == 1:
                raise
            raise bad_request(f"prompt {i}: {exc.message}", param="prompt", code=exc.code) from None
    return prompts


def _prompt(value: Any, max_len: int, vocab_size: int) -> str | list[int]:
    """The one prompt ``value`` holds: text, or token ids shorter than the model length.

    Raises:
        APIError: 400 naming ``prompt``: empty, not a string or token ids, too long, or a
            token id outside ``[0, vocab_size)`` (:func:`check_token_ids`).
    """
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return value
    if not value:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if len(value) >= max_len:
            raise bad_request(
                f"the prompt is {len(value)} tokens; this model allows at most {max_len - 1}",
                param="prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        check_token_ids(value, vocab_size, "prompt")
        return list(value)
    raise bad_request(
        "'prompt' must be a string, a list of token ids, a list of strings or a list of "
        "token-id lists",
        param="prompt",
    )
