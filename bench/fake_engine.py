"""An instant engine behind the real gateway: what ``bench.gateway`` and gateway tests put there.

:class:`InstantEngine` implements :class:`gateway.server.engine_client.EngineClient` with no
model: ``process`` turns the messages' text into one prompt token per 4 characters (at least
one), and ``generate`` yields one :class:`RequestOutput` per completion token at once (the
streaming shape a real engine produces step by step), so whatever time a request takes through
the gateway is the gateway's own. Tests that need a request to stay in flight pass a ``gate``:
generation then pauses after the first token until the gate is set.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from loraplex.adapters.base_model import LinearTarget, ModelTargets
from loraplex.adapters.limits import AdapterLimits
from loraplex.engine.client.inputs import ProcessedPrompt
from loraplex.engine.request import (
    CompletionOutput,
    EngineRequest,
    RequestOutput,
    RequestOutputKind,
)
from loraplex.gateway.server.engine_client import InputLimits

CHARS_PER_TOKEN = 4
TOKEN_ID = 42
TOKEN_TEXT = "ok "


def message_text_length(messages: Any) -> int:
    """Characters of text in OpenAI-style chat messages (string content and text parts).

    Raises:
        ValueError: ``messages`` is not a list of objects with string or list ``content``.
    """
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
            )
        else:
            raise ValueError("each message needs string or list content")
    return total


class InstantEngine:
    """An :class:`EngineClient` that answers at once.

    Args:
        model_name: The served base model's name.
        completion_tokens: Tokens each choice generates (fewer when ``max_tokens`` is smaller).
        max_model_len: Reported model length (the gateway checks prompt + max_tokens by it).
        gate: When given, each request pauses after its first output until the gate is set
            (a ``threading.Event``: tests set it from another thread than the server's).
        token_text: The text of every generated token (a long one makes large answers: the
            transport tests' readers that never read).
        token_seconds: Seconds between two tokens of a request (0: all at once), so that a
            stream is written in many writes, as a real engine's is.

    Attributes:
        requests: Requests ``generate`` was called for.
        finished: Requests whose last output was yielded.
        in_flight: Requests started and not finished or abandoned.
    """

    def __init__(
        self,
        model_name: str = "instant",
        completion_tokens: int = 16,
        max_model_len: int = 8192,
        gate: threading.Event | None = None,
        token_text: str = TOKEN_TEXT,
        token_seconds: float = 0.0,
    ) -> None:
        self.model_name = model_name
        self.token_text = token_text
        self.token_seconds = token_seconds
        self.max_model_len = max_model_len
        self.completion_tokens = completion_tokens
        attention = [LinearTarget(f"self_attn.{p}", p, 64, 64) for p in ("q_proj", "v_proj")]
        self.adapter_limits = AdapterLimits(
            targets=ModelTargets.uniform("FakeForCausalLM", "model.layers", attention, 2),
            max_rank=16,
        )
        self.input_limits = InputLimits()  # no pre-tokenization bound: prompts are ignored
        self.gate = gate
        self.requests = 0
        self.finished = 0
        self.in_flight = 0
        self._running = True

    @property
    def is_running(self) -> bool:
        """True until :meth:`shutdown`."""
        return self._running

    async def process(
        self, messages: Any, *, tenant: str = "", tools: list[dict] | None = None
    ) -> ProcessedPrompt:
        """One prompt token per 4 characters of message text, no images.

        Raises:
            ValueError: malformed messages (see :func:`message_text_length`).
        """
        length = max(1, message_text_length(messages) // CHARS_PER_TOKEN)
        return ProcessedPrompt(prompt_token_ids=[TOKEN_ID] * length, images=[])

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One output per token, all at once; ``finish_reason`` ``"length"`` on the last.

        Yields:
            ``DELTA`` outputs (one token each), or one ``FINAL_ONLY`` output, as the request
            asks; the last has ``finished`` set.
        """
        self.requests += 1
        self.in_flight += 1
        try:
            async for out in self._outputs(request):
                yield out
        finally:
            self.in_flight -= 1

    async def _outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        n = request.sampling.n
        steps = max(1, min(self.completion_tokens, request.sampling.max_tokens))
        prompt = request.prompt_token_ids
        final_only = request.output_kind is RequestOutputKind.FINAL_ONLY
        for step in range(1, steps + 1):
            if step == 2 and self.gate is not None:
                while not self.gate.is_set():
                    await asyncio.sleep(0.005)
            if step > 1 and self.token_seconds > 0:
                await asyncio.sleep(self.token_seconds)
            last = step == steps
            if final_only and not last:
                continue
            count = step if final_only else 1
            outputs = [
                CompletionOutput(
                    index=i,
                    text=self.token_text * count,
                    token_ids=[TOKEN_ID] * count,
                    finish_reason="length" if last else None,
                    num_tokens=step,
                )
                for i in range(n)
            ]
            if last:
                self.finished += 1
            yield RequestOutput(
                request_id=request.request_id,
                prompt_token_ids=prompt,
                outputs=outputs,
                finished=last,
                num_cached_tokens=0,
                ttft=0.0,
            )

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Every token is ``token_text``."""
        return [self.token_text.encode() for _ in token_ids]

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """One token (id 1) per 4 characters, like :meth:`process`."""
        return [1] * max(1, len(text) // 4)

    async def detokenize(self, token_ids: list[int], *, tenant: str = "") -> str:
        """Every token is ``token_text``."""
        return self.token_text * len(token_ids)

    async def add_lora(self, adapter: Any) -> None:
        """Accepted and forgotten (the fake runs no adapters)."""

    async def remove_lora(self, digest: str) -> bool:
        """Always removable."""
        return True

    def stats(self) -> dict[str, Any]:
        """The ``EngineCore.stats`` keys, all idle."""
        return {
            "kv_blocks_total": 0,
            "kv_blocks_in_use": 0,
            "requests_running": 0,
            "requests_waiting": 0,
            "prefix_cache_queried_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "lora_slots_in_use": 0,
        }

    def drain_kv_events(self) -> list[Any]:
        """None: the fake caches nothing."""
        return []

    def shutdown(self) -> None:
        """Stop: :attr:`is_running` turns False."""
        self._running = False
