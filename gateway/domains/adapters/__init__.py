"""Tenants' LoRA adapters (``/v1/adapters``) and what a tenant may serve (``/v1/models``)."""

from loraplex.gateway.domains.adapters.controller import adapter_controller
from loraplex.gateway.domains.adapters.models import ModelsController

__all__ = ["ModelsController", "adapter_controller"]
