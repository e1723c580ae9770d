"""Header-first reading of an ``adapter_model.safetensors`` file.

The format: 8 bytes little-endian ``N``, then ``N`` bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the data section; offsets are relative to the data section's start::

    | N (u64 LE) | header JSON (N bytes) | data: tensor bytes, back to back |
    0            8                      8+N                                len(file)

Everything in the header is checked before a single tensor is materialized, so a truncated
file or a header that lies about offsets is refused with a clear message, never half-loaded.
Before the header is JSON-parsed its size is bounded in bytes and its members are counted by a
linear scan (colons outside strings), so neither a huge nor a 10^6-entry header is ever parsed.
Pickle files are recognised and refused; nothing here ever unpickles.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from loraplex.adapters.errors import AdapterError

DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
"""Accepted tensor dtypes and their item sizes in bytes."""
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_DIMS = 8
MAX_NAME_CHARS = 1024
"""Longest tensor name accepted (PEFT's longest LLaVA names are ~90 characters)."""
MAX_DIM_SIZE = 1 << 31
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""File names with these suffixes are pickle (``torch.save``) files: always refused."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it.

    Attributes:
        name: The tensor's key.
        dtype: ``"F32"``, ``"F16"`` or ``"BF16"``.
        shape: Its dimensions.
        begin: Offset of its first byte from the start of the file.
        end: Offset one past its last byte from the start of the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def looks_like_pickle(data: bytes) -> bool:
    """Whether bytes are a ``torch.save`` zip archive or a raw pickle stream."""
    return data[:4] == b"PK\x03\x04" or (len(data) >= 2 and data[0] == 0x80 and data[1] <= 5)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise AdapterError(f"safetensors header repeats the key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(
    data: bytes,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_tensors: int | None = None,
    max_metadata: int = 64,
) -> dict[str, TensorEntry]:
    """Parse and check a safetensors file's header without touching tensor data.

    Args:
        data: The whole file.
        max_header_bytes: Largest header accepted (checked before it is read).
        max_tensors: Most tensors accepted; with ``max_metadata``, bounds the header's JSON
            members, counted before it is parsed (None: no bound beyond the bytes).
        max_metadata: Most ``__metadata__`` entries.

    Returns:
        ``name -> TensorEntry`` for every tensor.

    Raises:
        AdapterError: a pickle file; a file shorter than its header; a header over
            ``max_header_bytes`` or with more members than ``max_tensors`` tensors can have; a
            header that is not a JSON object of tensor entries; a dtype other than F32/F16/BF16;
            a shape with negative, huge or too many dimensions; ``data_offsets`` that are
            reversed, leave the data section, overlap, leave gaps, or disagree with
            ``numel * itemsize``.
    """
    if looks_like_pickle(data):
        raise AdapterError(
            "adapter weights are a pickle (torch.save) file; only safetensors is accepted "
            "(save with safe_serialization=True)"
        )
    if len(data) < 8:
        raise AdapterError(f"safetensors file is truncated: {len(data)} bytes, no header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise AdapterError(
            f"safetensors file is truncated or corrupt: header of {header_len} bytes "
            f"in a {len(data)}-byte file"
        )
    if header_len > max_header_bytes:
        raise AdapterError(
            f"safetensors header of {header_len} bytes is too large (at most {max_header_bytes})"
        )
    text = bytes(data[8 : 8 + header_len])
    if max_tensors is not None:
        # a tensor entry has 4 members (its name, dtype, shape, data_offsets); the object 1 more
        most = 4 * max_tensors + max_metadata + 1
        if json_members(text, stop=most) > most:
            raise AdapterError(
                f"safetensors header has more entries than {max_tensors} tensors (an adapter "
                "for this model has far fewer)"
            )
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"safetensors header is not valid JSON: {exc}") from None
    except RecursionError:
        raise AdapterError("safetensors header nests too deeply") from None
    if not isinstance(header, dict):
        raise AdapterError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise AdapterError("safetensors __metadata__ must map strings to strings")
    if metadata is not None and len(metadata) > max_metadata:
        raise AdapterError(f"safetensors __metadata__ has more than {max_metadata} entries")
    if max_tensors is not None and len(header) > max_tensors:
        raise AdapterError(
            f"safetensors header names {len(header)} tensors; at most {max_tensors} are read"
        )
    data_start = 8 + header_len
    for name in header:
        if len(name) > MAX_NAME_CHARS:
            raise AdapterError(
                f"tensor name {name[:64]!r}... is longer than {MAX_NAME_CHARS} characters"
            )
    entries = {name: _entry(name, info, data_start) for name, info in header.items()}
    _check_layout(sorted(entries.values(), key=lambda e: (e.begin, e.end)), data_start, len(data))
    return entries


def json_members(text: bytes, stop: int) -> int:
    """Members of all objects in a JSON text (its colons outside strings), counted linearly.

    Stops counting once past ``stop``. On invalid JSON the count is meaningless, but the parser
    refuses that text anyway.
    """
    members, i, n = 0, 0, len(text)
    while i < n:
        quote = text.find(b'"', i)
        members += text.count(b":", i, n if quote < 0 else quote)
        if quote < 0 or members > stop:
            return members
        i = _string_end(text, quote + 1)
    return members


def _string_end(text: bytes, i: int) -> int:
    """Index just past the quote closing the string that starts at ``i`` (``len`` if none)."""
    while True:
        j = text.find(b'"', i)
        if j < 0:
            return len(text)
        k = j
        while k > i and text[k - 1] == 0x5C:  # the backslashes right before this quote
            k -= 1
        if (j - k) % 2 == 0:
            return j + 1
        i = j + 1


def _entry(name: str, info: object, data_start: int) -> TensorEntry:
    """Check one header entry's fields and its size."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError(
            f"safetensors entry {name!r} must have exactly dtype, shape and data_offsets"
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise AdapterError(
            f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(DTYPE_SIZES)}"
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(_is_int(d) and 0 <= d < MAX_DIM_SIZE for d in shape)
    ):
        raise AdapterError(f"tensor {name!r} has an invalid or huge shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise AdapterError(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise AdapterError(f"tensor {name!r} has data_offsets {offsets} with begin > end")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise AdapterError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but shape {shape} "
            f"of {dtype} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(entries: list[TensorEntry], data_start: int, file_len: int) -> None:
    """Tensors must tile the data section exactly: in bounds, no overlap, no gap."""
    position = data_start
    for entry in entries:
        if entry.begin < position:
            raise AdapterError(f"tensor {entry.name!r} overlaps the previous tensor's bytes")
        if entry.begin > position:
            raise AdapterError(f"safetensors data has a gap before tensor {entry.name!r}")
        if entry.end > file_len:
            raise AdapterError(
                f"safetensors file is truncated or corrupt: tensor {entry.name!r} ends at byte "
                f"{entry.end} of a {file_len}-byte file"
            )
        position = entry.end
    if position != file_len:
        raise AdapterError(
            f"safetensors file has {file_len - position} bytes after its last tensor"
        )


def load_tensors(data: bytes, names: list[str]) -> dict[str, torch.Tensor]:
    """Materialize the named tensors with the safetensors library (after :func:`read_header`).

    Args:
        data: The whole file, already checked by :func:`read_header`.
        names: The tensors to return.

    Returns:
        ``name -> tensor`` in the file's dtype, on CPU.

    Raises:
        AdapterError: the safetensors library refuses the file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"safetensors could not read the weights: {exc}") from None
    return {name: tensors[name] for name in names}
