import math

import pytest
import torch

from loraplex.engine.sampling import Sampler, SamplingParams, TokenBytes
from loraplex.gateway.domains.chat.responses import logprobs_body


@pytest.mark.parametrize("text", ["hello world", "café 日本語 😀👍🏽", "Straße ❤️ €"])
def test_token_bytes_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert b"".join(TokenBytes(tokenizer)(ids)) == text.encode("utf-8")


def test_entry_has_openai_shape(tokenizer):
    (tok,) = tokenizer.encode("hello")[:1]
    (item,) = logprobs_body(
        [tok], [(-0.5, [(tok, -0.5), (3, float("-inf"))])], TokenBytes(tokenizer)
    )["content"]
    assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
    assert item["bytes"] == list(TokenBytes(tokenizer).token_bytes(tok)) and item["logprob"] == -0.5
    assert item["top_logprobs"][1]["logprob"] == -9999.0
    assert set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_part_of_a_character_keeps_its_own_bytes(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the emoji is split over byte-level tokens
    content = logprobs_body(ids, [(-1.0, [])] * len(ids), TokenBytes(tokenizer))["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "😀".encode()
    assert content[0]["token"] == "\ufffd"  # alone, an incomplete character


def test_sampler_output_feeds_the_logprobs_body(tokenizer):
    logits = torch.full((1, len(tokenizer)), -10.0)
    logits[0, 100] = 5.0
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)])
    lp = [(out.logprobs[0], out.top_logprobs[0])]
    (item,) = logprobs_body(out.token_ids, lp, TokenBytes(tokenizer))["content"]
    assert item["top_logprobs"][0]["bytes"] == item["bytes"]
    assert math.exp(item["logprob"]) > 0.99
