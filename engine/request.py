"""Requests, the sequences the scheduler runs, and the outputs the engine returns.

A request with ``n > 1`` runs as one sequence until its prompt is computed; its first sampling
step forks it into ``n`` sequences that share every prompt block (copy on write of the partial
last block), each then decoding on its own.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.hashing.extra_keys import MMPlaceholder
from loraplex.hashing.request_hasher import RequestBlockHasher

if TYPE_CHECKING:
    from loraplex.engine.sampling.detokenizer import IncrementalDetokenizer
    from loraplex.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, processed.

    Attributes:
        key: The image key (``hashing.image_keys``), identity of its encoding and KV blocks.
        pixel_values: ``[3, H, W]`` float tensor from the model's image processor.
        placeholder: Where its placeholder tokens sit in the prompt.
    """

    key: str
    pixel_values: torch.Tensor
    placeholder: MMPlaceholder


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
            (``engine.fair_queue``); None for requests without one (one shared group).
        arrival_time: ``time.monotonic()`` at arrival.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    lora_digest: str | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed (recompute) or KV in the CPU pool (swap)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation stream: the unit the scheduler admits, runs, preempts and finishes.

    Attributes:
        seq_id: ``request_id`` for the first sequence, ``request_id#i`` for forks.
        request: The request it belongs to.
        index: Output index within the request (``0 .. n-1``).
        token_ids: Prompt + generated tokens.
        num_computed_tokens: Tokens whose KV is in the sequence's blocks.
        hasher: Block hashes of ``token_ids`` (full blocks), extended as tokens arrive.
        generator: The seeded generator of this sequence, None to use the engine's.
        detokenizer: Incremental detokenizer and stop checks of this sequence.
        num_cached_tokens: Prompt tokens served from the prefix cache at first admission.
        swapped: True while its KV lives in the CPU swap pool.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
        logprobs: Per generated token, ``(sampled logprob, [(token_id, logprob), ...])``.
        first_token_time: ``time.monotonic()`` when its first token was sampled.
        first_scheduled_time: ``time.monotonic()`` when the scheduler first admitted it from the
            waiting queue (a later re-admission after preemption does not move it).
    """

    seq_id: str
    request: EngineRequest
    index: int
    token_ids: list[int]
    hasher: RequestBlockHasher
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None
    swapped: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once finished (stop, length or abort)."""
        return self.status is SequenceStatus.FINISHED


@dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs.

    Attributes:
        index: Output index.
        text: Text generated so far (stop string removed unless asked to keep it).
        token_ids: Tokens generated so far.
        finish_reason: None while running, then ``"stop"``, ``"length"``, ``"abort"`` or
            ``"error"`` (a fault while running it; see ``RequestOutput.error``).
        logprobs: Per token ``(logprob, top alternatives)`` when asked.
        text_delta: Text added since the previous output of this sequence (streaming).
        token_ids_delta: Tokens added since the previous output (streaming).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A request's state after a step, as the engine returns it.

    Attributes:
        request_id: The request.
        prompt_token_ids: The prompt.
        outputs: One per sequence, by index.
        finished: True when every sequence finished.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        ttft: Seconds from arrival to the first token, once there is one.
        queue_time: Seconds from arrival to the scheduler's first admission of the request
            (vLLM's queued interval), once it was admitted.
        error: Set (with ``finished``) when a fault in this request's part of a step failed
            it; says where, never the internals (those go to the log).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    ttft: float | None = None
    queue_time: float | None = None
    error: str | None = None
