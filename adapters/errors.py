"""The one error type of adapter parsing, validation and storage."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter was refused: its message names the problem (the gateway answers HTTP 400).

    Raised for anything wrong with an uploaded or stored adapter: unreadable or unsupported
    ``adapter_config.json``, a corrupt or pickle weights file, a target the served model does
    not support, a tensor whose name, dtype or shape does not fit the base model.
    """
