"""Image size from the first bytes of a PNG, JPEG or WEBP payload, before any decoder runs.

Every bound on an image (sides, pixel count, aspect ratio, a request's pixel budget) is checked
on these numbers before Pillow is asked to open the payload: Pillow's WEBP plugin hands the
whole file to libwebp's demuxer, which allocates the canvas (width x height x 4 bytes, twice)
when it opens, and CLIP-style processors resize the shortest side up to their input size, so a
32768x1 strip becomes a 2,097,152x64 image. ``decode_image`` then checks that Pillow found the
same size (a file with two size headers, where Pillow honours the later, is refused).

Layouts, from the format specifications:

- PNG (ISO/IEC 15948, W3C PNG 3rd ed. 5.6): 8-byte signature, then the ``IHDR`` chunk, which
  must come first: big-endian 32-bit width and height at bytes 16 and 20.
- JPEG (ITU-T T.81 B.1.1, B.2.2): ``FFD8``, then marker segments; the frame header (an SOFn
  marker: ``C0``-``CF`` except ``C4`` DHT, ``C8`` JPG, ``CC`` DAC) holds the 16-bit height and
  width after the sample precision. Fill bytes (``FF FF``), stand-alone markers (``01``,
  ``D0``-``D7``) and bytes between segments (skipped, as Pillow does) are allowed; the last frame
  header before the first scan (``DA``) counts, as in Pillow.
- WEBP (RFC 9649): ``RIFF`` size ``WEBP``, then the first chunk: ``VP8 `` (key frame start code
  ``9D 01 2A``, then 14-bit width and height), ``VP8L`` (signature ``2F``, then 14-bit width-1
  and height-1) or ``VP8X`` (24-bit canvas width-1 and height-1 at bytes 24 and 27).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.hashing.errors import InvalidImageError

__all__ = ["ImageHeader", "read_image_header"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))
#: A marker: 0xFF then a byte other than 0xFF (earlier 0xFF are fill). Constant work per start
#: position, so a search is linear even over megabytes of 0xFF.
_JPEG_MARKER = re.compile(rb"\xff([^\xff])")


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, before decoding.

    Attributes:
        format: Pillow's format name: ``"PNG"``, ``"JPEG"`` or ``"WEBP"``.
        width: Width in pixels as stored (before any EXIF rotation).
        height: Height in pixels as stored.
    """

    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        """``width * height``."""
        return self.width * self.height

    @property
    def aspect_ratio(self) -> float:
        """Longer side over shorter side (>= 1; ``inf`` for a zero side)."""
        short, long = sorted((self.width, self.height))
        return long / short if short else float("inf")


def read_image_header(data: bytes | bytearray | memoryview) -> ImageHeader:
    """Read format, width and height from the first bytes of an encoded image.

    Reads the first 32 bytes (PNG, WEBP) or the JPEG marker segments up to the first scan (a
    few kilobytes in practice; a regex search linear in the payload). Nothing is decoded and
    nothing is allocated in proportion to the claimed size.

    Args:
        data: The encoded image.

    Returns:
        The header's format and stored size (sides may be 0 here; the caller bounds them).

    Raises:
        InvalidImageError: Not a PNG, JPEG or WEBP, or the header is cut short or malformed.
    """
    buf = data if isinstance(data, bytes) else bytes(data)
    head = buf[:32]
    if head.startswith(_PNG_SIGNATURE):
        return _png(head)
    if head.startswith(b"\xff\xd8\xff"):
        return _jpeg(buf)
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return _webp(head)
    raise InvalidImageError("payload is not an image in an accepted format (PNG, JPEG, WEBP)")


def _png(head: bytes) -> ImageHeader:
    if len(head) < 24 or head[12:16] != b"IHDR":
        raise InvalidImageError("PNG header is corrupt (no IHDR chunk first)")
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return ImageHeader("PNG", width, height)


def _jpeg(buf: bytes) -> ImageHeader:
    size = None
    pos = 2
    while match := _JPEG_MARKER.search(buf, pos):  # skips junk and fill bytes, in C
        marker, pos = match[1][0], match.end()
        if marker == 0x00 or marker in _JPEG_STANDALONE:  # an escaped 0xFF, or no segment
            continue
        if marker in (0xD9, 0xDA):  # end of image, or the first scan: the header is over
            break
        length = int.from_bytes(buf[pos : pos + 2], "big")
        if length < 2:
            raise InvalidImageError("JPEG header is corrupt (bad segment length)")
        if marker in _JPEG_SOF:
            if length < 7 or pos + 7 > len(buf):
                raise InvalidImageError("JPEG header is corrupt (short frame header)")
            # length (2), sample precision (1), height (2), width (2)
            size = (int.from_bytes(buf[pos + 5 : pos + 7], "big"),
                    int.from_bytes(buf[pos + 3 : pos + 5], "big"))  # fmt: skip
        pos += length
    if size is None:
        raise InvalidImageError("JPEG header is corrupt (no frame header before the image data)")
    return ImageHeader("JPEG", *size)


def _webp(head: bytes) -> ImageHeader:
    chunk = head[12:16]
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        width = int.from_bytes(head[26:28], "little") & 0x3FFF
        height = int.from_bytes(head[28:30], "little") & 0x3FFF
        return ImageHeader("WEBP", width, height)
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return ImageHeader("WEBP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X" and len(head) >= 30:
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return ImageHeader("WEBP", width, height)
    raise InvalidImageError("WEBP header is corrupt (no VP8, VP8L or VP8X chunk first)")
