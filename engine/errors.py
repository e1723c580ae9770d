"""The errors an engine client raises to its caller, shared by every client implementation."""

from __future__ import annotations

from loraplex.engine.structured_output.grammar import StructuredOutputError


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can run."""


class RequestFailedError(RuntimeError):
    """A fault while admitting this request failed it alone (the engine runs on)."""


class EngineOverloadedError(RuntimeError):
    """The engine could not take this request now (its grammar sandbox was overloaded): retry."""


def rejection_error(message: str, kind: str) -> Exception:
    """The error a client raises for a request the core refused.

    Args:
        message: The core's message (for the client's error body).
        kind: ``"structured"`` (a structured-output spec the engine cannot enforce: a 400),
            ``"overloaded"`` (retry later: a 503), ``"fault"`` (a fault admitting it: a 500)
            or ``"value"`` (any other refusal: a 400).
    """
    if kind == "structured":
        return StructuredOutputError(message)
    if kind == "overloaded":
        return EngineOverloadedError(message)
    if kind == "fault":
        return RequestFailedError(message)
    return ValueError(message)
