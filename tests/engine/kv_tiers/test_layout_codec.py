"""Layouts, fingerprints and the framed record of the serialising tiers (docs/kv_tiers.md)."""

import dataclasses

import pytest
import torch

from loraplex.engine.kv_cache.tiers import CorruptBlock, KVLayout, codec, decode, encode
from tests.engine.kv_tiers.conftest import block, keys


def test_block_nbytes_of_the_smollm2_135m_shape():
    smol = KVLayout("HuggingFaceTB/SmolLM2-135M@d", "float32", 16, 30, 3, 64, "sha256")
    assert smol.block_nbytes == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert dataclasses.replace(smol, dtype="bfloat16").block_nbytes == 368_640
    assert smol.shape == (30, 2, 16, 3, 64)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "tiny@ffff"),
        ("dtype", "bfloat16"),
        ("block_size", 8),
        ("num_layers", 3),
        ("num_kv_heads", 2),
        ("head_dim", 16),
        ("hash_scheme", "xxhash"),
    ],
)
def test_fingerprint_differs_per_field(layout, field, value):
    other = dataclasses.replace(layout, **{field: value})
    assert other.fingerprint() != layout.fingerprint()
    assert len(other.fingerprint()) == 64 and int(other.fingerprint(), 16) >= 0
    assert dataclasses.replace(other, **{field: getattr(layout, field)}).fingerprint() == (
        layout.fingerprint()
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "float33"),
        ("block_size", 0),
        ("head_dim", -1),
        ("model", ""),
        ("num_layers", True),
    ],
)
def test_a_malformed_layout_is_refused(layout, field, value):
    with pytest.raises(ValueError):
        dataclasses.replace(layout, **{field: value})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_gives_the_same_kv(layout, dtype):
    layout = dataclasses.replace(layout, dtype=dtype)
    payload = block(layout, 1)
    key = keys(1)[0]
    frame = encode(key, payload, layout)
    assert len(frame) == codec.frame_nbytes(len(key), layout)
    for buf in (frame, bytearray(frame)):
        out = decode(buf, key, layout)
        assert out.dtype == torch.uint8 and out.shape == (layout.block_nbytes,)
        kv = out.view(getattr(torch, dtype)).reshape(layout.shape)
        assert torch.equal(kv, payload.view(getattr(torch, dtype)).reshape(layout.shape))


def test_a_writable_buffer_is_not_copied(layout):
    payload, key = block(layout, 2), keys(1)[0]
    buf = bytearray(encode(key, payload, layout))
    out = decode(buf, key, layout)
    buf[-1] ^= 0xFF  # the tensor is a view of the buffer
    assert out[-1].item() == payload[-1].item() ^ 0xFF


def corruptions(layout, key):
    frame = encode(key, block(layout, 3), layout)
    other = dataclasses.replace(layout, model="tiny@other")

    def flip(i):
        b = bytearray(frame)
        b[i] ^= 0x01
        return bytes(b)

    return {
        "magic": flip(0),
        "version": flip(4),
        "flags": flip(6),
        "fingerprint": flip(8),
        "key length": flip(40),
        "payload length": flip(44),
        "checksum": flip(52),
        "key": flip(codec.HEADER_NBYTES),
        "payload byte": flip(len(frame) - 100),
        "truncated": frame[:-1],
        "header only": frame[: codec.HEADER_NBYTES - 1],
        "empty": b"",
        "trailing": frame + b"\0",
        "another layout": encode(key, block(other, 3), other),
        "another key": encode(keys(2)[1], block(layout, 3), layout),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "magic",
        "version",
        "flags",
        "fingerprint",
        "key length",
        "payload length",
        "checksum",
        "key",
        "payload byte",
        "truncated",
        "header only",
        "empty",
        "trailing",
        "another layout",
        "another key",
    ],
)
def test_every_corruption_raises_corrupt_block(layout, kind):
    key = keys(1)[0]
    frame = corruptions(layout, key)[kind]
    with pytest.raises(CorruptBlock):
        decode(frame, key, layout)


def test_a_malformed_payload_is_refused(layout):
    key = keys(1)[0]
    good = block(layout, 4)
    for bad in (good[:-1], good.view(torch.float32), good.reshape(2, -1), good[::2]):
        with pytest.raises(ValueError):
            encode(key, bad, layout)
    with pytest.raises(ValueError):
        encode(b"", good, layout)
