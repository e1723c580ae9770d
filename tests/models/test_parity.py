"""Numerical parity with transformers (float32) through the paged KV cache.

Each case runs our model over shuffled, non-contiguous blocks: one full prefill, chunked
prefill, a prefix already cached by another sequence, decode steps, and several sequences
flattened into one step, and compares hidden states and logits with transformers' forward.
Our model runs on the test device (tests/models/conftest.py), transformers on the CPU; our
outputs come to the CPU for the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.models.harness import (
    BlockAllocator,
    Seq,
    assert_same_greedy,
    embed_tokens,
    greedy_generate,
    make_kv_caches,
    run_step,
    splice_images,
)

ATOL = 1e-4
TEXT = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested."
)


@dataclass
class Case:
    ours: object
    hf: object
    pixel_values: torch.Tensor | None  # images of the prompt, in order
    ids: list[int]  # a prompt (~70-110 tokens)
    other_ids: list[int]  # a second, different prompt

    def seq(self, ids: list[int], with_images: bool = True) -> Seq:
        if self.pixel_values is None:
            return Seq(list(ids))
        pixels = self.pixel_values if with_images else None
        return Seq(list(ids), splice_images(self.ours, torch.tensor(ids), pixels))

    @torch.no_grad()
    def reference(self, ids: list[int], with_images: bool = True):
        """transformers' final-normed hidden states [T, H] and logits [T, V]."""
        kwargs = {}
        if self.pixel_values is not None and with_images:
            kwargs["pixel_values"] = self.pixel_values
        out = self.hf(input_ids=torch.tensor([ids]), output_hidden_states=True, **kwargs)
        return out.hidden_states[-1][0], out.logits[0]


def _chat(tokenizer_or_processor, content, images=None):
    batch = tokenizer_or_processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    return batch["input_ids"][0].tolist(), batch.get("pixel_values")


@pytest.fixture(scope="module", params=["text", "llava"])
def case(request, tokenizer, processor, photos):
    if request.param == "text":
        ids, _ = _chat(tokenizer, TEXT)
        other, _ = _chat(tokenizer, "Readability counts. " * 6)
        return Case(
            request.getfixturevalue("ours_text"),
            request.getfixturevalue("hf_text"),
            None,
            ids,
            other,
        )
    content = [{"type": "text", "text": "Look: "}, {"type": "image", "image": photos[0]},
               {"type": "text", "text": "Errors should never pass silently."}]  # fmt: skip
    ids, pixels = _chat(processor, content)
    other, _ = _chat(processor, [{"type": "text", "text": "Readability counts. " * 6}])
    return Case(
        request.getfixturevalue("ours_llava"),
        request.getfixturevalue("hf_llava"),
        pixels,
        ids,
        other,
    )


def _close(actual, expected):
    """``actual`` (ours, on the test device) against ``expected`` (transformers, on the CPU)."""
    torch.testing.assert_close(actual.cpu(), expected, atol=ATOL, rtol=0)


def test_full_prefill(case):
    alloc, kv = BlockAllocator(64, seed=1), make_kv_caches(case.ours, 64, 16)
    seq = case.seq(case.ids)
    (hidden,) = run_step(case.ours, kv, [(seq, len(case.ids))], 16, alloc)
    ref_hidden, ref_logits = case.reference(case.ids)
    _close(hidden, ref_hidden)
    _close(case.ours.compute_logits(hidden), ref_logits)
    assert seq.blocks != sorted(seq.blocks)  # really non-contiguous


@pytest.mark.parametrize("chunks", [(1,), (7,), (16, 5, 32), (64, 3)])
def test_chunked_prefill(case, chunks):
    block_size = 8
    alloc, kv = BlockAllocator(64, seed=2), make_kv_caches(case.ours, 64, block_size)
    seq, outs, i = case.seq(case.ids), [], 0
    while seq.num_computed < len(case.ids):
        n = min(chunks[i % len(chunks)], len(case.ids) - seq.num_computed)
        outs += run_step(case.ours, kv, [(seq, n)], block_size, alloc)
        i += 1
    ref_hidden, ref_logits = case.reference(case.ids)
    hidden = torch.cat(outs)
    _close(hidden, ref_hidden)
    _close(case.ours.compute_logits(hidden), ref_logits)


@pytest.mark.parametrize("cached_blocks", [1, 3])
def test_cached_prefix_then_rest(case, cached_blocks):
    block_size = 16
    alloc, kv = BlockAllocator(64, seed=3), make_kv_caches(case.ours, 64, block_size)
    first = case.seq(case.ids)
    run_step(case.ours, kv, [(first, len(case.ids))], block_size, alloc)
    # A second request (same prompt, then more text) finds the first `cached_blocks` full
    # blocks cached; with an image those may end inside the image's placeholder tokens.
    prefix = cached_blocks * block_size
    ids = case.ids + case.other_ids[1:30]
    second = case.seq(ids)
    second.blocks = list(first.blocks[:cached_blocks])
    second.num_computed = prefix
    (hidden,) = run_step(case.ours, kv, [(second, len(ids) - prefix)], block_size, alloc)
    ref_hidden, ref_logits = case.reference(ids)
    _close(hidden, ref_hidden[prefix:])
    _close(case.ours.compute_logits(hidden), ref_logits[prefix:])


def test_decode_steps_match_teacher_forced_reference(case):
    block_size = 4
    alloc, kv = BlockAllocator(128, seed=4), make_kv_caches(case.ours, 128, block_size)
    seq = case.seq(case.ids)
    (hidden,) = run_step(case.ours, kv, [(seq, len(case.ids))], block_size, alloc)
    logits = [case.ours.compute_logits(hidden[-1:])]
    for _ in range(8):
        token = int(logits[-1].argmax())
        seq.token_ids.append(token)
        if seq.embeds is not None:
            seq.embeds = torch.cat([seq.embeds, embed_tokens(case.ours, [token])])
        (hidden,) = run_step(case.ours, kv, [(seq, 1)], block_size, alloc)
        logits.append(case.ours.compute_logits(hidden))
    _, ref_logits = case.reference(seq.token_ids)
    _close(torch.cat(logits), ref_logits[len(case.ids) - 1 :])


def test_greedy_matches_generate(case):
    ours = greedy_generate(
        case.ours,
        case.ids,
        case.pixel_values,
        max_new_tokens=10,
        chunk_sizes=(13, 32),
        eos_token_id=2,
    )
    kwargs = {} if case.pixel_values is None else {"pixel_values": case.pixel_values}
    ids = torch.tensor([case.ids])
    out = case.hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        do_sample=False,
        **kwargs,
    )
    ref = out[0, len(case.ids) :].tolist()
    assert_same_greedy(ours, ref, lambda gen: case.reference(case.ids + gen)[1][-1])


def test_batch_of_three_flattened(case):
    """Mixed steps: a prefill, a chunked prefill and a short prompt, then decodes and a chunk."""
    block_size = 8
    alloc, kv = BlockAllocator(96, seed=5), make_kv_caches(case.ours, 96, block_size)
    a, b = case.seq(case.ids), case.seq(case.other_ids, with_images=False)
    c_ids = case.other_ids[:7]
    c = case.seq(c_ids, with_images=False)
    step1 = run_step(case.ours, kv, [(a, len(a.token_ids)), (b, 20), (c, 7)], block_size, alloc)
    a_next, c_next = 11, 12  # teacher-forced "decode" tokens
    for seq, token in ((a, a_next), (c, c_next)):
        seq.token_ids.append(token)
        if seq.embeds is not None:
            seq.embeds = torch.cat([seq.embeds, embed_tokens(case.ours, [token])])
    rest = len(b.token_ids) - 20
    step2 = run_step(case.ours, kv, [(a, 1), (b, rest), (c, 1)], block_size, alloc)
    for seq, with_images, parts in (
        (a, True, (step1[0], step2[0])),
        (b, False, (step1[1], step2[1])),
        (c, False, (step1[2], step2[2])),
    ):
        ref_hidden, ref_logits = case.reference(seq.token_ids, with_images)
        hidden = torch.cat(parts)
        _close(hidden, ref_hidden)
        _close(case.ours.compute_logits(hidden), ref_logits)
