"""Decoding untrusted PNG, JPEG and WEBP payloads into the RGB pixels a model sees, within bounds.

Every bound is checked on the size the header states (``hashing.image_header``) before Pillow
opens the payload: the sides, the pixel count and the aspect ratio. Then Pillow opens it with
only the accepted formats, the size it found is compared with the header's, and the pixels are
decoded in full. docs/image_keys.md ("Decoding rules and limits") has the reasons and numbers.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from loraplex.hashing.errors import InvalidImageError
from loraplex.hashing.image_header import ImageHeader, read_image_header
from loraplex.hashing.image_limits import (
    ACCEPTED_FORMATS,
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_REQUEST_IMAGE_PIXELS,
    MAX_SIDE,
)

__all__ = [
    "ACCEPTED_FORMATS",
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_MAX_REQUEST_IMAGE_PIXELS",
    "MAX_SIDE",
    "check_image_header",
    "decode_image",
    "to_rgb",
]

_BACKGROUND = (255, 255, 255)  # transparent pixels are composited on white
_BOMB = "image is too large: it fails Pillow's decompression-bomb check"


def check_image_header(
    data: bytes | bytearray | memoryview,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> ImageHeader:
    """Read an encoded image's header and check its size, without decoding anything.

    Args:
        data: The encoded image.
        max_pixels: Largest accepted ``width * height``.
        max_aspect_ratio: Largest accepted longer side over shorter side.

    Returns:
        The header (format, stored width and height).

    Raises:
        InvalidImageError: The payload is empty, not a PNG, JPEG or WEBP, its header is
            malformed, or its size is out of bounds: a side outside ``1..MAX_SIDE``, an aspect
            ratio over ``max_aspect_ratio``, or more than ``max_pixels`` pixels.
    """
    if not data:
        raise InvalidImageError("image payload is empty")
    header = read_image_header(data)
    width, height = header.width, header.height
    if width < 1 or height < 1 or width > MAX_SIDE or height > MAX_SIDE:
        raise InvalidImageError(
            f"image dimensions {width}x{height} are outside 1..{MAX_SIDE} pixels per side"
        )
    if header.aspect_ratio > max_aspect_ratio:
        raise InvalidImageError(
            f"image is {width}x{height}: its aspect ratio {header.aspect_ratio:.6g}:1 is over "
            f"the limit of {max_aspect_ratio:g}:1"
        )
    if header.pixels > max_pixels:
        raise InvalidImageError(f"image has {header.pixels} pixels, over the limit of {max_pixels}")
    return header


def _orientation(image: Image.Image) -> int:
    """EXIF orientation (1-8); 1 when absent or unparsable (a viewer shows the raw pixels)."""
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # malformed EXIF must not make a viewable picture unkeyable
        return 1


def to_rgb(image: Image.Image) -> Image.Image:
    """Apply EXIF orientation and convert any mode to 8-bit RGB (alpha composited on white).

    Args:
        image: A PIL image, any mode.

    Returns:
        An ``RGB`` image (the same object when nothing needed changing).
    """
    if _orientation(image) in range(2, 9):
        image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I"):  # 16-bit PNG: scale to 8 bits (convert("L") would clip)
        wide = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> Image.Image:
    """Decode an encoded PNG, JPEG or WEBP image into the RGB pixels a viewer would show.

    The size in the header is checked before Pillow opens the payload (``check_image_header``);
    Pillow must then find the same format and size, and the whole image is decoded (``load()``)
    so truncation is detected (``ImageFile.LOAD_TRUNCATED_IMAGES`` is never enabled here). The
    EXIF orientation is applied, 16-bit samples are scaled to 8 bits, alpha and palette
    transparency are composited on white, and every mode becomes ``RGB`` (``to_rgb``). Animated
    images give their first frame. ICC profiles are not applied: pixels are keyed as stored.

    Args:
        data: The encoded image (bytes-like).
        max_pixels: Largest accepted ``width * height``; defaults to ``DEFAULT_MAX_PIXELS``.
        max_aspect_ratio: Largest accepted longer side over shorter side; defaults to
            ``DEFAULT_MAX_ASPECT_RATIO``.

    Returns:
        A fully loaded ``PIL.Image.Image`` in mode ``RGB``.

    Raises:
        InvalidImageError: The payload is empty, not an image, in a format other than
            ``ACCEPTED_FORMATS``, truncated or corrupt, has a zero or absurd dimension, an
            aspect ratio over ``max_aspect_ratio``, more than ``max_pixels`` pixels, or a size
            that Pillow reads differently from its header (Pillow's decompression-bomb error
            and, where warnings are escalated, its warning, are reported the same way; neither
            the process-wide ``Image.MAX_IMAGE_PIXELS`` nor the warning filters are changed).
            The message names the problem and never echoes the payload.
    """
    header = check_image_header(data, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio)
    try:
        image = Image.open(io.BytesIO(bytes(data)), formats=[header.format])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidImageError(_BOMB) from exc
    except UnidentifiedImageError as exc:
        raise InvalidImageError(f"{header.format} image header is corrupt") from exc
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        raise InvalidImageError(f"image header is corrupt ({type(exc).__name__})") from exc
    if image.size != (header.width, header.height):  # two size headers, read differently
        raise InvalidImageError(
            f"{header.format} image header is corrupt (it states two sizes: "
            f"{header.width}x{header.height} and {image.width}x{image.height})"
        )
    try:
        image.load()  # decodes every pixel: a truncated stream raises here
        return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidImageError(_BOMB) from exc
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, MemoryError) as exc:
        raise InvalidImageError(
            f"{image.format} image data is truncated or corrupt ({type(exc).__name__})"
        ) from exc
