"""``LLM``: offline batch inference through the engine (one continuous batch)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from loraplex.engine.client.llm_engine import LLMEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest, RequestOutput, RequestOutputKind
from loraplex.engine.sampling.params import SamplingParams


class LLM:
    """Runs batches of requests to completion.

    Args:
        config: The engine configuration (frozen); its ``model`` may be a directory, a Hub id
            or a ``.gguf`` file, resolved once to a directory (``engine.models.source``).

    Raises:
        ValueError: what ``LLMEngine`` raises (``ModelSourceError``: a model that cannot be
            fetched or loaded, in one line).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        """The engine's effective configuration (pool size and max length resolved)."""
        return self.engine.config

    def make_request(
        self,
        messages: Any,
        sampling: SamplingParams,
        *,
        lora_digest: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> EngineRequest:
        """Process chat messages into an :class:`EngineRequest`.

        Raises:
            ValueError: bad messages or images (``InvalidImageError`` is a ValueError).
        """
        prompt = self.engine.inputs(messages)
        return EngineRequest(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=prompt.prompt_token_ids,
            sampling=sampling,
            images=prompt.images,
            lora_digest=lora_digest,
            cache_salt=cache_salt,
        )

    def generate(self, requests: Seq[EngineRequest]) -> list[RequestOutput]:
        """Run requests in one continuous batch until all finish.

        Returns:
            The final output of each request, in input order.

        Raises:
            ValueError: a request is invalid (nothing of the batch is run then), or its
                structured-output spec is refused (``StructuredOutputError``; the batch is
                aborted then).
        """
        final_only = RequestOutputKind.FINAL_ONLY
        for i, req in enumerate(requests):
            try:
                self.engine.add_request(dataclasses.replace(req, output_kind=final_only))
            except ValueError:
                for done in requests[:i]:
                    self.engine.abort_request(done.request_id)
                raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
            rejected = self.engine.take_rejected()
            if rejected:  # a grammar refused after admission: the batch fails as it would have
                for req in requests:
                    self.engine.abort_request(req.request_id)
                raise rejected[0][1]
        return [final[r.request_id] for r in requests]

    def shutdown(self) -> None:
        """Stop the engine's helper processes (the grammar sandbox); the engine is unusable."""
        self.engine.shutdown()

    def chat(
        self, conversations: Seq[Any], sampling: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Process and run chat conversations (one list of messages each)."""
        params = (
            [sampling] * len(conversations) if isinstance(sampling, SamplingParams) else sampling
        )
        reqs = [self.make_request(m, p) for m, p in zip(conversations, params, strict=True)]
        return self.generate(reqs)
