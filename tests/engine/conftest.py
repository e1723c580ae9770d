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


_DRAFTS: dict[str, str] = {}


def draft_dir(model_dir, tmp_path_factory) -> str:
    """A 2-layer draft cut from a tiny model (``engine.spec_decode.layer_skip``), made once."""
    from loraplex.engine.spec_decode.layer_skip import write_layer_skip_draft

    if model_dir not in _DRAFTS:
        out = tmp_path_factory.mktemp("draft")
        _DRAFTS[model_dir] = str(write_layer_skip_draft(model_dir, out, 2))
    return _DRAFTS[model_dir]


def spec_flags(kind, model_dir, tmp_path_factory) -> dict:
    """Engine flags for ``kind``: ``no-spec``, ``ngram`` or ``draft`` speculative decoding.

    ``ngram`` proposes up to 3 tokens from a 1-token match, so the tiny models' short,
    repetitive outputs do get proposals verified; ``draft`` uses a 2-layer draft of the model.
    """
    if kind == "ngram":
        return {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if kind == "draft":
        return {
            "speculative_method": "draft",
            "num_speculative_tokens": 3,
            "speculative_model": draft_dir(model_dir, tmp_path_factory),
        }
    return {}


@pytest.fixture(params=["no-spec", "ngram", "draft"])
def spec(request, tmp_path_factory):
    """``spec(model_dir)``: a parity test's engine flags, plain and with speculation on.

    Issue 17: every parity test passes with speculation on too (n-gram and draft model).
    """

    def flags(model_dir):
        return spec_flags(request.param, model_dir, tmp_path_factory)

    flags.on = request.param != "no-spec"
    return flags


def spec_used(llm, spec):
    """With speculation on, the run verified proposals (else the spec run proved nothing)."""
    drafts = llm.engine.stats()["spec_decode_num_draft_tokens"]
    assert (drafts > 0) == spec.on, f"{drafts} proposals verified"
