"""The batch domain of the HTTP API (docs/api.md, Batch API): ``/v1/batches`` and its runner."""

from loraplex.gateway.domains.batches.controller import BatchesController
from loraplex.gateway.domains.batches.runner import BatchRunner

__all__ = ["BatchRunner", "BatchesController"]
