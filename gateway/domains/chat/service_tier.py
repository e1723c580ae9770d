"""``service_tier``: which of the engine's priority classes a request runs in, and its echo.

OpenAI's ``service_tier`` (Chat Completions, Completions, Responses) picks a processing tier;
the response's ``service_tier`` says which one served it. Here the tiers map onto the engine's
priority classes (``engine/scheduling/fair_queue.py``, docs/engine.md):

- ``auto`` (OpenAI's default), ``default`` or absent: the interactive class,
  ``PRIORITY_INTERACTIVE``; echoed ``"default"``.
- ``flex``: OpenAI's cheaper, slower tier; here the batch class, ``PRIORITY_BATCH``, the one
  ``/v1/batches`` lines use: admitted only while no interactive request waits and preempted
  first. Echoed ``"flex"``.
- ``priority`` (and any other value): refused with a 400 naming ``service_tier``; this server
  has no class above interactive, and a client that paid for one must not silently get less.
"""

from __future__ import annotations

from loraplex.engine.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from loraplex.gateway.errors import bad_request

TIERS = {"auto": "default", "default": "default", "flex": "flex"}
"""Accepted ``service_tier`` values -> the tier that serves them (the response's echo)."""


def service_tier_of(value: str | None) -> str:
    """The tier that serves a request asking for ``value`` (None: not given).

    Returns:
        ``"default"`` or ``"flex"``.

    Raises:
        APIError: 400 naming ``service_tier`` for ``priority`` or any other value.
    """
    if value is None:
        return "default"
    tier = TIERS.get(value)
    if tier is None:
        shown = value[:32]
        raise bad_request(
            f"'service_tier' {shown!r} is not offered by this server: use 'auto', 'default' "
            "(interactive) or 'flex' (the batch priority class)",
            param="service_tier",
        )
    return tier


def priority_of(tier: str) -> int:
    """The engine priority class of a tier from :func:`service_tier_of`."""
    return PRIORITY_BATCH if tier == "flex" else PRIORITY_INTERACTIVE
