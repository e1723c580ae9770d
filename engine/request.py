"""Requests as the engine takes them, and the outputs its clients return.

The scheduler's sequences are ``engine.sequence``; what crosses the core's step is
``engine.scheduling.output``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from loraplex.engine.sampling.params import SamplingParams  # at run time: msgspec decodes it
from loraplex.hashing.extra_keys import MMPlaceholder
from loraplex.hashing.request_hasher import RequestBlockHasher


class RequestOutputKind(enum.Enum):
    """What each :class:`RequestOutput` of a request carries (vLLM's ``RequestOutputKind``).

    ``DELTA``: an output for every step with news, holding only what is new since the previous
    one (streaming); ``FINAL_ONLY``: one output when the request finishes, holding everything.
    """

    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, processed.

    Attributes:
        key: The image key (``hashing.image_keys``), identity of its encoding and KV blocks.
        pixel_values: From the model's image processor: ``[3, H, W]`` for the native LLaVA;
            for a transformers vision-language model, this image's own slice of the
            processor's ``pixel_values`` (``engine.client.image_inputs``).
        placeholder: Where its placeholder tokens sit in the prompt: the native LLaVA's run of
            ``num_image_tokens`` image tokens; for a transformers model, first to last of its
            image tokens, other tokens (row markers, breaks) between them included. Features
            go to the image tokens of the span, in order.
        inputs: Its other processor outputs by name (``image_sizes``, ``pixel_attention_mask``,
            ``image_grid_thw`` ...), for a transformers model; empty for the native LLaVA.
    """

    key: str
    pixel_values: torch.Tensor
    placeholder: MMPlaceholder
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class EngineRequest:
    """What the engine needs to run one request: tokens in, sampling params, extra keys.

    Attributes:
        request_id: Unique among in-flight requests.
        prompt_token_ids: The prompt, image placeholders expanded.
        sampling: Sampling parameters.
        images: The prompt's images in placeholder order.
        lora_digest: Digest of the LoRA adapter, None for the base model.
        cache_salt: Scopes prefix-cache and vision-cache reuse (the gateway sets the tenant).
        tenant: The fairness group the scheduler shares the engine between
            (``engine.scheduling.fair_queue``); None for requests without one (one shared group).
        arrival_time: ``time.monotonic()`` at arrival.
        output_kind: What its outputs carry (streaming: ``DELTA``).
        priority: Its scheduling class (``engine.scheduling.fair_queue``): ``PRIORITY_INTERACTIVE``
            (0) or ``PRIORITY_BATCH`` (1: ``/v1/batches`` lines), lower first. A batch sequence
            is admitted only while no interactive one waits, and is preempted first.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    lora_digest: str | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    priority: int = 0

    def block_hasher(self, block_size: int, algorithm: str = "sha256") -> RequestBlockHasher:
        """The request's block hashes, as the engine computes them (its prompt hashed).

        Whoever computes them with the engine's ``block_size`` and ``prefix_hash`` gets the
        hashes the engine's prefix cache uses: the engine itself at admission, and a router
        choosing the replica that holds the request's leading blocks (``engine.client.replicas``).

        Returns:
            A ``hashing.RequestBlockHasher`` over the prompt (``.block_hashes``: one per
            full block, with the adapter, the images and the cache salt in them).
        """
        hasher = RequestBlockHasher(
            block_size,
            algorithm=algorithm,
            lora_digest=self.lora_digest,
            cache_salt=self.cache_salt,
            placeholders=[im.placeholder for im in self.images],
        )
        hasher.extend(self.prompt_token_ids)
        return hasher


PRIORITY_INTERACTIVE = 0
"""The scheduling class of requests a client waits on (the default)."""
PRIORITY_BATCH = 1
"""The scheduling class of batch lines: only the capacity interactive requests leave."""


@dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs, as a :class:`RequestOutput` carries it.

    With ``RequestOutputKind.DELTA``, ``text``, ``token_ids`` and ``logprobs`` hold what is new
    since the previous output of this index; with ``FINAL_ONLY`` they hold everything.

    Attributes:
        index: Output index.
        text: Text (stop string removed unless asked to keep it).
        token_ids: Generated tokens (a final EOS / stop token included).
        finish_reason: None while running, then ``"stop"``, ``"length"``, ``"abort"`` or
            ``"error"`` (a fault while running it; see ``RequestOutput.error``).
        stop_reason: The stop token id or stop string that finished it, if any.
        logprobs: Per token ``(logprob, top alternatives)`` when asked.
        num_tokens: Tokens generated so far in all (whatever the kind).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    num_tokens: int = 0


@dataclass
class RequestOutput:
    """A request's news after a step, as the client side's output processor builds it.

    Attributes:
        request_id: The request.
        prompt_token_ids: The prompt (the request's own list, not a copy).
        outputs: ``DELTA``: the outputs with news this step, by index; ``FINAL_ONLY``: all.
        finished: True when every output finished (the request's last output).
        num_cached_tokens: Prompt tokens served from the prefix cache.
        ttft: Seconds from arrival to the first token, once there is one.
        queue_time: Seconds from arrival to the scheduler's first admission of the request
            (vLLM's queued interval), once it was admitted.
        error: Set (with ``finished``) when a fault in this request's part of a step failed
            it; says where, never the internals (those go to the log).
        prompt_logprobs: With ``sampling.prompt_logprobs``: one entry per prompt token, None
            for the first (nothing precedes it), then ``(logprob, rank, [(token_id, logprob),
            ...])`` (vLLM's ``RequestOutput.prompt_logprobs``); in the first output once the
            prompt is computed (``DELTA``) or in the final one (``FINAL_ONLY``). None when not
            asked, and in later ``DELTA`` outputs.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    ttft: float | None = None
    queue_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] | None = None

    def add(self, later: RequestOutput) -> None:
        """Add a later ``DELTA`` output of the same request to this one (vLLM's ``add``).

        Each choice's text, token ids and logprobs are appended (its lists are extended in
        place: a ``DELTA`` output's lists are its own); finish state, counts and timings are
        the later output's where it has them.
        """
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                mine = by_index[c.index] = CompletionOutput(c.index, "", [])
                mine.logprobs = [] if c.logprobs is not None else None
                self.outputs.append(mine)
            mine.text += c.text
            mine.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(c.logprobs)
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
            mine.num_tokens = c.num_tokens
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.ttft = self.ttft if self.ttft is not None else later.ttft
        self.queue_time = self.queue_time if self.queue_time is not None else later.queue_time
        self.error = later.error if later.error is not None else self.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
