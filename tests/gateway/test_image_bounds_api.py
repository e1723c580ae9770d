"""The issue's image request over HTTP: 400 naming the part, nothing decoded, others unaffected.

Two 2.5 KB chat requests holding eight 32768x1 PNGs each stalled another tenant for 88 s
before the bounds; now each is refused from the images' headers (``Image.open`` would fail the
test if the server called it), and a normal image request of another tenant still completes.
"""

import base64

from PIL import Image

from tests.gateway.chat_support import data_url, image_part, photo, user
from tests.gateway.test_app_basics import assert_openai_error
from tests.hashing.test_image_bounds import png_header, webp_vp8x

MODEL = "tiny-llava"


def chat(live, key, *urls):
    messages = [user(*[image_part(u) for u in urls], "what is this?")]
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": messages}
    with live.client(key) as c:
        return c.post("/v1/chat/completions", json=body)


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_huge_and_absurd_image_headers_are_400_without_decoding(live, monkeypatch):
    hostile = live.create_tenant("strips")["api_key"]
    bystander = live.create_tenant("bystander")["api_key"]
    good = data_url(photo("astronaut", 64))  # encoded before Pillow is patched

    calls = []
    real_open = Image.open

    def watched_open(*args, **kwargs):
        calls.append(args)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", watched_open)
    cases = [
        ([url(png_header(32768, 1))] * 8, "messages[0].content[0]: image is 32768x1"),
        ([url(png_header(1, 32768))], "aspect ratio 32768:1 is over the limit of 20:1"),
        ([url(png_header(100_000, 100_000))], "100000x100000 are outside 1..32768"),
        ([url(webp_vp8x(16384, 16384), "image/webp")], "268435456 pixels"),
        ([url(png_header(5000, 5000))] * 3, "too many image pixels"),
        ([url(png_header(8, 8))] * 9, "too many images"),
    ]
    for urls, message in cases:
        r = chat(live, hostile, *urls)
        err = assert_openai_error(r, 400)
        assert err["param"].startswith("messages") and message in err["message"], err
        if err["message"].startswith("messages["):  # the part the message names
            assert err["message"].startswith(err["param"] + ":"), err
    assert calls == []  # no payload reached Pillow

    r = chat(live, bystander, good)
    assert r.status_code == 200, r.text
    assert len(calls) == 1
