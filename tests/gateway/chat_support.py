"""Helpers of the chat, usage and prefix-cache API tests: photos, prompts, the engine run
directly, and the usage rows as stored."""

from __future__ import annotations

import asyncio
import time
import uuid

from sqlalchemy import select

from loraplex.engine.request import EngineRequest, RequestOutputKind
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.db.models import Adapter, UsageEvent
from tests.gateway.conftest import with_db
from tests.media import data_url, encode, long_text, photo, png_bomb  # noqa: F401 - re-exported
from tests.support import wait_for  # noqa: F401 - re-exported

BLOCK_SIZE = 16


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> dict:
    """A user message from str (text parts) and dicts (image parts)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def prompt_ids(engine_client, messages) -> list[int]:
    """The prompt token ids the engine makes of ``messages`` (chat template, images expanded)."""
    return engine_client.inputs(messages).prompt_token_ids


def full_blocks(n_tokens: int) -> int:
    """Tokens in the full blocks of an ``n_tokens`` prefix."""
    return n_tokens // BLOCK_SIZE * BLOCK_SIZE


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def engine_direct(engine_client, messages, lora_digest=None, **sampling):
    """Run ``messages`` on the session engine itself, no gateway: the final RequestOutput."""

    async def go():
        prompt = await engine_client.process(messages)
        request = EngineRequest(
            request_id=f"direct-{uuid.uuid4().hex}",
            prompt_token_ids=prompt.prompt_token_ids,
            sampling=SamplingParams(**sampling),
            images=prompt.images,
            lora_digest=lora_digest,
            cache_salt=f"direct-{uuid.uuid4().hex}",  # shares no cache with any tenant
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for out in engine_client.generate(request):
            final = out
        return final

    return asyncio.run(go())


def usage_events(live, api_key: str) -> list[UsageEvent]:
    """The caller's tenant's usage rows as stored (``GET /v1/usage`` flushes the writer first)."""
    with live.client(api_key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        tenant = r.json()["tenant"]

    async def body(sessions):
        async with sessions() as s:
            rows = await s.scalars(
                select(UsageEvent).where(UsageEvent.tenant_id == tenant).order_by(UsageEvent.id)
            )
            return list(rows)

    return with_db(live.state.config.db_url, body)


ADAPTER_TARGETS = ["gate_proj", "up_proj", "down_proj"]  # the language model's MLP only


def make_tiny_adapter(hf_llava, directory):
    """A real PEFT LoRA (random A and B) for the tiny LLaVA, saved under ``directory``."""
    from tests.adapters.conftest import make_adapter

    path, _, _ = make_adapter(
        hf_llava, directory / "lora", seed=3, r=4, lora_alpha=8, target_modules=ADAPTER_TARGETS
    )
    return path


def register_adapter(live, tenant_id: str, name: str, path) -> str:
    """What an upload leaves behind: the files in the store and the tenant's row; the digest."""
    limits = live.state.engine.adapter_limits
    stored = live.state.store.put_dir(
        path,
        limits=limits,
    )
    add_adapter_row(live, tenant_id, name, stored.digest)
    return stored.digest


def add_adapter_row(live, tenant_id: str, name: str, digest: str) -> None:
    """An adapter row for ``tenant_id`` (the store is not touched)."""

    async def body(sessions):
        async with sessions() as s, s.begin():
            s.add(
                Adapter(
                    tenant_id=tenant_id,
                    name=name,
                    digest=digest,
                    rank=4,
                    lora_alpha=8.0,
                    target_modules=ADAPTER_TARGETS,
                )
            )

    with_db(live.state.config.db_url, body)


def long_stream_body(model: str, **extra) -> dict:
    """A streamed, greedy chat request of up to 2,000 tokens (to kill its engine mid-way)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        **extra,
    }


class BackgroundStream:
    """A streamed chat completion read on a thread (to kill its engine mid-stream).

    After :meth:`start`, ``first_chunk`` is set at the first ``data: {`` line; when the stream
    ends, ``lines`` holds every line and ``ended`` the ``time.monotonic()`` it ended at.
    """

    def __init__(self, live, body: dict, headers: dict) -> None:
        import threading

        self.first_chunk = threading.Event()
        self.lines: list[str] = []
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(live, body, headers))

    def start(self) -> BackgroundStream:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self, live, body: dict, headers: dict) -> None:
        import httpx

        with httpx.Client(base_url=live.base_url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                for line in r.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: {"):
                        self.first_chunk.set()
        self.ended = time.monotonic()
