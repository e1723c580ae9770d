"""The image decoder's bounds (:mod:`hashing.image_decode`), with no import of their own.

``engine.config`` and the CLI take their defaults from here without loading numpy and Pillow
(``loraplex serve`` binds its address before anything heavy is imported).
"""

from __future__ import annotations

#: Formats the decoder will open (the gateway accepts png/jpeg/webp data URLs). JPEG includes
#: MPO (multi-picture JPEGs from phones; the first picture is used). GIF, BMP, TIFF, ICO, EPS
#: and the rest are refused: less parser surface, and nothing upstream sends them.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")

#: 50 megapixels: above any common camera output (48/50 MP phone sensors, 45 MP full-frame
#: bodies), below Pillow's own 89.5 MP warning threshold, and it caps one decoded RGB image at
#: 150 MB (200 MB with alpha). Vision towers see a few hundred thousand pixels at most.
DEFAULT_MAX_PIXELS = 50_000_000

#: Longest accepted side; a 1 x 40,000,000 strip is under the pixel limit but absurd.
MAX_SIDE = 32_768

#: Longer side over shorter side. CLIP-style image processors (LLaVA's) resize the shorter side
#: to their input size S (336 for LLaVA-1.5, 64 for the built-in tiny model) keeping the aspect
#: ratio, then crop the centre S x S: the resized intermediate has ``ratio * S**2`` pixels
#: whatever the image's own size, so a 32768x1 strip becomes 2,097,152 x 64 (S = 64) or
#: 11,010,048 x 336. At 20:1 the intermediate is at most 20 crops' worth (2.26 MP, 6.8 MB of RGB
#: at S = 336), less than decoding a 3 MP photo, and it admits panoramas (2:1 to 12:1) and a
#: phone's scrolling screenshot (1080 x 20,000, 18.5:1). The model sees only the centre crop.
DEFAULT_MAX_ASPECT_RATIO = 20.0

#: Most images in one request (``engine.client.inputs.InputProcessor``).
DEFAULT_MAX_IMAGES = 8

#: Pixels of all of one request's images together, from their headers: five 12 MP phone
#: photos or eight 8 MP ones; at most 192 MB of decoded RGB per request (one 50 MP photo still
#: fits).
DEFAULT_MAX_REQUEST_IMAGE_PIXELS = 64_000_000
