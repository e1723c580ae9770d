import math

import pytest
import torch

from loraplex.engine.sampling import LogprobFormatter, Sampler, SamplingParams


@pytest.mark.parametrize("text", ["hello world", "café 日本語 😀👍🏽", "Straße ❤️ €"])
def test_token_bytes_concatenate_to_the_text(tokenizer, text):
    fmt = LogprobFormatter(tokenizer)
    ids = tokenizer.encode(text)
    assert b"".join(fmt.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_entry_has_openai_shape(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    (tok,) = tokenizer.encode("hello")[:1]
    item = fmt.entry(tok, -0.5, [(tok, -0.5), (3, float("-inf"))])
    assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
    assert item["bytes"] == list(fmt.token_bytes(tok)) and item["logprob"] == -0.5
    assert item["top_logprobs"][1]["logprob"] == -9999.0
    assert set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_sampler_output_feeds_the_formatter(tokenizer):
    logits = torch.full((1, len(tokenizer)), -10.0)
    logits[0, 100] = 5.0
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)])
    item = LogprobFormatter(tokenizer).entry(out.token_ids[0], out.logprobs[0], out.top_logprobs[0])
    assert item["top_logprobs"][0]["bytes"] == item["bytes"]
    assert math.exp(item["logprob"]) > 0.99
