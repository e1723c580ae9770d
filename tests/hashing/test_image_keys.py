"""Image keys: re-encodings keep the perceptual key, bad payloads raise InvalidImageError.

``exact`` is the default mode (tests/hashing/test_near_duplicates.py has why); the perceptual
tests below ask for ``"perceptual"`` explicitly.

The photos are scikit-image's bundled ones. The perceptual tests use photos whose key has a wide
margin (no DCT coefficient or bucketed mean near a boundary); the keep rate over all photos is
measured by ``python -m bench.image_keys``, not asserted here.
"""

import io
import warnings

import numpy as np
import pytest
from PIL import Image, ImageFile
from skimage import data as skdata

from loraplex.hashing.errors import InvalidImageError
from loraplex.hashing.image_keys import (
    DEFAULT_MAX_PIXELS,
    decode_image,
    exact_image_key,
    image_key,
    perceptual_image_key,
)
from tests.media import png_bomb

ROBUST = ("astronaut", "camera", "coins", "immunohistochemistry")
DISTINCT = ("astronaut", "camera", "coins", "immunohistochemistry", "coffee", "rocket", "cat",
            "moon", "page", "text", "clock", "brick", "grass", "gravel")  # fmt: skip


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    return {name: Image.fromarray(getattr(skdata, name)()) for name in DISTINCT}


def pkey(data) -> str:
    """The perceptual key (``exact`` is the default mode)."""
    return image_key(data, "perceptual")


png_header = png_bomb  # a valid PNG signature and IHDR claiming any size, ~70 bytes


# --- perceptual mode: re-encodings keep the key -------------------------------------------------


@pytest.mark.parametrize("name", ROBUST)
def test_perceptual_survives_jpeg_q75(photos, name):
    png = encode(photos[name], "PNG")
    assert pkey(encode(photos[name], "JPEG", quality=75)) == pkey(png)


@pytest.mark.parametrize("name", ROBUST)
@pytest.mark.parametrize("factor", [0.95, 1.05])
def test_perceptual_survives_five_percent_resize(photos, name, factor):
    im = photos[name]
    size = (round(im.width * factor), round(im.height * factor))
    resized = encode(im.resize(size, Image.Resampling.LANCZOS), "PNG")
    assert pkey(resized) == pkey(encode(im, "PNG"))


@pytest.mark.parametrize("name", ROBUST)
def test_perceptual_survives_png_jpeg_round_trips(photos, name):
    png = encode(photos[name], "PNG")
    jpeg = encode(photos[name], "JPEG", quality=85)
    back_to_png = encode(decode_image(jpeg), "PNG")
    webp = encode(photos[name], "WEBP", quality=80)
    assert pkey(png) == pkey(jpeg) == pkey(back_to_png) == pkey(webp)


def strip_exif(jpeg: bytes) -> bytes:
    """Remove the APP1 Exif segments of a JPEG without touching the compressed pixels."""
    out, pos = bytearray(jpeg[:2]), 2
    while jpeg[pos + 1] != 0xDA:  # segments before start-of-scan
        length = int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        if not (jpeg[pos + 1] == 0xE1 and jpeg[pos + 4 : pos + 10] == b"Exif\0\0"):
            out += jpeg[pos : pos + 2 + length]
        pos += 2 + length
    return bytes(out + jpeg[pos:])


@pytest.mark.parametrize("name", ROBUST)
def test_keys_survive_exif_stripping(photos, name):
    exif = Image.Exif()
    exif[0x010F] = "test camera"  # Make
    exif[0x0131] = "loraplex tests"  # Software
    with_exif = encode(photos[name], "JPEG", quality=90, exif=exif.tobytes())
    stripped = strip_exif(with_exif)
    assert b"Exif\0\0" in with_exif and b"Exif\0\0" not in stripped
    assert pkey(with_exif) == pkey(stripped) == pkey(encode(photos[name], "PNG"))
    assert image_key(with_exif, "exact") == image_key(stripped, "exact")  # same pixels
    png_exif = encode(photos[name], "PNG", exif=exif.tobytes())
    assert image_key(png_exif, "exact") == image_key(encode(photos[name], "PNG"), "exact")


def test_distinct_photos_get_distinct_perceptual_keys(photos):
    keys = {name: pkey(encode(im, "PNG")) for name, im in photos.items()}
    assert len(set(keys.values())) == len(keys), keys
    tiles = []  # quadrants of two photos: 8 more distinct pictures
    for name in ("astronaut", "coffee"):
        im = photos[name]
        w, h = im.width // 2, im.height // 2
        tiles += [im.crop((x, y, x + w, y + h)) for x in (0, w) for y in (0, h)]
    all_keys = list(keys.values()) + [perceptual_image_key(t) for t in tiles]
    assert len(set(all_keys)) == len(all_keys)


@pytest.mark.parametrize("name", ["astronaut", "coffee"])
def test_colour_only_changes_give_new_perceptual_keys(photos, name):
    im = photos[name]
    gray = im.convert("L").convert("RGB")
    swapped = Image.fromarray(np.asarray(im)[..., ::-1].copy())
    keys = {perceptual_image_key(x) for x in (im, gray, swapped)}
    assert len(keys) == 3


# --- exact mode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["astronaut", "camera"])
def test_exact_key_changes_under_jpeg_but_not_lossless_reencoding(photos, name):
    im = photos[name]
    png = encode(im, "PNG")
    assert image_key(encode(im, "PNG", compress_level=1), "exact") == image_key(png, "exact")
    assert image_key(encode(im, "WEBP", lossless=True), "exact") == image_key(png, "exact")
    assert image_key(encode(im, "JPEG", quality=95), "exact") != image_key(png, "exact")


def test_exact_key_changes_with_one_pixel(photos):
    a = np.asarray(photos["astronaut"]).copy()
    before = exact_image_key(Image.fromarray(a))
    a[100, 200, 1] ^= 1
    assert exact_image_key(Image.fromarray(a)) != before


def test_exif_rotated_image_keys_like_its_transposed_pixels(photos):
    im = photos["astronaut"]
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; a viewer turns it 90 degrees clockwise
    stored = encode(im.transpose(Image.Transpose.ROTATE_90), "PNG", exif=exif.tobytes())
    decoded = decode_image(stored)
    assert decoded.size == im.size
    assert np.array_equal(np.asarray(decoded), np.asarray(im))
    for mode in ("perceptual", "exact"):
        assert image_key(stored, mode) == image_key(encode(im, "PNG"), mode)


# --- modes, keys' shape --------------------------------------------------------------------------


def test_keys_are_deterministic_strings_and_modes_never_equal(photos):
    png = encode(photos["camera"], "PNG")
    e1, e2 = image_key(png), image_key(png, "exact")  # exact is the default mode
    p1, p2 = image_key(png, "perceptual"), image_key(png, mode="perceptual")
    assert isinstance(p1, str) and isinstance(e1, str)
    assert p1 == p2 and e1 == e2 and p1 != e1
    assert p1.startswith("pdct-v1:") and e1.startswith("exact-v1:")
    assert image_key(decode_image(png)) == e1  # bytes and decoded image agree
    assert image_key(decode_image(png), "perceptual") == p1
    assert image_key(bytearray(png)) == e1 and image_key(memoryview(png), "perceptual") == p1


def test_unknown_mode_and_wrong_type():
    with pytest.raises(ValueError, match="unknown image key mode"):
        image_key(b"anything", "fuzzy")  # mode is checked before decoding
    with pytest.raises(TypeError):
        image_key("not bytes")  # type: ignore[arg-type]


def test_alpha_is_composited_on_white():
    rgba = np.zeros((32, 48, 4), dtype=np.uint8)
    rgba[..., :3] = np.random.default_rng(0).integers(0, 256, (32, 48, 3))  # hidden colours
    transparent = encode(Image.fromarray(rgba, "RGBA"), "PNG")
    white = encode(Image.new("RGB", (48, 32), (255, 255, 255)), "PNG")
    assert decode_image(transparent).mode == "RGB"
    assert image_key(transparent, "exact") == image_key(white, "exact")
    assert image_key(Image.fromarray(rgba, "RGBA"), "exact") == image_key(white, "exact")


def test_sixteen_bit_png_is_scaled_not_clipped():
    ramp = (np.arange(256, dtype=np.uint16) * 257).reshape(16, 16)  # 0..65535
    decoded = decode_image(encode(Image.fromarray(ramp), "PNG"))
    assert decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded)[..., 0], ramp // 257)


def test_palette_and_grayscale_images_decode_to_rgb():
    palette = Image.new("P", (20, 10), 3)
    palette.putpalette([0, 0, 0, 10, 20, 30, 40, 50, 60, 70, 80, 90] * 64)
    gray = Image.new("L", (20, 10), 128)
    for im in (palette, gray):
        decoded = decode_image(encode(im, "PNG"))
        assert decoded.mode == "RGB" and decoded.size == (20, 10)
    assert np.asarray(decode_image(encode(palette, "PNG")))[0, 0].tolist() == [70, 80, 90]


# --- bad payloads --------------------------------------------------------------------------------


def test_empty_payload():
    with pytest.raises(InvalidImageError, match="empty"):
        decode_image(b"")
    with pytest.raises(InvalidImageError, match="empty"):
        image_key(b"", "exact")


def test_non_image_payload_is_named_and_not_echoed():
    payload = b"SECRET-PAYLOAD " + np.random.default_rng(1).bytes(300)
    with pytest.raises(InvalidImageError, match="not an image") as info:
        image_key(payload)
    assert "SECRET" not in str(info.value) and len(str(info.value)) < 120


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_image(photos, fmt):
    data = encode(photos["camera"], fmt)
    with pytest.raises(InvalidImageError, match="truncated|corrupt"):
        decode_image(data[: len(data) // 2])


def test_truncated_images_are_never_loaded_leniently():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_decompression_bomb_header_is_refused_quickly():
    bomb = png_header(100_000, 100_000)  # 10 gigapixels claimed in 70 bytes
    assert len(bomb) < 100
    max_before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidImageError, match="100000x100000 are outside 1..32768"):
        decode_image(bomb)  # refused from the header, before Pillow's own bomb check
    assert Image.MAX_IMAGE_PIXELS == max_before  # the process-wide limit is left alone


def test_pixel_limit_is_checked_before_decoding():
    # 64 megapixels: under Pillow's own limit, over ours; the pixels are never decoded.
    with pytest.raises(InvalidImageError, match="64000000 pixels, over the limit of 50000000"):
        decode_image(png_header(8000, 8000))
    assert DEFAULT_MAX_PIXELS == 50_000_000


def test_max_pixels_is_respected(photos):
    png = encode(Image.new("RGB", (100, 100), (1, 2, 3)), "PNG")
    assert decode_image(png, max_pixels=10_000).size == (100, 100)
    with pytest.raises(InvalidImageError, match="10000 pixels, over the limit of 9999"):
        decode_image(png, max_pixels=9_999)
    with pytest.raises(InvalidImageError, match="over the limit"):
        image_key(png, "exact", max_pixels=9_999)


def test_escalated_pillow_bomb_warning_becomes_invalid_image():
    # 100 MP is over Pillow's warning threshold (89.5 MP), under its error threshold.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(InvalidImageError, match="too large"):
            decode_image(png_header(10_000, 10_000), max_pixels=10**9)


def test_absurd_dimensions():
    with pytest.raises(InvalidImageError, match="outside 1..32768"):
        decode_image(png_header(40_000, 1))  # 40k pixels, but a 40,000-pixel side
    with pytest.raises(InvalidImageError):
        decode_image(png_header(0, 10))


@pytest.mark.parametrize("fmt", ["TIFF", "BMP", "GIF", "ICO"])
def test_unsupported_formats_are_refused(fmt):
    data = encode(Image.new("RGB", (16, 16), (10, 20, 30)), fmt)
    with pytest.raises(InvalidImageError, match="accepted format"):
        decode_image(data)
