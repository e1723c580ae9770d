"""The files domain of the HTTP API (docs/api.md, Batch API): ``/v1/files``."""

from loraplex.gateway.domains.files.controller import files_controller

__all__ = ["files_controller"]
