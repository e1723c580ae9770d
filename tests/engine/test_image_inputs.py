"""A request's images are bounded from their headers before any of them is decoded.

The issue's case: two 2.5 KB chat requests holding eight 32768x1 PNGs each stalled another
tenant for 88 s (CLIP's shortest-edge resize made each a 2,097,152x64 image). Every bound (count,
sides, pixels, aspect ratio, the request's total pixels) is a ``ValueError`` naming the message
part, raised while ``Image.open`` and ``load`` fail the test if called. Accepted images still
give exactly transformers' prompt ids and pixels.
"""

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageFile, WebPImagePlugin

from loraplex.engine.client.inputs import InputProcessor
from loraplex.engine.client.processing import load_processor
from loraplex.engine.config import EngineConfig
from loraplex.hashing.errors import InvalidImageError
from tests.engine.conftest import photo
from tests.hashing.test_image_bounds import png_header, webp_vp8x

TEMPLATE = (
    "{% for m in messages %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}"
)


class _Template:
    """Only what ``InputProcessor.normalize`` reads: a template that iterates over parts."""

    chat_template = TEMPLATE


def inputs(**bounds) -> InputProcessor:
    return InputProcessor(_Template(), image_token_id=1, num_image_tokens=4, **bounds)


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def message(*payloads: bytes | str) -> list[dict]:
    content = [{"type": "text", "text": "Read the images."}]
    for p in payloads:
        content.append(
            {"type": "image_url", "image_url": {"url": p if isinstance(p, str) else url(p)}}
        )
    return [{"role": "user", "content": content}]


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


GOOD = [png(photo("astronaut", 32)), png(photo("coffee", 32))]  # encoded before any patching


@pytest.fixture
def no_decoding(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("an image was opened or decoded before the bounds were checked")

    monkeypatch.setattr(Image, "open", fail)
    monkeypatch.setattr(Image.Image, "load", fail)
    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "load", fail)


def test_the_issue_request_is_refused_without_decoding(no_decoding):
    strip = png_header(32768, 1)
    body = json.dumps({"messages": message(*[strip] * 8)})
    assert len(body) < 2_500  # the issue's 2.5 KB request
    with pytest.raises(
        ValueError,
        match=r"messages\[0\]\.content\[1\]: image is 32768x1: its "
        r"aspect ratio 32768:1 is over the limit of 20:1",
    ):
        inputs().normalize(message(*[strip] * 8))
    # the third image's header is refused before the two good ones before it are decoded
    with pytest.raises(InvalidImageError, match=r"messages\[0\]\.content\[3\]: .* 1x32768"):
        inputs().normalize(message(*GOOD, png_header(1, 32768)))


@pytest.mark.parametrize(
    "payload,message_",
    [
        (png_header(100_000, 100_000), "100000x100000 are outside 1..32768"),
        (png_header(8000, 8000), "64000000 pixels, over the limit of 50000000"),
        (webp_vp8x(16384, 16384), "268435456 pixels"),
    ],
    ids=["png-10-gigapixels", "png-64-megapixels", "webp-canvas-268-megapixels"],
)
def test_huge_headers_are_refused_without_decoding(no_decoding, payload, message_):
    with pytest.raises(InvalidImageError, match=r"messages\[0\]\.content\[1\]: .*" + message_):
        inputs().normalize(message(payload))


def test_too_many_images_is_refused_before_reading_the_next_payload(no_decoding):
    small = png_header(10, 10)
    # the ninth is not even base64: the count is refused before it is read (the message may
    # name the part or give the count)
    with pytest.raises(ValueError, match=r"too many images: .*9.* at most 8"):
        inputs().normalize(message(*[small] * 8, "data:image/png;base64,@@@"))
    with pytest.raises(ValueError, match="at most 2"):
        inputs(max_images=2).normalize(message(small, small, small))


def test_the_request_pixel_budget_is_checked_on_headers(no_decoding):
    quarter = png_header(5000, 5000)  # 25 MP each: under the per-image 50 MP
    budget = "the request's 3 images have 75000000 pixels in all, over the limit of 64000000"
    with pytest.raises(ValueError, match="too many image pixels: " + budget):
        inputs().normalize(message(quarter, quarter, quarter))
    with pytest.raises(ValueError, match="over the limit of 30000 per request"):
        inputs(max_request_image_pixels=30_000).normalize(message(*[png_header(100, 100)] * 4))


def test_a_bad_image_is_named_by_its_part():
    data = png(photo("camera", 64))
    with pytest.raises(
        InvalidImageError,
        match=r"messages\[0\]\.content\[2\]: PNG image data is "
        "truncated or corrupt",
    ):
        inputs().normalize(message(data, data[: len(data) // 2]))
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: image_url must be a data"):
        inputs().normalize(message("http://example.com/cat.png"))


def test_normal_photos_pass_in_order():
    a, b = photo("astronaut", 96), photo("coffee").resize((400, 20))  # 20:1 is accepted
    _, images = inputs().normalize(message(png(a), png(b)))
    assert [im.size for im in images] == [(96, 96), (400, 20)]
    assert images[0].tobytes() == a.tobytes() and images[1].tobytes() == b.tobytes()


def test_bounds_are_engine_config_fields():
    config = EngineConfig(model="m")
    assert (config.max_images, config.max_image_pixels, config.max_request_image_pixels) == (
        8,
        50_000_000,
        64_000_000,
    )
    assert config.max_image_aspect_ratio == 20.0
    with pytest.raises(ValueError, match="max_image_aspect_ratio must be at least 1"):
        EngineConfig(model="m", max_image_aspect_ratio=0.5)
    with pytest.raises(ValueError, match="max_request_image_pixels must be at least"):
        EngineConfig(model="m", max_request_image_pixels=10, max_image_pixels=11)


@pytest.fixture(scope="module")
def llava_inputs(tiny_llava_dir):
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(tiny_llava_dir)
    config = json.loads((Path(tiny_llava_dir) / "config.json").read_text())
    token = config["image_token_id"] if "image_token_id" in config else config["image_token_index"]
    probe = hf.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": photo("camera", 32)}]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    model = type(
        "Model",
        (),
        {"image_token_id": token, "num_image_tokens": probe["input_ids"][0].count(token)},
    )
    _, processor = load_processor(tiny_llava_dir, model, "exact", max_image_aspect_ratio=20.0)
    return hf, processor


@pytest.mark.parametrize("sizes", [[(96, 96)], [(400, 20), (20, 400), (123, 77)]])
def test_accepted_images_give_transformers_ids_and_pixels(llava_inputs, sizes):
    hf, processor = llava_inputs
    pictures = [photo("astronaut").resize(s) for s in sizes]
    ours = processor(message(*[png(p) for p in pictures]))
    content = [{"type": "text", "text": "Read the images."}]
    content += [{"type": "image", "image": p} for p in pictures]
    ref = hf.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    pixels = torch.stack([image.pixel_values for image in ours.images])
    assert torch.equal(pixels, ref["pixel_values"])
    assert all(image.key.startswith("exact-v1:") for image in ours.images)


def test_perceptual_mode_is_still_selectable(llava_inputs, tiny_llava_dir):
    hf, exact = llava_inputs
    n = exact.num_image_tokens
    perceptual = InputProcessor(
        hf, image_token_id=exact.image_token_id, num_image_tokens=n, mm_hash="perceptual"
    )
    picture = photo("astronaut", 128)
    jpeg = io.BytesIO()
    picture.save(jpeg, "JPEG", quality=90)
    as_png, as_jpeg = message(png(picture)), message(jpeg.getvalue())
    assert perceptual(as_png).images[0].key == perceptual(as_jpeg).images[0].key
    assert perceptual(as_png).images[0].key.startswith("pdct-v1:")
    assert exact(as_png).images[0].key != exact(as_jpeg).images[0].key
