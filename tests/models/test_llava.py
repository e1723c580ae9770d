"""LLaVA specifics: image features, placeholder counts, and a long two-image request.

Our LLaVA runs on the test device, transformers' on the CPU (tests/models/conftest.py).
"""

from __future__ import annotations

import torch

from tests.models.harness import assert_same_greedy, greedy_generate

ZEN = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested. Sparse is better "
    "than dense. Readability counts. "
)


def test_model_attributes(ours_llava):
    assert ours_llava.image_token_id == 4
    assert ours_llava.num_image_tokens == 64
    assert (ours_llava.num_layers, ours_llava.num_kv_heads, ours_llava.head_dim) == (4, 2, 16)
    assert (ours_llava.hidden_size, ours_llava.vocab_size) == (64, 1024)
    assert ours_llava.dtype == torch.float32
    # vision_feature_layer=-2 of a 2-layer tower: only the first encoder layer is built.
    assert len(ours_llava.vision_tower.encoder.layers) == 1
    names = {(i, name) for i, name, _ in ours_llava.lora_targets()}
    assert len(names) == 4 * 7 and (3, "down_proj") in names


@torch.no_grad()
def test_encode_images_matches_transformers(ours_llava, hf_llava, processor, photos):
    pixels = processor.image_processor(photos, return_tensors="pt")["pixel_values"]
    ours = ours_llava.encode_images(pixels.to(ours_llava.device)).cpu()
    ref = hf_llava.model.get_image_features(pixel_values=pixels).pooler_output
    assert ours.shape == (2, 64, 64)
    torch.testing.assert_close(ours, torch.stack(list(ref)), atol=1e-5, rtol=0)


def test_two_images_long_prompt_greedy_matches_generate(ours_llava, hf_llava, processor, photos):
    content = [
        {"type": "image", "image": photos[0]},
        {"type": "text", "text": ZEN * 8},
        {"type": "image", "image": photos[1]},
        {"type": "text", "text": "How do the two pictures differ?"},
    ]
    batch = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    ids = batch["input_ids"][0].tolist()
    assert ids.count(4) == 128 and 400 < len(ids) < 1000
    # Chunks of 100 and 37 tokens start and end inside both images.
    ours = greedy_generate(
        ours_llava,
        ids,
        batch["pixel_values"],
        max_new_tokens=10,
        chunk_sizes=(100, 37),
        eos_token_id=2,
    )
    ref = hf_llava.generate(**batch, max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()

    @torch.no_grad()
    def ref_logits(generated):
        full = torch.tensor([ids + generated])
        return hf_llava(input_ids=full, pixel_values=batch["pixel_values"]).logits[0, -1]

    assert_same_greedy(ours, ref, ref_logits)
