"""Shared fixtures of the engine tests: the tiny models (made once) and transformers oracles."""

import base64
import io

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata


def photo(name: str, size: int | None = None) -> Image.Image:
    """A real photo from scikit-image, RGB."""
    arr = getattr(skdata, name)()
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    img = Image.fromarray(arr[..., :3].astype(np.uint8))
    if size:
        img = img.resize((size, size))
    return img


def data_url(img: Image.Image, fmt: str = "PNG", **save) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def long_text(words: int, seed: int = 0) -> str:
    """Deterministic prose-like filler of about ``words`` words."""
    vocab = (
        "the cat sat on a warm mat while the quick brown fox jumped over lazy dogs and "
        "small birds sang songs about rivers mountains stars cities bread honey"
    ).split()
    rng = np.random.default_rng(seed)
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words))


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
