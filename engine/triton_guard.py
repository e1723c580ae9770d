"""Keeping triton out of a process that runs no Triton kernel (``serve``, the engine core)."""

from __future__ import annotations

import sys


def keep_triton_out() -> bool:
    """Make ``import triton`` fail in this process (it runs no Triton kernel).

    ``torch._dynamo``, which transformers' config classes import, imports triton whenever it is
    installed (a quarter of a second, and 30 lines of ``nanobind: leaked ...`` at exit). A
    ``None`` entry in ``sys.modules`` makes that import raise ``ModuleNotFoundError``, which
    torch takes as "no triton" (its ``has_triton_package``). It is process-wide and lasts:
    ``loraplex serve`` and the engine core process (``engine.core.process``) call it in their own
    process when the Triton backend is not selected;
    code that runs in-process beside other work (``generate``, called by tests) does not.

    Returns:
        Whether triton is now kept out (False: it was already imported).
    """
    if sys.modules.get("triton", None) is not None:
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True
