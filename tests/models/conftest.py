"""Fixtures: the tiny models (made once, on the test device), test images, and float32
convolutions without TF32 on a GPU.

Our models load on the test device (``test_device``, tests/conftest.py); their transformers
twins (``hf_text``, ``hf_llava``) stay on the CPU as the oracles, and the tests bring our outputs
to the CPU to compare.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from loraplex.engine.models import load_model


@pytest.fixture(scope="module", autouse=True)
def _torch_threads(one_torch_thread):
    """Every module here runs tiny models: one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    """float32 exactly on a GPU. cuDNN runs float32 convolutions (the vision towers' patch
    embeddings) in TF32 unless told not to: inputs rounded to a 10-bit mantissa (relative
    error up to about 5e-4), past these tests' 1e-5 and 1e-4 tolerances against the CPU
    oracles and enough to flip a tiny random model's greedy tokens. Matmuls are full float32
    by default (``torch.backends.cuda.matmul.allow_tf32`` is off). Both are pinned off for
    each module here and restored after it; on the CPU the flags do nothing."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope="session")
def ours_llava(llava_dir, test_device):
    """Our LLaVA for the tiny checkpoint, float32, on the test device."""
    return load_model(llava_dir, torch.float32, test_device)[0]


@pytest.fixture(scope="session")
def ours_text(text_dir, test_device):
    """Our Llama for the tiny text checkpoint, float32, on the test device."""
    return load_model(text_dir, torch.float32, test_device)[0]


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
