"""Image keys: the identity an image contributes to a block hash, ``("mm", image_key, offset)``.

Two modes (docs/image_keys.md has the reasons and the measurements):

- ``exact`` (default): SHA-256 of the decoded pixels and size; any pixel change gives a new key,
  so two pictures share KV only if the model would see the same pixels.
- ``perceptual`` (opt-in): a quantized description of what the picture looks like, so a
  re-encoded, recompressed or slightly resized copy gets the *same string* and hits the cache.
  This follows vLLM's automatic-prefix-caching design note ("perceptual hashing for images to
  cache similar input images"). The key is looked up by exact string equality (no Hamming
  search), so it is built from the features that survive re-encoding best: the signs of the
  lowest-frequency 2-D DCT coefficients of a canonical thumbnail (the pHash family, Zauner 2010;
  Meta's PDQ uses the same DCT-of-area-averages idea), plus the aspect ratio, mean luminance and
  mean chroma, each coarsely quantized. ``python -m bench.image_keys`` compares it with
  imagehash's phash/dhash/average_hash/whash/colorhash: with 64 bits or more they lose the key
  far more often (phash8 keeps 86%), with 16 bits they collide (whash4: 1313 colliding pairs).
  It is not the default because it merges pictures a vision model tells apart: on the
  near-duplicate set of ``bench.near_duplicates`` (one character of text changed, a small
  object added, a region recoloured or moved) it gives one key to most pairs, "PIN 1234" and
  "PIN 9876" included, and no stateless exact-match key measured keeps >= 95% of re-encodings
  with 0 near-duplicate collisions (the finer the key, the fewer re-encodings keep it).

Keys are pure functions of the pixels (no state), so they agree across processes and restarts.
They are always combined with the tenant's ``("salt", cache_salt)`` extra key, so a perceptual
collision can only ever reuse KV within one tenant (where it still serves a wrong answer).
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import numpy as np
from PIL import Image

from loraplex.hashing.image_decode import (
    ACCEPTED_FORMATS,
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    MAX_SIDE,
    decode_image,
)
from loraplex.hashing.image_decode import to_rgb as _to_rgb

__all__ = [  # the decoding names are re-exported: callers import them from here
    "ACCEPTED_FORMATS",
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_PIXELS",
    "MAX_SIDE",
    "PERCEPTUAL_METHOD",
    "decode_image",
    "exact_image_key",
    "image_key",
    "perceptual_image_key",
]

#: Name and version of the perceptual method; it is the perceptual keys' prefix.
PERCEPTUAL_METHOD = "pdct-v1"
_EXACT_METHOD = "exact-v1"

_CANON = 128  # Lanczos thumbnail side: exact geometry, anti-aliased
_GRID = 16  # then exact 8x8 area means: the grid the DCT runs on
_MAX_FREQ = 6  # keep DCT coefficients (u, v) with 0 < u + v <= 6: 27 sign bits
_LUMA_STEP = 32.0  # mean luminance in 8 buckets (0..255 / 32, rounded)
_CHROMA_STEP = 16.0  # mean Cb, Cr around neutral 128; gray images sit mid-bucket at 0
_ASPECT_STEPS = 4  # round(4 * log2(w / h)): 1:1 is a bucket centre
_ZERO = 1e-6  # |coefficient| below this is exact symmetry, not signal: bit 0 on any BLAS


def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix ``M``, so ``M @ X @ M.T`` is the 2-D DCT of ``X``: [n, n]."""
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    m = np.cos(np.pi * (x + 0.5) * k / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    m.setflags(write=False)
    return m


_DCT = _dct_matrix(_GRID)


def exact_image_key(image: Image.Image) -> str:
    """Key an image by its exact decoded pixels.

    Args:
        image: A PIL image; it is first normalized like ``decode_image`` does (EXIF orientation,
            8-bit RGB, alpha composited on white).

    Returns:
        ``"exact-v1:" + sha256(tag, "RGB", width, height, pixel bytes).hexdigest()``. Equal
        pixels and size give equal keys (whatever the container, metadata or EXIF); any pixel
        change gives a different key, so a lossy re-encoding never hits.
    """
    rgb = _to_rgb(image)
    digest = hashlib.sha256(f"loraplex/{_EXACT_METHOD}/RGB/{rgb.width}x{rgb.height}\0".encode())
    digest.update(rgb.tobytes())
    return f"{_EXACT_METHOD}:{digest.hexdigest()}"


def _pdct_key(image: Image.Image, max_freq: int = _MAX_FREQ, color: bool = True) -> str:
    """The perceptual key, with the knobs ``bench.image_keys`` sweeps (see the module doc)."""
    rgb = _to_rgb(image)
    # Lanczos to a square thumbnail (exact sub-pixel geometry; Pillow's BOX filter snaps cell
    # edges to whole pixels, which moved keys under resizes), then exact 8x8 area means.
    thumb = rgb.convert("L").resize((_CANON, _CANON), Image.Resampling.LANCZOS)
    grid = np.asarray(thumb.convert("F").resize((_GRID, _GRID), Image.Resampling.BOX))
    coef = _DCT @ grid.astype(np.float64) @ _DCT.T  # [16, 16]: coef[u, v], u vertical freq
    bits = 0
    for u in range(max_freq + 1):
        for v in range(max_freq + 1 - u):
            if u + v > 0:
                bits = (bits << 1) | int(coef[u, v] > _ZERO)
    nbits = (max_freq + 1) * (max_freq + 2) // 2 - 1
    # Exact channel means of the whole image, from integer histograms: [3] (R, G, B).
    hist = np.asarray(rgb.histogram(), dtype=np.float64).reshape(3, 256)
    red, green, blue = (hist * np.arange(256.0)).sum(axis=1) / hist[0].sum()
    luma = 0.299 * red + 0.587 * green + 0.114 * blue  # ITU-R BT.601, as JPEG and Pillow
    aspect = round(_ASPECT_STEPS * math.log2(rgb.width / rgb.height))
    fields = [f"{bits:0{(nbits + 3) // 4}x}", f"a{aspect}", f"y{round(luma / _LUMA_STEP)}"]
    if color:
        cb = -0.168736 * red - 0.331264 * green + 0.5 * blue  # offsets from neutral 128
        cr = 0.5 * red - 0.418688 * green - 0.081312 * blue
        fields.append(f"c{round(cb / _CHROMA_STEP)},{round(cr / _CHROMA_STEP)}")
    return f"{PERCEPTUAL_METHOD}:{'/'.join(fields)}"


def perceptual_image_key(image: Image.Image) -> str:
    """Key an image by how it looks, so re-encodings of one picture share the key.

    Algorithm (``pdct``): normalize like ``decode_image``; Lanczos-resize to 128x128; take the
    luminance's 16x16 area means; 2-D DCT-II; one bit per coefficient ``(u, v)`` with
    ``0 < u + v <= 6`` (27 bits): its sign. Add ``round(4 * log2(width / height))``, the mean
    luminance in steps of 32 and the mean Cb/Cr offsets from neutral in steps of 16, so pictures
    differing only in colour or aspect ratio get different keys. Signs of low frequencies
    (instead of pHash's comparison with the median) are the features least moved by
    recompression and resizing. ``python -m bench.image_keys`` measured 97.1% of 340
    re-encodings of 20 photos keeping the key (97.6% of 1156 on their crops) and no collision
    among 791 distinct images. A key is lost when a coefficient sits near zero, mostly in
    low-contrast textures; no stateless exact-match key reaches 100% (docs/image_keys.md).
    Twenty-seven low-frequency signs cannot see small details: pictures that differ in one
    character of text or a small object mostly share the key (the near-duplicate figures of
    ``bench.image_keys``), which is why ``exact`` is the default mode.

    Args:
        image: A PIL image, any mode and size.

    Returns:
        ``"pdct-v1:<7 hex digits>/a<aspect>/y<luma>/c<cb>,<cr>"``, never equal to an exact key.
    """
    return _pdct_key(image)


def image_key(
    data: bytes | bytearray | memoryview | Image.Image,
    mode: Literal["perceptual", "exact"] = "exact",
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> str:
    """Key an image for prefix caching: the one entry point the engine and gateway call.

    Args:
        data: Encoded image bytes (decoded with ``decode_image``) or an already decoded image.
        mode: ``"exact"`` (default; see ``exact_image_key``) or ``"perceptual"`` (see
            ``perceptual_image_key``; it can merge near-duplicates a model tells apart).
        max_pixels: Pixel limit passed to ``decode_image`` when ``data`` is bytes.
        max_aspect_ratio: Aspect-ratio limit passed to ``decode_image`` likewise.

    Returns:
        The key string, prefixed by its method (``pdct-v1:`` or ``exact-v1:``).

    Raises:
        ValueError: ``mode`` is not ``"perceptual"`` or ``"exact"``.
        TypeError: ``data`` is neither bytes-like nor a PIL image.
        InvalidImageError: ``data`` cannot be decoded (see ``decode_image``).
    """
    if mode not in ("perceptual", "exact"):
        raise ValueError(f"unknown image key mode {mode!r}; expected 'perceptual' or 'exact'")
    if isinstance(data, (bytes, bytearray, memoryview)):
        image = decode_image(data, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio)
    elif isinstance(data, Image.Image):
        image = data
    else:
        raise TypeError(f"expected encoded image bytes or a PIL image, got {type(data).__name__}")
    return perceptual_image_key(image) if mode == "perceptual" else exact_image_key(image)
