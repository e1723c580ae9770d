"""The safetensors header is checked before any tensor is read; crafted lies are refused."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.safetensors_io import (
    json_members,
    load_tensors,
    looks_like_pickle,
    read_header,
)
from loraplex.adapters.validation import load_adapter_files


def build(header: dict, data: bytes, pad: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype="F32", shape=(2, 2), offsets=(0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_reads_what_safetensors_writes():
    a, b = torch.randn(2, 3), torch.randn(4).to(torch.bfloat16)
    data = save({"b": b, "a": a}, metadata={"format": "pt"})
    entries = read_header(data)
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {
        "a": ("F32", (2, 3)),
        "b": ("BF16", (4,)),
    }
    assert bytes(data[entries["a"].begin : entries["a"].end]) == a.numpy().tobytes()
    tensors = load_tensors(data, ["a", "b"])
    assert torch.equal(tensors["a"], a) and torch.equal(tensors["b"], b)


def test_two_tensors_back_to_back_with_padding():
    header = {"x": entry(offsets=(0, 16)), "y": entry("F16", (3,), (16, 22))}
    assert set(read_header(build(header, bytes(22), pad=b"   "))) == {"x", "y"}
    assert read_header(build({}, b"")) == {}


@pytest.mark.parametrize(
    "header, data, match",
    [
        ({"x": entry(offsets=(0, 16))}, bytes(15), "truncated or corrupt"),
        ({"x": entry(offsets=(0, 16))}, bytes(17), "1 bytes after its last tensor"),
        ({"x": entry(offsets=(16, 32))}, bytes(32), "gap before tensor 'x'"),
        ({"x": entry(offsets=(8, 0))}, bytes(16), "begin > end"),
        ({"x": entry(offsets=(0, 12))}, bytes(12), "span 12 bytes but shape"),
        ({"x": entry(), "y": entry(offsets=(8, 24))}, bytes(24), "overlaps"),
        ({"x": entry(), "y": entry()}, bytes(16), "overlaps"),
        ({"x": entry("I64", (2,), (0, 16))}, bytes(16), "dtype 'I64'"),
        ({"x": entry(shape=(-2, -2))}, bytes(16), "invalid or huge shape"),
        ({"x": entry(shape=(2**40, 2**40), offsets=(0, 16))}, bytes(16), "huge shape"),
        ({"x": entry(shape=[1] * 9, offsets=(0, 4))}, bytes(4), "huge shape"),
        ({"x": entry(offsets=(0, "16"))}, bytes(16), "invalid data_offsets"),
        ({"x": {"dtype": "F32", "shape": [1]}}, bytes(4), "exactly dtype, shape"),
        ({"x": entry(), "__metadata__": {"a": 1}}, bytes(16), "__metadata__"),
    ],
)
def test_lying_headers(header, data, match):
    with pytest.raises(AdapterError, match=match):
        read_header(build(header, data))


def test_malformed_prefix_and_json():
    with pytest.raises(AdapterError, match="truncated"):
        read_header(b"\x01\x00")
    with pytest.raises(AdapterError, match="header of 1000 bytes in a 12-byte file"):
        read_header(struct.pack("<Q", 1000) + b"{}  ")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_header(struct.pack("<Q", 4) + b"{x: ")
    with pytest.raises(AdapterError, match="not a JSON object"):
        read_header(struct.pack("<Q", 2) + b"[]")
    raw = b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {}}'
    with pytest.raises(AdapterError, match="repeats the key 'x'"):
        read_header(struct.pack("<Q", len(raw)) + raw + bytes(4))


def test_pickle_sniffing():
    assert looks_like_pickle(b"PK\x03\x04rest") and looks_like_pickle(b"\x80\x02}q\x00.")
    assert not looks_like_pickle(save({"a": torch.zeros(1)}))


@pytest.fixture(scope="module")
def valid_upload(text_base, tmp_path_factory):
    from tests.adapters.conftest import make_adapter

    out, _, _ = make_adapter(
        text_base, tmp_path_factory.mktemp("fuzz") / "a", r=2, target_modules=["q_proj"]
    )
    return (out / "adapter_config.json").read_bytes(), (
        out / "adapter_model.safetensors"
    ).read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_corrupted_files_only_ever_raise_adapter_error(data, valid_upload, text_kw):
    config, weights = valid_upload
    (n,) = struct.unpack("<Q", weights[:8])
    mutated = bytearray(weights)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 8 + n + 64))  # the prefix, the header, some data
        mutated[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(mutated))))
    blob = bytes(mutated if cut is None else mutated[:cut])
    try:
        adapter = load_adapter_files(config, blob, **text_kw)
    except AdapterError:
        return
    assert all(
        torch.isfinite(a).all() and torch.isfinite(b).all() for a, b, _ in adapter.weights.values()
    )


# ------------------------------------------- the member count taken before the header is parsed
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab:"\\{}, \u00e9', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='ab:"\\{}', max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _members(value) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_members(v) for v in value.values())
    if isinstance(value, list):
        return sum(_members(v) for v in value)
    return 0


@given(value=_json)
def test_json_members_counts_object_members_outside_strings(value):
    text = json.dumps(value, ensure_ascii=False).encode()
    assert json_members(text, stop=10**9) == _members(value)


def test_many_entry_header_is_refused_before_it_is_parsed(monkeypatch):
    import loraplex.adapters.safetensors_io as io_mod

    header = b"{" + b",".join(b'"%d":0' % i for i in range(5000)) + b"}"
    data = struct.pack("<Q", len(header)) + header
    monkeypatch.setattr(io_mod, "json", None)  # any parse attempt would raise AttributeError
    with pytest.raises(AdapterError, match="more entries than 56 tensors"):
        read_header(data, max_tensors=56)
    with pytest.raises(AdapterError, match="too large"):
        read_header(data, max_header_bytes=1000)


def test_overlong_tensor_name_is_refused_before_any_name_matching():
    name = "base_model.model." + "a." * 600 + "lora_A.weight"
    data = build({name: entry(offsets=(0, 16))}, bytes(16))
    with pytest.raises(AdapterError, match="longer than 1024 characters"):
        read_header(data)
