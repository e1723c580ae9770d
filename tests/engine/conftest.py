"""Shared fixtures of the engine tests: the tiny models (made once) and transformers oracles."""

import pytest

from tests.media import data_url, long_text, photo  # noqa: F401 - re-exported


def user(*parts):
    """An OpenAI-style user message from str (text) and PIL images (data URLs)."""
    content = []
    for p in parts:
        if isinstance(p, str):
            content.append({"type": "text", "text": p})
        else:
            content.append({"type": "image_url", "image_url": {"url": data_url(p)}})
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="session")
def hf_llava(hf_llava, tiny_llava_dir):
    from transformers import AutoProcessor

    return hf_llava, AutoProcessor.from_pretrained(tiny_llava_dir)


@pytest.fixture(scope="session")
def hf_text(hf_text, tiny_text_dir):
    from transformers import AutoTokenizer

    return hf_text, AutoTokenizer.from_pretrained(tiny_text_dir)


@pytest.fixture(params=["no-spec", "ngram"])
def spec(request):
    """Engine flags of a parity test's two runs: plain, and n-gram speculative decoding.

    Issue 17: every parity test passes with speculation on too. The ``ngram`` run proposes up
    to 3 tokens from a 1-token match, so the tiny models' short, repetitive outputs do get
    proposals verified (``spec_used`` checks that some were).
    """
    if request.param == "no-spec":
        return {}
    return {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def spec_used(llm, spec):
    """With speculation on, the run verified proposals (else the spec run proved nothing)."""
    drafts = llm.engine.stats()["spec_decode_num_draft_tokens"]
    assert (drafts > 0) == bool(spec), f"{drafts} proposals verified with {spec}"
