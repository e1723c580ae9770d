"""Test inputs shared by every test folder: real photos, data URLs, filler text, a PNG bomb."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image
from skimage import data as skdata


def photo(name: str = "astronaut", size: int | None = None) -> Image.Image:
    """A real photo from scikit-image (``skimage.data.NAME``), RGB, resized (Lanczos) to
    ``size`` x ``size`` when given."""
    arr = getattr(skdata, name)()
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    img = Image.fromarray(arr[..., :3].astype(np.uint8))
    return img.resize((size, size), Image.LANCZOS) if size else img


def encode(img: Image.Image, fmt: str = "PNG", **save) -> bytes:
    """``img`` encoded as ``fmt`` (Pillow's save options in ``save``)."""
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def data_url(
    payload: bytes | Image.Image, mime: str | None = None, fmt: str = "PNG", **save
) -> str:
    """A ``data:`` URL of an image (encoded as ``fmt``) or of raw bytes (``image/png`` unless
    ``mime`` says otherwise)."""
    if isinstance(payload, Image.Image):
        payload = encode(payload, fmt, **save)
    mime = mime or f"image/{fmt.lower()}"
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


def long_text(words: int, seed: int = 0) -> str:
    """Deterministic prose-like filler of ``words`` words."""
    vocab = (
        "the cat sat on a warm mat while the quick brown fox jumped over lazy dogs and "
        "small birds sang songs about rivers mountains stars cities bread honey"
    ).split()
    rng = np.random.default_rng(seed)
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header claiming ``width x height`` pixels, with a tiny IDAT (~70 bytes)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(tag + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )
