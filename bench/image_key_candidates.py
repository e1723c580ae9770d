"""The perceptual key designs ``bench.image_keys`` measures, each a function of a decoded image.

Three families, from few robust bits to many fine ones:

- imagehash's ``phash``/``dhash``/``average_hash``/``whash``/``colorhash`` (hash sizes 4-32);
- ``pdct`` (``hashing.image_keys``): signs of the low-frequency 2-D DCT coefficients of a
  canonical luminance thumbnail, plus coarse aspect, luma and chroma fields; swept over the
  grid (16, 32, 64) and the highest frequency kept (``u + v <= f``), with two ablations;
- ``cell``: a local design made to see small changes. The 256 px thumbnail is cut into
  ``k x k`` cells; each cell's DCT coefficients with ``0 < u + v <= 2`` (in grey levels) are
  ternarized with a dead zone ``T`` (``-1`` below ``-T``, ``+1`` above ``T``, else ``0``), so flat
  cells (a page's background) sit far from every boundary, and appended to the ``pdct`` key.

Every key here is a stateless exact-match string, as the engine needs (keys are compared by
equality inside block hashes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import imagehash
import numpy as np
from PIL import Image, ImageFilter

from loraplex.hashing import image_keys as ik

Key = Callable[[Image.Image], str]


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix ``M`` (``M @ X @ M.T`` is the 2-D DCT of ``X``): [n, n]."""
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    m = np.cos(np.pi * (x + 0.5) * k / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


def _fields(rgb: Image.Image) -> str:
    """The ``a``/``y``/``c`` fields of ``pdct-v1`` (aspect, luma, chroma buckets)."""
    return ik._pdct_key(rgb).split("/", 1)[1]


def pdct(grid: int, max_freq: int, canon: int) -> Key:
    """``pdct`` on a ``grid x grid`` area-mean grid of a ``canon`` px Lanczos thumbnail."""
    dct = dct_matrix(grid)
    sel = [(u, v) for u in range(grid) for v in range(grid) if 0 < u + v <= max_freq]
    rows, cols = np.array([s[0] for s in sel]), np.array([s[1] for s in sel])

    def key(image: Image.Image) -> str:
        rgb = ik._to_rgb(image)
        thumb = rgb.convert("L").resize((canon, canon), Image.Resampling.LANCZOS)
        cells = thumb.convert("F").resize((grid, grid), Image.Resampling.BOX)
        coef = dct @ np.asarray(cells, dtype=np.float64) @ dct.T
        return np.packbits(coef[rows, cols] > ik._ZERO).tobytes().hex() + "/" + _fields(rgb)

    return key


def cell(cells: int, dead_zone: float, canon: int = 256) -> Key:
    """The local ``cell`` design: ternary low-frequency DCT codes per cell, plus ``pdct-v1``."""
    n = canon // cells
    dct = dct_matrix(n)
    sel = [(u, v) for u in range(3) for v in range(3) if 0 < u + v <= 2]
    rows, cols = np.array([s[0] for s in sel]), np.array([s[1] for s in sel])

    def key(image: Image.Image) -> str:
        rgb = ik._to_rgb(image)
        thumb = rgb.convert("L").resize((canon, canon), Image.Resampling.LANCZOS)
        g = np.asarray(thumb, dtype=np.float64).reshape(cells, n, cells, n).transpose(0, 2, 1, 3)
        coef = (dct @ g @ dct.T)[:, :, rows, cols] / n  # [cells, cells, 5], grey levels
        code = np.where(coef > dead_zone, 2, np.where(coef < -dead_zone, 0, 1)).astype(np.uint8)
        return ik._pdct_key(rgb) + "/" + code.tobytes().hex()

    return key


def _normalized(image: Image.Image, size: int = 64, blur: float = 1.0) -> Image.Image:
    small = image.convert("L").resize((size, size), Image.Resampling.LANCZOS)
    return small.filter(ImageFilter.GaussianBlur(blur))


def _pdct_ablation(image: Image.Image, lanczos: bool, median: bool) -> str:
    """``pdct f<=6`` with one choice undone: no Lanczos thumbnail, or pHash's median threshold."""
    rgb = ik._to_rgb(image)
    luma = rgb.convert("L")
    if lanczos:
        luma = luma.resize((ik._CANON, ik._CANON), Image.Resampling.LANCZOS)
    grid = np.asarray(luma.convert("F").resize((ik._GRID, ik._GRID), Image.Resampling.BOX))
    coef = ik._DCT @ grid.astype(np.float64) @ ik._DCT.T
    low = np.array([coef[u, v] for u in range(7) for v in range(7 - u) if u + v > 0])
    bits = "".join("1" if c > (np.median(low) if median else ik._ZERO) else "0" for c in low)
    return bits + "/" + _fields(rgb)


def candidates(quick: bool) -> dict[str, tuple[Key, str]]:
    """Name -> (key function on a decoded RGB image, nominal size)."""
    ih = imagehash
    c: dict[str, tuple[Key, str]] = {}
    for hs in (8, 16) if quick else (4, 8, 16, 32):
        c[f"phash{hs}"] = (lambda im, s=hs: str(ih.phash(im, s)), f"{hs * hs}b")
        if not quick and hs < 32:
            c[f"dhash{hs}"] = (lambda im, s=hs: str(ih.dhash(im, s)), f"{hs * hs}b")
            c[f"average_hash{hs}"] = (lambda im, s=hs: str(ih.average_hash(im, s)), f"{hs * hs}b")
    for hs in (4,) if quick else (4, 8):
        c[f"whash{hs}"] = (lambda im, s=hs: str(ih.whash(im, s)), f"{hs * hs}b")
    if not quick:
        c["colorhash3"] = (lambda im: str(ih.colorhash(im, 3)), "42b")
        c["phash8+colorhash3"] = (lambda im: f"{ih.phash(im)}{ih.colorhash(im, 3)}", "106b")
        c["whash4+colorhash3"] = (lambda im: f"{ih.whash(im, 4)}{ih.colorhash(im, 3)}", "58b")
        c["phash8(64px,blur1)"] = (lambda im: str(ih.phash(_normalized(im))), "64b")
        c["whash4(64px,blur1)"] = (lambda im: str(ih.whash(_normalized(im), 4, 64)), "16b")
    for f in (5, 6, 7) if quick else (4, 5, 6, 7, 8):
        bits = (f + 1) * (f + 2) // 2 - 1
        c[f"pdct f<={f}"] = (lambda im, f=f: ik._pdct_key(im, f), f"{bits}b+a,y,c")
    for grid, f, canon in ((16, 10, 128), (16, 30, 128), (32, 20, 256), (64, 40, 256)):
        if quick and grid == 64:
            continue
        bits = sum(1 for u in range(grid) for v in range(grid) if 0 < u + v <= f)
        c[f"pdct{grid} f<={f}"] = (pdct(grid, f, canon), f"{bits}b+a,y,c")
    for k, t in ((4, 8), (8, 8), (8, 32)) if not quick else ((8, 8),):
        c[f"cell{k}x{k} T{t}"] = (cell(k, t), f"{5 * k * k}t+pdct")
    if not quick:
        c["pdct f<=6 luma only"] = (lambda im: ik._pdct_key(im, 6, color=False), "27b+a,y")
        c["pdct f<=6 no Lanczos"] = (lambda im: _pdct_ablation(im, False, False), "27b+a,y,c")
        c["pdct f<=6 median thr"] = (lambda im: _pdct_ablation(im, True, True), "27b+a,y,c")
    return c
