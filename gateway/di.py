"""How handlers take the gateway's services: Litestar dependencies, by parameter name.

``engine: Injected[EngineClient]`` in a handler's (or a provider's) signature is the app's
``engine`` dependency (``gateway.server.app.dependencies`` lists them all). The values are the
app's own long-lived objects, so they are passed as they are: Litestar does not validate them
(it would copy a set, and cannot check a ``Protocol`` such as ``EngineClient``).
"""

from __future__ import annotations

from typing import Annotated, TypeAlias, TypeVar

from litestar.di import Dependency
from litestar.params import SkipValidationMarker

T = TypeVar("T")

Injected: TypeAlias = Annotated[T, Dependency(kind="named"), SkipValidationMarker()]
"""A parameter that Litestar fills from the dependency of the same name, unvalidated."""
