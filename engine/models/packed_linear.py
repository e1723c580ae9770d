"""Linear layers with weights prepacked for oneDNN, the CPU's GEMM library (issue 30 item 3).

``F.linear`` on the CPU hands MKL a row-major ``[out, in]`` weight on every call, and MKL's sgemm
re-packs that matrix into its blocked panel layout each time: at the row counts of decode (1-32
tokens) the re-packing costs as much as the product. oneDNN's ``reorder_linear_weight`` does the
packing once, at load; ``mkldnn._linear_pointwise`` then multiplies against the blocked weight
directly. This is what inductor does to a frozen graph's linears on the CPU, and what vLLM's CPU
backend does at load (its oneDNN GEMM handles).

Measured on this project's CI machine kind (one AVX-512 core, ``bench.packed_linear``): float32
2.2-2.7x ``F.linear`` at 8-256 rows for SmolLM2-135M's projections, 1.2-1.8x at one row for the
wide ones (MLP, output head), 0.8x at one row for the narrow attention projections; bfloat16
1.2-2.1x at 1-32 rows. Results differ from ``F.linear``'s in float rounding only (another
summation order), like any other GEMM library's.

The packed weight is the module's only copy: :attr:`PackedLinear.weight` unpacks it on each
read (a dense ``[out, in]`` copy), for the code that inspects a projection's weight.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

PACK_BATCH_HINT = 32
"""The row count oneDNN picks the blocked layout for (any row count runs on it; 8-32 rows gave
the same speed as a layout packed for the exact count)."""

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

MIN_PACK_ELEMENTS = 1 << 16
"""Weights with fewer elements stay dense: oneDNN's call costs about 10 us more than
``F.linear``'s, more than a small product (measured at one thread: 128 x 128 at 1-8 rows
0.28-0.46x ``F.linear``; 256 x 256 at 64 rows 1.8x; 576 x 192, SmolLM2's k/v, 0.48x at one
row, 1.2x at 8, 2.0x at 64). Test-sized models are left as they are."""

_REGISTRY: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
"""Every live :class:`PackedLinear` by its ``key``: how the compiled step's opaque op finds the
packed weight (a oneDNN blocked tensor cannot be a traced graph input)."""


def can_pack(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights of ``dtype`` on ``device`` cannot be prepacked, or None when they can.

    Args:
        device: The model's device.
        dtype: The model's weight dtype.
    """
    if device.type != "cpu":
        return f"prepacked weights are for the CPU (the model is on {device.type})"
    if dtype not in PACKABLE_DTYPES:
        return f"oneDNN prepacking takes float32 or bfloat16 weights, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


class PackedLinear(nn.Module):
    """``nn.Linear``'s computation on a oneDNN-prepacked weight (CPU, float32 or bfloat16).

    Args:
        linear: The layer to pack (its weight is copied into the blocked layout; the layer
            itself is not modified).
        batch_hint: The row count the layout is chosen for (:data:`PACK_BATCH_HINT`).

    Raises:
        ValueError: a weight that :func:`can_pack` refuses.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> None:
        super().__init__()
        weight = linear.weight.detach()
        reason = can_pack(weight.device, weight.dtype)
        if reason is not None:
            raise ValueError(reason)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        self.bias = linear.bias
        self.key = id(self)
        _REGISTRY[self.key] = self

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight, unpacked (a copy made on every read)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out]``, ``x @ W.T + b``.

        Raises:
            RuntimeError: ``x``'s dtype is not the weight's (oneDNN does not cast).
        """
        if x.dtype != self.packed.dtype:
            raise RuntimeError(
                f"PackedLinear: input dtype {x.dtype} is not the weight's {self.packed.dtype}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # opaque to the compiler (see _REGISTRY)
            y = torch.ops.loraplex.packed_linear(x2, self.key)
        else:
            y = _linear(x2, self)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        """Shapes, as ``nn.Linear`` prints them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _linear(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), layer.packed, layer.bias, "none", [], ""
    )


@torch.library.custom_op("loraplex::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, key: int) -> torch.Tensor:
    """``[M, in] -> [M, out]`` through the :class:`PackedLinear` registered as ``key``.

    Raises:
        KeyError: no live layer has that key.
    """
    return _linear(x, _REGISTRY[key])


@packed_linear_op.register_fake
def _(x, key):
    return x.new_empty(x.shape[0], _REGISTRY[key].out_features)


def pack_linears(model: nn.Module, *, batch_hint: int = PACK_BATCH_HINT) -> int:
    """Replace ``model``'s linears by :class:`PackedLinear` ones, in place.

    Those of :data:`MIN_PACK_ELEMENTS` weights or more; smaller ones stay ``nn.Linear``. A
    layer with a ``to_packed(batch_hint)`` method (a fused projection) becomes what that returns.

    Call before LoRA layers are installed (they wrap whatever projection is there).

    Args:
        model: A model on the CPU in float32 or bfloat16.
        batch_hint: See :data:`PACK_BATCH_HINT`.

    Returns:
        The number of layers packed.

    Raises:
        ValueError: the model's weights cannot be packed (:func:`can_pack`).
    """
    parents = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (type(child) is nn.Linear or hasattr(child, "to_packed"))
        and child.weight.numel() >= MIN_PACK_ELEMENTS
    ]
    for parent, name, child in parents:
        packed = child.to_packed(batch_hint) if hasattr(child, "to_packed") else None
        setattr(parent, name, packed if packed is not None else PackedLinear(child, batch_hint))
    return len(parents)
