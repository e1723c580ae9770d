"""``/console/engine``: the live engine, refreshed by htmx polling ``/console/engine/live``.

Read from ``EngineClient.stats()``, the same figures ``/metrics`` exports (docs/metrics.md):
KV blocks in use, prefix-cache hit rate, waiting and running requests, LoRA slots, replicas
running. Every figure is an aggregate over all tenants with no tenant id, adapter name or
per-tenant series in it, so tenant sessions see this page too (the per-tenant series stay on
the admin's ``/metrics``).
"""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from loraplex.gateway.console.login import CONSOLE
from loraplex.gateway.console.sessions import ConsoleSession
from loraplex.gateway.console.views import page
from loraplex.gateway.di import Injected
from loraplex.gateway.server.engine_client import EngineClient

POLL_SECONDS = 2


def engine_view(engine: EngineClient, draining: bool) -> dict[str, Any]:
    """The engine's aggregate state for the page (numbers, or None where it reports none)."""
    s = engine.stats()
    total = s.get("kv_blocks_total") or 0
    used = s.get("kv_blocks_in_use", 0)
    queried = s.get("prefix_cache_queried_tokens", 0)
    hit = s.get("prefix_cache_hit_tokens", 0)
    config = getattr(engine, "config", None)
    return {
        "running": bool(engine.is_running) and not draining,
        "draining": draining,
        "model": engine.model_name,
        "kv_blocks_in_use": used,
        "kv_blocks_total": total,
        "kv_use": used / total if total else None,
        "prefix_hit_rate": hit / queried if queried else None,
        "prefix_queried_tokens": queried,
        "requests_waiting": s.get("requests_waiting", 0),
        "requests_running": s.get("requests_running", 0),
        "lora_slots_in_use": s.get("lora_slots_in_use", 0),
        "lora_slots_total": getattr(config, "max_loras", None),
        "replicas": s.get("replicas", 1),
        "replicas_running": s.get("replicas_running", 1 if engine.is_running else 0),
        "routed": sorted((s.get("routed") or {}).items()),
        "poll": POLL_SECONDS,
    }


@get("/engine", opt=CONSOLE, sync_to_thread=False)
def engine_page(
    console: Injected[ConsoleSession], engine: Injected[EngineClient], draining: Injected[bool]
) -> Response:
    """The page, with the live fragment inside (polled every ``POLL_SECONDS``)."""
    return page("engine.html", console, engine=engine_view(engine, draining))


@get("/engine/live", opt=CONSOLE, sync_to_thread=False)
def engine_live(
    console: Injected[ConsoleSession], engine: Injected[EngineClient], draining: Injected[bool]
) -> Response:
    """The live fragment alone (what htmx swaps in)."""
    return page("_engine.html", console, engine=engine_view(engine, draining))
