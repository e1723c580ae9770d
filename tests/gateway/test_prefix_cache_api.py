"""Prefix caching as a client sees it: ``usage.prompt_tokens_details.cached_tokens``.

Within one tenant, a shared prefix is served from the cache up to its last full block (16
tokens); another tenant (whatever it sends as ``cache_salt``) and another adapter get nothing;
an image's blocks are reused only for the same pixels (exact image keys, the default): a lossless
copy hits them, a JPEG copy or a picture of another PIN does not.
"""

from PIL import ImageFont

from bench.near_duplicates import render_text
from tests.gateway.chat_support import (
    common_prefix,
    data_url,
    full_blocks,
    image_part,
    long_text,
    photo,
    prompt_ids,
    register_adapter,
    user,
)

MODEL = "tiny-llava"


def cached(client, messages, model=MODEL, **extra):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, **extra
    )
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def test_long_system_prompt_is_cached_per_tenant_and_adapter(live, engine_client, tiny_adapter):
    system = {"role": "system", "content": "You are a guide. " + long_text(180, seed=1)}
    first = [system, {"role": "user", "content": "Which river is longest?"}]
    second = [system, {"role": "user", "content": "Name a mountain near a city."}]
    ids1, ids2 = prompt_ids(engine_client, first), prompt_ids(engine_client, second)
    shared = common_prefix(ids1, ids2)
    assert 150 < shared < len(ids2) and full_blocks(shared) >= 9 * 16

    a = live.create_tenant("a")
    b = live.create_tenant("b")
    client_a = live.openai(a["api_key"])
    assert cached(client_a, first) == (0, len(ids1))  # nothing from any earlier test
    # the second request reuses every full block of the shared system prompt, no more
    assert cached(client_a, second) == (full_blocks(shared), len(ids2))

    # another tenant shares nothing, even sending the first tenant's id as a salt
    client_b = live.openai(b["api_key"])
    assert cached(client_b, second, extra_body={"cache_salt": a["id"]}) == (0, len(ids2))

    # another adapter (same tenant) shares nothing with the base model's blocks
    register_adapter(live, a["id"], "guide-lora", tiny_adapter)
    assert cached(client_a, second, model="guide-lora")[0] == 0
    assert cached(client_a, first, model="guide-lora")[0] == full_blocks(shared)

    with live.client(a["api_key"]) as c:
        by_model = {m["model"]: m for m in c.get("/v1/usage").json()["by_model"]}
    assert by_model[MODEL]["cached_tokens"] == full_blocks(shared)
    assert by_model["guide-lora"]["cached_tokens"] == full_blocks(shared)


def test_image_blocks_are_reused_only_for_the_same_pixels(live, engine_client):
    """Exact image keys (the default): a lossless copy hits, a JPEG copy or a changed PIN not."""
    tenant = live.create_tenant("photos")
    client = live.openai(tenant["api_key"])
    picture = photo("astronaut", 128)
    text = "Describe the picture in detail."
    as_png = [user(image_part(data_url(picture)), text)]
    as_webp = [user(image_part(data_url(picture, "image/webp", "WEBP", lossless=True)), text)]
    as_jpeg = [user(image_part(data_url(picture, "image/jpeg", "JPEG", quality=85)), text)]
    other = [user(image_part(data_url(photo("coffee", 128))), text)]
    assert as_png[0]["content"][0] != as_webp[0]["content"][0]

    processed = engine_client.inputs(as_png)
    ids = processed.prompt_token_ids
    image = processed.images[0].placeholder
    assert ids == prompt_ids(engine_client, as_jpeg) == prompt_ids(engine_client, other)
    image_end = image.offset + image.length
    assert full_blocks(image_end) > full_blocks(image.offset)  # some block holds only image

    assert cached(client, as_png) == (0, len(ids))
    # the same pixels in another container: every full block is reused, those holding the
    # image included (the last prompt token is always computed, hence len - 1)
    hit, _ = cached(client, as_webp)
    assert hit == full_blocks(len(ids) - 1) and hit >= full_blocks(image_end)
    # a lossy copy and a different photo: only the blocks before the image
    assert cached(client, as_jpeg)[0] == full_blocks(image.offset)
    assert cached(client, other)[0] == full_blocks(image.offset)
    # the case: a picture of "PIN 9876" never reuses the KV of "PIN 1234"
    font = ImageFont.load_default(size=20)
    pins = [render_text(s, (336, 336), font) for s in ("PIN 1234", "PIN 9876")]
    first, second = ([user(image_part(data_url(p)), "What is the PIN?")] for p in pins)
    offset = engine_client.inputs(first).images[0].placeholder.offset
    assert cached(client, first)[0] <= full_blocks(offset)
    assert cached(client, second)[0] == full_blocks(offset)
