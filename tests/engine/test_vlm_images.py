"""Variable-length images (transformers VLMs) without a model: slicing, spans, keys, steps.

``engine.client.image_inputs`` cuts a processor's batch per image; validation checks the spans;
the block hasher keys exactly the blocks of a span; the scheduler never ends a chunk inside an
image of a bidirectional model; the runner's splice puts features on image tokens only; the
wire carries an image's integer inputs and masks.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.client.image_inputs import (
    ImageSlice,
    image_token_counts,
    slice_inputs,
    split_images,
)
from loraplex.engine.core.validation import RequestLimits, check_images
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import EngineRequest, ImageInput
from loraplex.engine.runner.image_splice import splice_rows
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.hashing.extra_keys import MM, MMPlaceholder
from loraplex.hashing.request_hasher import RequestBlockHasher

IMG, ROW, TXT = 9, 8, 5
# Two images: the first in two runs split by a row marker (Idefics3-like), the second one run.
IDS = [1, TXT, IMG, IMG, ROW, IMG, IMG, TXT, TXT, IMG, IMG, IMG, TXT]


class Tok:
    """A tokenizer of space-separated ints (what ``image_token_counts`` tokenizes)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}


def test_counts_come_from_each_images_replacement_text():
    reps = [f"{IMG} {IMG} {ROW} {IMG} {IMG}", f"{IMG} {IMG} {IMG}"]
    assert image_token_counts(IDS, IMG, 2, reps, Tok()) == [4, 3]
    # Without them, each maximal run of image tokens is an image: 3 runs are not 2 images.
    with pytest.raises(ValueError, match="cannot tell"):
        image_token_counts(IDS, IMG, 2, None, Tok())
    assert image_token_counts([IMG, TXT, IMG, IMG], IMG, 2, None, Tok()) == [1, 2]
    with pytest.raises(ValueError, match="cannot tell"):  # counts that do not add up
        image_token_counts(IDS, IMG, 2, [f"{IMG}", f"{IMG}"], Tok())


def test_split_gives_spans_first_to_last_image_token_and_own_inputs():
    encoded = {
        "input_ids": torch.tensor([IDS]),
        "pixel_values": torch.arange(2 * 3.0).reshape(2, 3),
        "image_sizes": torch.tensor([[10, 20], [30, 40]]),
        "text_replacement_offsets": [
            [
                {"type": "image", "replacement": f"{IMG} {IMG} {ROW} {IMG} {IMG}"},
                {"type": "image", "replacement": f"{IMG} {IMG} {IMG}"},
            ]
        ],
    }
    first, second = split_images(IDS, IMG, encoded, 2, Tok())
    assert (first.offset, first.length, first.num_tokens) == (2, 5, 4)
    assert (second.offset, second.length, second.num_tokens) == (9, 3, 3)
    assert first.pixel_values.tolist() == [[0.0, 1.0, 2.0]]
    assert second.inputs["image_sizes"].tolist() == [[30, 40]]
    assert set(first.inputs) == {"image_sizes"}  # text outputs are nobody's image input
    assert first.variant() != second.variant()


def test_slice_rules():
    # Qwen2-VL family: flattened patches, t*h*w rows per image.
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    parts = slice_inputs({"pixel_values": torch.zeros(12, 5), "image_grid_thw": grid}, [1, 2])
    assert [p["pixel_values"].shape[0] for p in parts] == [4, 8]
    assert parts[1]["image_grid_thw"].tolist() == [[1, 2, 4]]
    # Idefics3 / SmolVLM: [1, crops, 3, H, W], crops in proportion to the image's tokens.
    batched = {
        "pixel_values": torch.zeros(1, 7, 3, 2, 2),
        "pixel_attention_mask": torch.ones(1, 7, 2, 2, dtype=torch.long),
    }
    parts = slice_inputs(batched, [20, 8])
    assert [p["pixel_values"].shape for p in parts] == [(1, 5, 3, 2, 2), (1, 2, 3, 2, 2)]
    assert parts[1]["pixel_attention_mask"].shape == (1, 2, 2, 2)
    # Gemma 3 with pan-and-scan crops: along dimension 0, in proportion.
    parts = slice_inputs({"pixel_values": torch.zeros(5, 3, 2, 2)}, [8, 12])
    assert [p["pixel_values"].shape[0] for p in parts] == [2, 3]
    # LLaVA-OneVision: the prompt's image count is every image's.
    parts = slice_inputs(
        {"pixel_values": torch.zeros(2, 1, 3), "batch_num_images": torch.tensor([2])}, [5, 5]
    )
    assert all(p["batch_num_images"].tolist() == [2] for p in parts)
    with pytest.raises(ValueError, match="cannot cut"):
        slice_inputs({"pixel_values": torch.zeros(2, 3), "odd": torch.zeros(3)}, [1, 1])
    with pytest.raises(ValueError, match="cannot cut"):
        slice_inputs({"pixel_values": torch.zeros(1, 5, 3)}, [2, 1])  # 5 crops over 2:1


def test_the_variant_follows_token_count_and_small_integer_inputs():
    def piece(n, count):
        inputs = {"batch_num_images": torch.tensor([count])}
        return ImageSlice(0, n, n, torch.zeros(3), inputs)

    assert piece(17, 2).variant() == piece(17, 2).variant()
    assert piece(17, 2).variant() != piece(17, 3).variant()
    assert piece(17, 2).variant() != piece(88, 2).variant()


def _request(ids, spans):
    images = [
        ImageInput(f"k{i}", torch.zeros(3), MMPlaceholder(f"k{i}", s, e - s))
        for i, (s, e) in enumerate(spans)
    ]
    return EngineRequest("r", ids, SamplingParams(), images=images)


def test_variable_spans_are_checked():
    limits = RequestLimits(100, 100, IMG, 0, 64, 4)
    check_images(_request(IDS, [(2, 7), (9, 12)]), limits)
    bad = {
        "does not match": [(1, 7), (9, 12)],  # starts on a text token
        "cover": [(2, 7), (9, 11)],  # the last image token is nobody's
        "placeholder": [(9, 12), (2, 7)],  # out of order
    }
    for message, spans in bad.items():
        with pytest.raises(ValueError, match=message):
            check_images(_request(IDS, spans), limits)
    with pytest.raises(ValueError, match="one step"):  # a bidirectional model's budget
        check_images(_request(IDS, [(2, 7), (9, 12)]), RequestLimits(100, 100, IMG, 0, 64, 4, 4))


def test_an_images_key_is_in_exactly_the_blocks_of_its_span():
    ph = MMPlaceholder("k0", 2, 5)  # positions 2..6: blocks 0 and 1 of 4 tokens
    hasher = RequestBlockHasher(4, placeholders=[ph])
    keyed = [b for b in range(4) if any(k[0] == MM for k in hasher.extra_keys(b))]
    assert keyed == [0, 1]


def _scheduler(batched):
    return Scheduler(
        KVCacheManager(64, 4),
        max_num_seqs=4,
        budget=PrefillBudget(batched, long_prefill_token_threshold=0),
        max_loras=1,
        max_model_len=1000,
        atomic_image_spans=True,
    )


def _chunks(s, request):
    hasher = RequestBlockHasher(4, placeholders=[im.placeholder for im in request.images])
    hasher.extend(request.prompt_token_ids)
    s.add(Sequence("r", request, 0, list(request.prompt_token_ids), hasher))
    from loraplex.engine.scheduling.output import ModelRunnerOutput

    chunks = []
    while True:
        sched = s.schedule()
        item = sched.scheduled[0]
        chunks.append((item.start, item.start + item.num_new_tokens))
        if item.sample:
            return chunks
        s.update_from_output(sched, ModelRunnerOutput())


def test_a_chunk_never_ends_inside_an_image_of_a_bidirectional_model():
    ids = list(range(10, 40))
    request = _request(ids, [(4, 10), (12, 18)])
    # Budget 8: [0, 8) would end inside [4, 10): cut back to 4; then [4, 12) holds it whole;
    # [12, 20) holds the second whole; the rest.
    assert _chunks(_scheduler(8), request) == [(0, 4), (4, 12), (12, 20), (20, 28), (28, 30)]


def test_splice_rows_skip_the_tokens_between_runs():
    ph = MMPlaceholder("k", 2, 5)  # IMG IMG ROW IMG IMG
    assert splice_rows(IDS, ph, 0, 5, IMG, 4) == ([0, 1, 3, 4], 0)
    assert splice_rows(IDS, ph, 3, 2, IMG, 4) == (None, 2)  # a chunk of image tokens only
    assert splice_rows(IDS, ph, 1, 3, IMG, 4) == ([0, 2], 1)
    with pytest.raises(ValueError, match="features"):
        splice_rows(IDS, ph, 0, 5, IMG, 5)


def test_the_wire_carries_an_images_integer_inputs_and_masks():
    from loraplex.engine.core.wire import AddRequest, core_decoder, encoder

    inputs = {
        "image_sizes": torch.tensor([[3, 4]]),
        "pixel_attention_mask": torch.ones(1, 2, 2, dtype=torch.bool),
        "image_grid_thw": torch.tensor([[1, 2, 2]], dtype=torch.int32),
    }
    image = ImageInput("k", torch.rand(1, 3, 2, 2), MMPlaceholder("k", 0, 1), inputs)
    request = EngineRequest("r", [IMG, 1], SamplingParams(), images=[image])
    back = core_decoder().decode(encoder().encode(AddRequest(request))).request.images[0]
    assert torch.equal(back.pixel_values, image.pixel_values)
    for name, value in inputs.items():
        assert back.inputs[name].dtype == value.dtype and torch.equal(back.inputs[name], value)
