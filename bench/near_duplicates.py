"""A deterministic near-duplicate image set: pairs a vision model can tell apart.

Every group holds one base picture and one or more variants that differ from it by a change a
vision model reads: one character of rendered text, a small object added, a small region
recoloured, a small object moved. An image key used for prefix caching must give every picture
of the set its own key (docs/image_keys.md): a shared key would serve the KV computed from
one picture to a request about the other (a wrong PIN, a missing object).

Kinds, on real photos from ``skimage.data`` and on synthetic scenes, at several image sizes:

- ``text``: a string and the same string with one character changed (``PIN 1234`` /
  ``PIN 1284``), rendered in Pillow's bundled fonts (the Aileron TrueType face at three sizes,
  and the bitmap default font), at two positions, on white, on gray and on a photo; plus the
  issue's ``PIN 1234`` / ``PIN 9876`` at 12, 20 and 28 px on a 336 px square.
- ``object``: a small disc (radius 3% of the shorter side) drawn on the picture, or not.
- ``recolour``: a small square (8% of the shorter side) with its colour channels rotated.
- ``move``: the small disc drawn at two places 10% of the width apart.

Everything is generated from fixed seeds with Pillow's integer drawing, so the set is the same
on every run and machine with the same Pillow. ``near_duplicate_set(quick=True)`` is the small
set the CI tests use; the full set is what ``python -m bench.image_keys`` reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from skimage import data as skdata

#: (text, the same text with one character changed)
TEXTS = (("PIN 1234", "PIN 1284"), ("Total $45.10", "Total $45.70"), ("ROOM B214", "ROOM B216"))
#: Canvas sizes (width, height) for text and synthetic scenes.
SIZES = ((224, 224), (336, 336), (640, 480))
QUICK_SIZES = ((224, 224), (512, 384))
#: Text height as a share of the canvas height (Aileron), giving 11 to 67 px glyph boxes.
TEXT_SCALES = (0.05, 0.08, 0.14)
PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "coins", "page")
QUICK_PHOTOS = ("astronaut", "camera", "coffee")
#: Shorter side the photos are resized to (the original size is also used).
PHOTO_SIDES = (224, 336)


@dataclasses.dataclass(frozen=True)
class Group:
    """One base picture and its near-duplicates.

    Attributes:
        name: ``kind/details``, unique in the set.
        kind: ``text``, ``object``, ``recolour`` or ``move``.
        images: The base first, then the variants; RGB, all of one size, pairwise different
            pixels.
    """

    name: str
    kind: str
    images: tuple[Image.Image, ...]


@cache
def _photo(name: str) -> Image.Image:
    array = getattr(skdata, name)()
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    return Image.fromarray(np.ascontiguousarray(array[..., :3]).astype(np.uint8))


def _resized(image: Image.Image, side: int | None) -> Image.Image:
    if side is None:
        return image.copy()
    w, h = image.size
    scale = side / min(w, h)
    return image.resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS)


def _fonts(height: int) -> list[tuple[str, ImageFont.ImageFont | ImageFont.FreeTypeFont]]:
    """Pillow's bundled faces: Aileron at each TEXT_SCALES share of ``height``, and the bitmap."""
    fonts: list = [
        (f"aileron{round(s * height)}px", ImageFont.load_default(size=round(s * height)))
        for s in TEXT_SCALES
    ]
    fonts.append(("bitmap11px", ImageFont.load_default_imagefont()))
    return fonts


def render_text(
    text: str,
    size: tuple[int, int],
    font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
    position: str = "center",
    background: Image.Image | tuple[int, int, int] = (255, 255, 255),
    fill: tuple[int, int, int] = (0, 0, 0),
) -> Image.Image:
    """``text`` drawn on a ``size`` canvas (or on a copy of a picture of that size).

    Args:
        text: The string.
        size: Canvas ``(width, height)`` in pixels.
        font: A Pillow font.
        position: ``"center"`` or ``"corner"`` (top left, 6% margins).
        background: A colour or an RGB picture of ``size``.
        fill: Text colour.

    Returns:
        An RGB image of ``size``.
    """
    if isinstance(background, Image.Image):
        canvas = background.convert("RGB").copy()
    else:
        canvas = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(canvas)
    if position == "center":
        xy, anchor = (size[0] // 2, size[1] // 2), "mm"
    else:
        xy, anchor = (round(0.06 * size[0]), round(0.06 * size[1])), "la"
    if isinstance(font, ImageFont.FreeTypeFont):
        draw.text(xy, text, fill=fill, font=font, anchor=anchor)
    else:  # bitmap fonts take no anchor: place the box by hand
        box = draw.textbbox((0, 0), text, font=font)
        if anchor == "mm":
            xy = (xy[0] - (box[2] - box[0]) // 2, xy[1] - (box[3] - box[1]) // 2)
        draw.text(xy, text, fill=fill, font=font)
    return canvas


def _disc(image: Image.Image, centre: tuple[float, float], colour) -> Image.Image:
    out = image.copy()
    r = 0.03 * min(image.size)
    x, y = centre[0] * image.width, centre[1] * image.height
    ImageDraw.Draw(out).ellipse((x - r, y - r, x + r, y + r), fill=colour)
    return out


def _recoloured(image: Image.Image, corner: tuple[float, float]) -> Image.Image:
    """A square of 8% of the shorter side at ``corner`` (fractions) with R,G,B -> G,B,R."""
    a = np.asarray(image).copy()
    s = max(2, round(0.08 * min(image.size)))
    x, y = round(corner[0] * image.width), round(corner[1] * image.height)
    a[y : y + s, x : x + s] = a[y : y + s, x : x + s][..., [1, 2, 0]]
    if np.array_equal(a, np.asarray(image)):  # a gray patch: rotate channels of a tint instead
        a[y : y + s, x : x + s, 0] //= 2
    return Image.fromarray(a)


def _scene(size: tuple[int, int], seed: int) -> Image.Image:
    """A synthetic picture: a two-colour gradient and a dozen random rectangles and ellipses."""
    rng = np.random.default_rng(seed)
    w, h = size
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0.0, 1.0, w)[None, :, None]
    grad = np.rint(c0 * (1 - t) + c1 * t).astype(np.uint8)
    image = Image.fromarray(np.repeat(grad, h, axis=0))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.uniform(0, 0.8, 2) * (w, h)
        dx, dy = rng.uniform(0.05, 0.25, 2) * (w, h)
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x0 + dx, y0 + dy), fill=colour)
    return image


def _local_groups(prefix: str, base: Image.Image) -> list[Group]:
    """``object``, ``recolour`` and ``move`` variants of one picture."""
    red = (230, 30, 30) if np.asarray(base)[..., 0].mean() < 128 else (20, 20, 160)
    with_disc = _disc(base, (0.3, 0.7), red)
    return [
        Group(f"object/{prefix}", "object", (base, with_disc)),
        Group(f"recolour/{prefix}", "recolour", (base, _recoloured(base, (0.62, 0.2)))),
        Group(
            f"move/{prefix}", "move", (_disc(base, (0.5, 0.3), red), _disc(base, (0.6, 0.3), red))
        ),
    ]


def near_duplicate_set(quick: bool = False) -> list[Group]:
    """The near-duplicate groups; every image of every group differs from every other.

    Args:
        quick: The small set for CI tests and ``bench.image_keys --quick`` (about 100 images
            instead of about 300).

    Returns:
        Groups in a fixed order; ``[g.images for g in groups]`` flattened is the image set.
    """
    sizes = QUICK_SIZES if quick else SIZES
    groups = [  # the example, at three text sizes
        Group(
            f"text/pin-issue/{px}px",
            "text",
            tuple(
                render_text(s, (336, 336), ImageFont.load_default(size=px))
                for s in ("PIN 1234", "PIN 9876")
            ),
        )
        for px in (12, 20, 28)
    ]
    texts = TEXTS[:2] if quick else TEXTS
    for w, h in sizes:
        for font_name, font in _fonts(h):
            for t, (a, b) in enumerate(texts):
                position = ("center", "corner")[t % 2]
                groups.append(
                    Group(
                        f"text/{w}x{h}/{font_name}/{position}/{a}",
                        "text",
                        (
                            render_text(a, (w, h), font, position),
                            render_text(b, (w, h), font, position),
                        ),
                    )  # fmt: skip
                )
        # white on mid gray, and black on a photo
        font = ImageFont.load_default(size=round(0.08 * h))
        gray = (128, 128, 128)
        groups.append(
            Group(
                f"text/{w}x{h}/on-gray",
                "text",
                tuple(
                    render_text(s, (w, h), font, "corner", gray, (255, 255, 255)) for s in TEXTS[0]
                ),
            )  # fmt: skip
        )
        backdrop = _photo("coffee").resize((w, h), Image.Resampling.LANCZOS)
        groups.append(
            Group(
                f"text/{w}x{h}/on-photo",
                "text",
                tuple(render_text(s, (w, h), font, "center", backdrop) for s in TEXTS[1]),
            )
        )
        for seed in (1, 2) if quick else (1, 2, 3, 4):
            groups += _local_groups(f"scene{seed}/{w}x{h}", _scene((w, h), seed))
    photo_sides = (224,) if quick else (*PHOTO_SIDES, None)
    for name in QUICK_PHOTOS if quick else PHOTOS:
        for side in photo_sides:
            base = _resized(_photo(name), side)
            groups += _local_groups(f"{name}/{base.width}x{base.height}", base)
    return groups


def images_of(groups: list[Group]) -> list[tuple[str, Image.Image]]:
    """Every distinct picture of ``groups``, named ``group#index``, in order.

    A picture that appears in two groups (a base with an object variant and a recolour
    variant) is listed once, so equal keys in the result are always collisions.
    """
    seen: set[bytes] = set()
    out = []
    for g in groups:
        for i, im in enumerate(g.images):
            digest = hashlib.sha256(f"{im.size}".encode() + im.tobytes()).digest()
            if digest not in seen:
                seen.add(digest)
                out.append((f"{g.name}#{i}", im))
    return out
