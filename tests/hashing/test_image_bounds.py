"""Image bounds are checked on the header, before Pillow opens or decodes anything.

Crafted files of a few dozen bytes claim huge or absurd sizes (the issue's 32768x1 PNG, which a
CLIP processor turns into a 2,097,152x64 image). They must be refused while ``Image.open`` and
every ``load`` fail the test if called; real photos in every format must still decode.
"""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, WebPImagePlugin
from skimage import data as skdata

from loraplex.hashing.errors import InvalidImageError
from loraplex.hashing.image_decode import (
    DEFAULT_MAX_ASPECT_RATIO,
    MAX_SIDE,
    check_image_header,
    decode_image,
)
from loraplex.hashing.image_header import read_image_header


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


def _chunk(tag: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))


def png_header(width: int, height: int, second_ihdr: tuple[int, int] | None = None) -> bytes:
    """A PNG signature, an IHDR claiming ``width x height`` (maybe a second) and a tiny IDAT."""
    ihdr = [_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))]
    if second_ihdr:
        ihdr.append(_chunk(b"IHDR", struct.pack(">IIBBBBB", *second_ihdr, 8, 2, 0, 0, 0)))
    idat = _chunk(b"IDAT", zlib.compress(b"\0" * 16))
    return b"\x89PNG\r\n\x1a\n" + b"".join(ihdr) + idat + _chunk(b"IEND", b"")


def webp_vp8x(width: int, height: int) -> bytes:
    """A RIFF/WEBP file whose VP8X chunk claims a ``width x height`` canvas (30 bytes)."""
    body = b"\0\0\0\0" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunk = b"VP8X" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def webp_vp8l(width: int, height: int) -> bytes:
    """A RIFF/WEBP file whose VP8L header claims ``width x height`` (14-bit sides)."""
    bits = (width - 1) | ((height - 1) << 14)
    body = b"\x2f" + struct.pack("<I", bits) + b"\0" * 8
    chunk = b"VP8L" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def jpeg_header(width: int, height: int, junk: bytes = b"") -> bytes:
    """SOI, an APP0, optional junk/fill bytes, an SOF0 claiming ``width x height``, SOS, EOI."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    sos = b"\xff\xda" + struct.pack(">HB", 8, 1) + b"\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + app0 + junk + sof + sos + b"\x00" * 8 + b"\xff\xd9"


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if Pillow opens or decodes anything."""

    def fail(*args, **kwargs):
        raise AssertionError("Pillow was called before the header was refused")

    monkeypatch.setattr(Image, "open", fail)
    monkeypatch.setattr(Image.Image, "load", fail)
    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "load", fail)


HOSTILE = [
    ("png 32768x1", png_header(32768, 1), "aspect ratio 32768:1 is over the limit of 20:1"),
    ("png 1x32768", png_header(1, 32768), "aspect ratio 32768:1 is over the limit of 20:1"),
    ("png 100000x100000", png_header(100_000, 100_000), "outside 1..32768"),
    ("png 8000x8000", png_header(8000, 8000), "64000000 pixels, over the limit of 50000000"),
    ("png 0x10", png_header(0, 10), "outside 1..32768"),
    ("png 21x1", png_header(21, 1), "aspect ratio 21:1 is over the limit of 20:1"),
    ("webp vp8x 16777216x16777216", webp_vp8x(2**24, 2**24), "outside 1..32768"),
    ("webp vp8x 16384x16384", webp_vp8x(16384, 16384), "268435456 pixels, over the limit"),
    ("webp vp8x 30000x2", webp_vp8x(30000, 2), "aspect ratio 15000:1"),
    ("webp vp8l 16384x16384", webp_vp8l(16384, 16384), "268435456 pixels, over the limit"),
    ("webp vp8l 16384x1", webp_vp8l(16384, 1), "aspect ratio 16384:1"),
    ("jpeg 65535x65535", jpeg_header(65535, 65535), "outside 1..32768"),
    ("jpeg 9000x9000", jpeg_header(9000, 9000), "81000000 pixels, over the limit"),
    ("jpeg 20000x100 after junk", jpeg_header(20000, 100, b"junk\xff\xff\xff"), "aspect ratio"),
    ("jpeg 0 lines", jpeg_header(640, 0), "outside 1..32768"),
]


@pytest.mark.parametrize("data,message", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_headers_are_refused_without_decoding(no_decoding, data, message):
    assert len(data) < 200
    with pytest.raises(InvalidImageError, match=message):
        decode_image(data)
    with pytest.raises(InvalidImageError, match=message):
        check_image_header(data)


def test_limits_are_parameters(no_decoding):
    with pytest.raises(InvalidImageError, match="aspect ratio 4:1 is over the limit of 3:1"):
        check_image_header(png_header(400, 100), max_aspect_ratio=3)
    with pytest.raises(InvalidImageError, match="40000 pixels, over the limit of 39999"):
        check_image_header(png_header(400, 100), max_pixels=39_999)
    assert check_image_header(png_header(400, 100)).pixels == 40_000
    assert check_image_header(png_header(20, 1)).aspect_ratio == DEFAULT_MAX_ASPECT_RATIO == 20
    wide = png_header(MAX_SIDE, MAX_SIDE // 20 + 1)  # 19.99:1, 53.7 MP
    assert check_image_header(wide, max_pixels=10**8).width == MAX_SIDE
    with pytest.raises(InvalidImageError, match="aspect ratio 20.0049:1"):
        check_image_header(png_header(MAX_SIDE, MAX_SIDE // 20), max_pixels=10**8)


def test_a_second_size_header_is_refused_before_decoding(monkeypatch):
    # The spec's IHDR says 16x16; Pillow honours the later 8000x8000 one (64 MP: under its
    # own bomb limit). The sizes differ, so the pixels are never decoded.
    data = png_header(16, 16, second_ihdr=(2000, 2000))
    assert read_image_header(data).width == 16
    assert Image.open(io.BytesIO(data)).size == (2000, 2000)

    def fail(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    with pytest.raises(InvalidImageError, match="states two sizes: 16x16 and 2000x2000"):
        decode_image(data)


@pytest.mark.parametrize(
    "junk",
    [b"", b"\xff\xff\xff", b"\x00\x01junk", b"\xff\xd0", b"\xff\x01"],
    ids=["plain", "fill", "junk", "rst", "tem"],
)
def test_jpeg_frame_header_is_found_past_fill_junk_and_standalone_markers(junk):
    assert read_image_header(jpeg_header(321, 123, junk)).format == "JPEG"
    assert (read_image_header(jpeg_header(321, 123, junk)).width,) == (321,)
    assert read_image_header(jpeg_header(321, 123, junk)).height == 123


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\xff\xd8\xff" + b"\xff" * 100_000, "no frame header"),
        (b"\xff\xd8\xff\xe0\x00\x01", "bad segment length"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 30, "no IHDR"),
        (b"RIFF\0\0\0\0WEBPVP8Z" + b"\0" * 20, "no VP8"),
        (b"GIF89a" + b"\0" * 30, "accepted format"),
    ],
    ids=["jpeg-no-sof", "jpeg-bad-length", "png-no-ihdr", "webp-unknown-chunk", "gif"],
)
def test_malformed_headers(no_decoding, data, message):
    with pytest.raises(InvalidImageError, match=message):
        decode_image(data)


def _photos() -> list[Image.Image]:
    astronaut = Image.fromarray(skdata.astronaut())
    return [
        astronaut,
        Image.fromarray(skdata.camera()),  # L
        astronaut.convert("RGBA"),
        astronaut.convert("P"),
        Image.fromarray(skdata.camera().astype(np.uint16) * 257),  # 16-bit
        astronaut.resize((400, 20)),  # 20:1, the widest accepted
        astronaut.resize((37, 701)),  # odd sizes, tall
    ]


FORMATS = [
    ("PNG", {}),
    ("JPEG", {"quality": 90}),
    ("JPEG", {"progressive": True}),
    ("WEBP", {"quality": 80}),
    ("WEBP", {"lossless": True}),
]


@pytest.mark.parametrize("fmt,params", FORMATS, ids=[f"{f}{p}" for f, p in FORMATS])
def test_header_size_agrees_with_pillow_and_real_images_decode(fmt, params):
    for image in _photos():
        if fmt == "JPEG" and image.mode in ("RGBA", "P", "I;16", "I"):
            image = image.convert("RGB")
        if fmt == "WEBP" and image.mode.startswith("I"):
            image = image.convert("L")
        data = encode(image, fmt, **params)
        header = read_image_header(data)
        assert (header.format, header.width, header.height) == (fmt, *image.size)
        assert Image.open(io.BytesIO(data)).size == image.size
        assert decode_image(data).size == image.size


def test_webp_with_exif_and_animation_uses_the_canvas_size():
    frames = [Image.new("RGB", (90, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    animated = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50)
    exif = Image.Exif()
    exif[0x010F] = "camera"
    with_exif = encode(frames[0], "WEBP", exif=exif.tobytes())
    for data in (animated, with_exif):
        assert data[12:16] == b"VP8X"
        assert (read_image_header(data).width, read_image_header(data).height) == (90, 30)
        assert decode_image(data).size == (90, 30)
