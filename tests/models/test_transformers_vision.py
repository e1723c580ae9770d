"""Transformers vision-language models through the engine, token for token against ``generate``.

For each architecture a tiny random checkpoint is made from transformers' real config and
processor classes (``tests.models.vlm_checkpoints``), and three chat requests (one photo, two
photos, text only) run as one mixed batch through ``LLM`` with ``model_impl="transformers"``,
prefill chunks of 16 tokens (they start and end inside images) and 4-token blocks. The oracle is
transformers' own ``generate`` on its own processor's outputs for the same messages (float32,
greedy). Then the two-photo request again: its image blocks come from the prefix cache and the
vision encoder is not run; and with another second photo: no block holding that photo's tokens
is reused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.media import data_url, photo
from tests.models import vlm_checkpoints

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
BLOCK = 4
PROMPTS = (
    [0, "What is in the picture?"],
    [0, "the cat sat on a warm mat", 1, "How do the two pictures differ?"],
    ["the quick brown fox jumped over the lazy dogs"],
)


# Seeds whose greedy answers are not one or two tokens repeated (seed 0's are, for these).
SEEDS = {"gemma3": 1, "qwen2_5_vl": 2}


@pytest.fixture(scope="module")
def photos():
    return [photo("astronaut"), photo("chelsea"), photo("coffee")]


def _messages(parts, photos, *, hf: bool):
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif hf:
            content.append({"type": "image", "image": photos[part]})
        else:
            content.append({"type": "image_url", "image_url": {"url": data_url(photos[part])}})
    return [{"role": "user", "content": content}]


def _oracle(directory: Path, prompts, photos, model=None):
    """(prompt ids, greedy tokens) of transformers' generate, per prompt.

    ``model``: the model to generate with (e.g. a peft model over the checkpoint); default the
    checkpoint itself.
    """
    from transformers import AutoModelForImageTextToText

    from loraplex.engine.client.auto_processor import load_auto_processor

    processor = load_auto_processor(str(directory))
    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    model.generation_config.eos_token_id = None  # the engine ignores EOS too
    out = []
    for parts in prompts:
        batch = processor.apply_chat_template(
            _messages(parts, photos, hf=True),
            add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        )  # fmt: skip
        with torch.no_grad():
            tokens = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        ids = batch["input_ids"][0].tolist()
        out.append((ids, tokens[0, len(ids) :].tolist()))
    return out


def _check(arch: str, tmp_path_factory, photos) -> tuple:
    """Run the architecture's checks; returns ``(llm, requests, oracle)`` for more."""
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    directory = vlm_checkpoints.BUILDERS[arch](tmp_path_factory.mktemp(arch), SEEDS.get(arch, 0))
    oracle = _oracle(directory, [*PROMPTS, [0, "the cat sat on a warm mat", 2, "How?"]], photos)
    llm = LLM(
        EngineConfig(
            model=str(directory),
            model_impl="transformers",
            dtype="float32",
            block_size=BLOCK,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=0,
        )
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def request(parts):
        return llm.make_request(_messages(parts, photos, hf=False), sampling)

    requests = [request(parts) for parts in PROMPTS]
    for req, (ids, _) in zip(requests, oracle, strict=False):
        assert req.prompt_token_ids == ids  # the engine's prompt is the processor's
    assert [len(r.images) for r in requests] == [1, 2, 0]
    outs = llm.generate(requests)  # one batch: images and text mixed, chunks inside images
    for out, (_, ref) in zip(outs, oracle, strict=False):
        assert out.outputs[0].token_ids == ref
        assert len(set(ref)) > 2  # a decisive model, not one repeating a token
    runner = llm.engine.core.runner
    encoded = runner.num_images_encoded

    again = llm.generate([request(PROMPTS[1])])[0]  # the same two photos: a prefix hit
    assert again.outputs[0].token_ids == oracle[1][1]
    second = requests[1].images[1].placeholder
    assert again.num_cached_tokens >= second.end // BLOCK * BLOCK
    assert runner.num_images_encoded == encoded  # blocks reused, nothing encoded

    other_req = request([0, "the cat sat on a warm mat", 2, "How?"])  # another second photo
    other = llm.generate([other_req])[0]
    assert other.outputs[0].token_ids == oracle[3][1]
    first_block_of_photo = other_req.images[1].placeholder.offset // BLOCK
    assert 0 < other.num_cached_tokens <= first_block_of_photo * BLOCK
    assert runner.num_images_encoded == encoded + 1
    return llm, requests, oracle


def test_llava_next(tmp_path_factory, photos):
    """Any-res tiling: an image's tokens depend on its size (base tile + unpadded grid rows)."""
    _, requests, _ = _check("llava_next", tmp_path_factory, photos)
    lengths = [im.placeholder.length for im in requests[1].images]
    assert lengths[0] != lengths[1]  # 512x512 and 451x300 photos tile differently


def test_llava_onevision(tmp_path_factory, photos):
    """A lone image is tiled, one of several is not: same photo, other tokens and key."""
    _, requests, _ = _check("llava_onevision", tmp_path_factory, photos)
    alone, among = requests[0].images[0], requests[1].images[0]
    assert alone.placeholder.length > among.placeholder.length
    assert alone.key != among.key  # so neither its features nor its blocks are shared


def test_idefics3(tmp_path_factory, photos):
    """Image splitting + pixel shuffle: crops' tokens between row/column markers."""
    _, requests, _ = _check("idefics3", tmp_path_factory, photos)
    _assert_runs_between_markers(requests[1])


def test_smolvlm(tmp_path_factory, photos):
    """SmolVLM (Idefics3's design, its own processor, built without torchvision)."""
    _, requests, _ = _check("smolvlm", tmp_path_factory, photos)
    _assert_runs_between_markers(requests[1])


def test_mistral3(tmp_path_factory, photos):
    """Pixtral rows: ``[IMG]`` runs closed by ``[IMG_BREAK]``, the image by ``[IMG_END]``."""
    _, requests, _ = _check("mistral3", tmp_path_factory, photos)
    _assert_runs_between_markers(requests[1])


def test_gemma3(tmp_path_factory, photos):
    """Bidirectional attention within each image's soft tokens, exact under chunked prefill.

    The same batch with the image attention made causal gives other tokens: the
    bidirectional path is what makes it exact.
    """
    from loraplex.engine.sampling.params import SamplingParams

    llm, _, oracle = _check("gemma3", tmp_path_factory, photos)
    model = llm.engine.core.model
    assert model.bidirectional_image_spans and llm.engine.core.scheduler.atomic_image_spans
    model.bidirectional_image_spans = False
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        causal = llm.generate(
            [llm.make_request(_messages(PROMPTS[1], photos, hf=False), sampling, cache_salt="c")]
        )[0]
    finally:
        model.bidirectional_image_spans = True
    assert causal.outputs[0].token_ids != oracle[1][1]


def _assert_runs_between_markers(request) -> None:
    """Each image's span holds its image tokens in several runs, other tokens between."""
    from loraplex.engine.client.image_inputs import placeholder_runs

    ids = request.prompt_token_ids
    token = ids[request.images[0].placeholder.offset]
    for image in request.images:
        ph = image.placeholder
        span = ids[ph.offset : ph.end]
        assert span[0] == token and span[-1] == token
        assert len(placeholder_runs(span, token)) > 1


def test_qwen2_5_vl(tmp_path_factory, photos):
    """Dynamic resolution (``image_grid_thw``) and M-RoPE: 3-D positions from the model's own
    ``get_rope_index``, later tokens shifted by its delta; plain positions give other tokens."""
    from loraplex.engine.sampling.params import SamplingParams

    llm, requests, oracle = _check("qwen2_5_vl", tmp_path_factory, photos)
    model = llm.engine.core.model
    grids = [im.inputs["image_grid_thw"] for im in requests[1].images]
    positions, delta = model.rope_positions(requests[1].prompt_token_ids, grids)
    assert positions.shape == (3, len(requests[1].prompt_token_ids)) and delta != 0
    assert not torch.equal(positions[1], positions[2])  # image rows and columns differ
    model.mrope = False
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        plain = llm.generate(
            [llm.make_request(_messages(PROMPTS[1], photos, hf=False), sampling, cache_salt="p")]
        )[0]
    finally:
        model.mrope = True
    assert plain.outputs[0].token_ids != oracle[1][1]


def test_qwen3_vl(tmp_path_factory, photos):
    """Qwen3-VL: M-RoPE, and deepstack features added after the decoder's first layers; the
    same requests without the deepstack rows give other tokens."""
    from loraplex.engine.sampling.params import SamplingParams

    llm, requests, oracle = _check("qwen3_vl", tmp_path_factory, photos)
    model = llm.engine.core.model
    image = requests[1].images[0]
    features = model.encode_image(image.pixel_values, image.inputs)
    assert features.shape == (image.placeholder.length, 3 * model.hidden_size)  # 2 deepstack
    with_deepstack = model.forward
    model.forward = lambda *args, deepstack=None, **kwargs: with_deepstack(*args, **kwargs)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        plain = llm.generate(
            [llm.make_request(_messages(PROMPTS[1], photos, hf=False), sampling, cache_salt="d")]
        )[0]
    finally:
        del model.forward
    assert plain.outputs[0].token_ids != oracle[1][1]


def test_llava_through_transformers_is_the_native_llava(llava_dir, photos):
    """The built-in LLaVA-1.5 checkpoint: the transformers backend's generic image path gives
    the native model's tokens, spans and (with a variant) keys."""
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for impl in ("native", "transformers"):
        config = EngineConfig(
            model=str(llava_dir),
            model_impl=impl,
            block_size=BLOCK,
            max_num_batched_tokens=32,
            long_prefill_token_threshold=0,
        )
        llm = LLM(config)
        request = llm.make_request(_messages(PROMPTS[1], photos, hf=False), sampling)
        out = llm.generate([request])[0]
        results[impl] = (out.outputs[0].token_ids, request.images)
    (native, native_images), (ours, our_images) = results["native"], results["transformers"]
    assert ours == native
    for a, b in zip(native_images, our_images, strict=True):
        assert (a.placeholder.offset, a.placeholder.length) == (
            b.placeholder.offset, b.placeholder.length,
        )  # fmt: skip
        assert b.key.startswith(a.key + ":")


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_images_survive_preemption_forks_and_speculation(tmp_path_factory, photos, preemption):
    """Qwen2.5-VL (M-RoPE: per-sequence positions the runner rebuilds when a sequence comes
    back) in a pool too small for both requests, ``n = 2``, n-gram speculation: the oracle's
    tokens for every output."""
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    directory = vlm_checkpoints.qwen2_5_vl(tmp_path_factory.mktemp("q"), SEEDS["qwen2_5_vl"])
    prompts = [PROMPTS[1], [0, "the cat sat on a warm mat", 2, "How?"]]
    oracle = _oracle(directory, prompts, photos)
    config = EngineConfig(
        model=str(directory),
        model_impl="transformers",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=0,
        preemption=preemption,
        speculative_method="ngram",
        prompt_lookup_min=1,
    )
    llm = LLM(config)
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    requests = [llm.make_request(_messages(p, photos, hf=False), sampling) for p in prompts]
    outs = llm.generate(requests)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swapped_out > 0) == (preemption == "swap")
    assert scheduler.spec_stats.num_draft_tokens > 0
    for out, (_, ref) in zip(outs, oracle, strict=True):
        assert [o.token_ids for o in out.outputs] == [ref, ref]
