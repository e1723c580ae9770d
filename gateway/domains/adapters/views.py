"""Response bodies of the adapter and model routes (docs/adapters.md)."""

from __future__ import annotations

import time
from typing import Any

from loraplex.adapters.limits import AdapterLimits
from loraplex.gateway.db.models import Adapter

BASE_OWNER = "loraplex"


def adapter_view(row: Adapter) -> dict[str, Any]:
    """``{"name", "digest", "rank", "lora_alpha", "target_modules", "base_model", "created_at"}``.

    ``created_at`` is ISO 8601 in UTC; ``base_model`` is the config's
    ``base_model_name_or_path`` (None when empty).
    """
    return {
        "name": row.name,
        "digest": row.digest,
        "rank": row.rank,
        "lora_alpha": row.lora_alpha,
        "target_modules": list(row.target_modules),
        "base_model": row.base_model,
        "created_at": row.created_at.isoformat(),
    }


def base_model_card(model_name: str, limits: AdapterLimits) -> dict[str, Any]:
    """The served base model as an OpenAI model object (``created``: now, as vLLM does).

    One field beyond OpenAI's: ``lora``, what an adapter for this model may target
    (:meth:`adapters.limits.AdapterLimits.summary`: ``target_modules``, a ready
    ``target_modules_regex`` for PEFT, ``decoder_layers``, ``num_layers``, ``max_rank``).
    """
    return {
        "id": model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": BASE_OWNER,
        "lora": limits.summary(),
    }


def adapter_model_card(row: Adapter, owner: str, parent: str) -> dict[str, Any]:
    """A tenant's adapter as an OpenAI model object; ``parent`` is the base model."""
    return {
        "id": row.name,
        "object": "model",
        "created": int(row.created_at.timestamp()),
        "owned_by": owner,
        "parent": parent,
    }


def list_body(data: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's list shape."""
    return {"object": "list", "data": data}
