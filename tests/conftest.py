"""Suite-wide set-up: the Triton interpreter on CPU, and the tiny models, made once a session."""

import os

# Must be set before any @triton.jit is imported (the kernels issue runs Triton on CPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from loraplex.engine.models.tiny_model import init_tiny  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: intra-op threads only spin (several times the CPU time). Module-scoped;
    a folder's conftest makes it autouse where every test runs tiny models in process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def make_llm():
    """``make_llm(**EngineConfig fields) -> LLM``: one engine per configuration, session-wide.

    Building an engine takes about a second; modules that ask for the same configuration share
    one (their tests must leave it clean: no request in flight, every block back). A test that
    breaks its engine on purpose builds its own.
    """
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig

    made: dict = {}

    def make(**fields):
        config = EngineConfig(**fields)
        if config not in made:
            made[config] = LLM(config)
        return made[config]

    yield make
    for llm in made.values():
        llm.shutdown()


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    """The built-in tiny LLaVA (seed 0), as a Hugging Face directory."""
    return init_tiny(tmp_path_factory.mktemp("tiny") / "llava", seed=0)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """The built-in tiny text-only Llama (seed 0)."""
    return init_tiny(tmp_path_factory.mktemp("tiny") / "text", seed=0, text_only=True)


@pytest.fixture(scope="session")
def tiny_llava_dir(llava_dir):
    return str(llava_dir)


@pytest.fixture(scope="session")
def tiny_text_dir(text_dir):
    return str(text_dir)


@pytest.fixture(scope="session")
def hf_llava(llava_dir):
    """transformers' own LLaVA for the tiny model (float32, eval): the oracle."""
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_text(text_dir):
    """transformers' own Llama for the tiny text model (float32, eval): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
