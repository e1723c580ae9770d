"""Session fixtures: the tiny models (made once), their transformers twins, test images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from loraplex.engine.models import load_model


@pytest.fixture(scope="module", autouse=True)
def _torch_threads(one_torch_thread):
    """Every module here runs tiny models: one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def ours_llava(llava_dir):
    return load_model(llava_dir, torch.float32, "cpu")[0]


@pytest.fixture(scope="session")
def ours_text(text_dir):
    return load_model(text_dir, torch.float32, "cpu")[0]


@pytest.fixture(scope="session")
def processor(llava_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="session")
def tokenizer(text_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_dir)


@pytest.fixture(scope="session")
def photos():
    from skimage import data

    return [Image.fromarray(data.astronaut()), Image.fromarray(data.chelsea())]
