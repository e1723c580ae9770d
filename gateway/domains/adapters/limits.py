"""What one adapter upload may weigh, derived from the served model (configured values cap it).

The largest valid ``adapter_model.safetensors`` follows from the engine's
:class:`adapters.limits.AdapterLimits` (:func:`adapters.sizes.max_weights_bytes`:
every projection of every layer at ``max_rank`` in float32, plus the largest header), and
``adapter_config.json`` from :data:`adapters.peft_config.MAX_CONFIG_BYTES`. Everything an upload
carries is bounded by these before it is kept or inflated:

- the route's body limit: both files, :data:`OTHER_BYTES` of other parts or members (the
  ``README.md`` that ``save_pretrained`` writes), 1% for compression that does not shrink
  random weights, :data:`FORM_SLACK_BYTES` of multipart and archive framing;
  ``upload_max_body_bytes`` caps it;
- an archive's decompressed total (both files and :data:`OTHER_BYTES`), capped by
  ``max_archive_unpacked_bytes``, and each of the two files by its own figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.peft_config import MAX_CONFIG_BYTES
from loraplex.adapters.sizes import max_weights_bytes
from loraplex.gateway.server.config import GatewayConfig

OTHER_BYTES = 1024 * 1024
"""Room for parts and archive members other than the two files (read only to be skipped)."""
FORM_SLACK_BYTES = 64 * 1024
"""Multipart boundaries and part headers, zip and tar headers."""


@dataclass(frozen=True)
class UploadLimits:
    """The byte caps of one upload.

    Attributes:
        config_bytes: Largest ``adapter_config.json``.
        weights_bytes: Largest ``adapter_model.safetensors`` (a valid adapter at most).
        body_bytes: Largest request body (413 beyond).
        unpacked_bytes: Most bytes an archive may inflate to in all.
        members: Most entries in an archive.
    """

    config_bytes: int
    weights_bytes: int
    body_bytes: int
    unpacked_bytes: int
    members: int

    @classmethod
    def derive(cls, adapter: AdapterLimits, config: GatewayConfig) -> UploadLimits:
        """The caps for the served model, each at most its configured value.

        Args:
            adapter: The engine's adapter limits (shapes, layers, max rank).
            config: ``upload_max_body_bytes``, ``max_archive_unpacked_bytes`` and
                ``max_archive_members``.
        """
        weights = max_weights_bytes(adapter.targets, adapter.max_rank)
        files = MAX_CONFIG_BYTES + weights + OTHER_BYTES
        body = files + files // 100 + FORM_SLACK_BYTES
        unpacked = min(files, config.max_archive_unpacked_bytes)
        return cls(
            config_bytes=min(MAX_CONFIG_BYTES, unpacked),
            weights_bytes=min(weights, unpacked),
            body_bytes=min(body, config.upload_max_body_bytes),
            unpacked_bytes=unpacked,
            members=config.max_archive_members,
        )
