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
