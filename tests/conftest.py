"""Suite-wide set-up: the device the suite runs on, the Triton interpreter on CPU, and the tiny
models, made once a session.

``LORAPLEX_TEST_DEVICE=cuda`` runs the suite's engines and kernels on the GPU (docs/gpu.md):
every ``EngineConfig`` a test builds without naming a device gets ``device="cuda"``, and
``LORAPLEX_TEST_ATTENTION_BACKEND`` (torch or triton) is the attention backend of those that name
none; those CUDA engines run eagerly (``enforce_eager``) unless ``LORAPLEX_TEST_CUDA_GRAPHS=1``.
The kernel tests take the ``test_device`` fixture. Unset, everything runs on the CPU with
Triton's interpreter, as CI does.
"""

import os

TEST_DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")
TEST_ATTENTION_BACKEND = os.environ.get("LORAPLEX_TEST_ATTENTION_BACKEND")
TEST_CUDA_KV_BYTES = 256 << 20
TEST_CUDA_GRAPHS = os.environ.get("LORAPLEX_TEST_CUDA_GRAPHS") == "1"
if TEST_DEVICE not in ("cpu", "cuda"):
    raise RuntimeError(f"LORAPLEX_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}")

# Must be set before any @triton.jit is imported (on CPU, Triton runs in its interpreter).
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from loraplex.engine.models.tiny_model import init_tiny  # noqa: E402


def _engine_defaults_from_environment() -> None:
    """Point ``EngineConfig``'s device (and attention backend) defaults at the test device."""
    if TEST_DEVICE == "cpu" and TEST_ATTENTION_BACKEND is None:
        return
    from loraplex.engine.config import EngineConfig

    init = EngineConfig.__init__

    def __init__(self, *args, **fields):
        if not args:
            fields.setdefault("device", TEST_DEVICE)
            sized = {"num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization"}
            if fields["device"] == "cuda" and not sized & fields.keys():
                # Several test processes share the GPU (pytest -n): a fixed pool each, not
                # gpu_memory_utilization of the whole device.
                fields["kv_cache_memory_bytes"] = TEST_CUDA_KV_BYTES
            if TEST_ATTENTION_BACKEND is not None:
                fields.setdefault("attention_backend", TEST_ATTENTION_BACKEND)
            if fields["device"] == "cuda" and not TEST_CUDA_GRAPHS:
                # Capturing every bucket's graphs costs seconds per engine: the suite's
                # engines run eagerly unless asked (tests/engine/test_cuda_graphs.py captures).
                fields.setdefault("enforce_eager", True)
        init(self, *args, **fields)

    EngineConfig.__init__ = __init__


_engine_defaults_from_environment()


def pytest_report_header(config):
    backend = TEST_ATTENTION_BACKEND or "each test its own"
    return f"loraplex test device: {TEST_DEVICE}, attention backend: {backend}"


@pytest.fixture(scope="session")
def test_device():
    """The ``torch.device`` kernel tests allocate on (``LORAPLEX_TEST_DEVICE``, default cpu)."""
    import torch

    # Canonical (cuda:0, not cuda): what a tensor's .device compares equal to.
    return torch.empty(0, device=TEST_DEVICE).device


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
