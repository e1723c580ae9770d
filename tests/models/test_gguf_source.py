"""``--model path/to/model.gguf``: transformers dequantizes it once into a cached directory.

The GGUF files are the tiny Llama written with the ``gguf`` package's writer
(tests/models/gguf_file.py, llama.cpp's layout). The oracle is transformers loading the same
file (``from_pretrained(dir, gguf_file=...)``, float32) and its greedy ``generate``.
"""

import sys

import pytest
import torch

from loraplex.engine.models.gguf_convert import gguf_dtype
from loraplex.engine.models.source import ModelSourceError, resolve_model
from tests.models.gguf_file import write_llama_gguf

pytest.importorskip("gguf")  # the gguf extra (pyproject.toml), in the test extra too


@pytest.fixture(scope="module")
def ggufs(text_dir, tmp_path_factory):
    """The tiny Llama as F32, F16 and Q8_0 GGUF files."""
    out = tmp_path_factory.mktemp("gguf")
    qtypes = ("F32", "F16", "Q8_0")
    return {q: write_llama_gguf(text_dir, out / f"tiny-{q}.gguf", q) for q in qtypes}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_files_float_type_is_its_dtype(ggufs):
    assert {q: gguf_dtype(p) for q, p in ggufs.items()} == {
        "F32": "float32",
        "F16": "float16",
        "Q8_0": "float32",  # dequantized values: only float32 holds them exactly
    }


@pytest.mark.slow
def test_a_gguf_file_becomes_a_cached_directory_converted_once(ggufs, cache, monkeypatch):
    import hashlib

    from transformers import AutoConfig

    from loraplex.engine.models import gguf_convert

    path = ggufs["F16"]
    resolved = resolve_model(str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert resolved.directory == cache / "gguf" / digest
    assert (resolved.name, resolved.kind) == ("tiny-F16", "gguf")
    names = {p.name for p in resolved.directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert str(AutoConfig.from_pretrained(resolved.directory).dtype) == "torch.float16"
    assert not list((cache / "gguf").glob(".*"))  # no partial conversion left behind

    def convert_again(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "_save_dequantized", convert_again)
    assert resolve_model(str(path)).directory == resolved.directory


def test_what_transformers_cannot_load_is_one_line(tmp_path, cache, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match="is not a readable GGUF file") as info:
        resolve_model(str(bad))
    assert "\n" not in str(info.value)
    monkeypatch.setitem(sys.modules, "gguf", None)  # the package missing
    with pytest.raises(ModelSourceError, match=r"pip install 'loraplex\[gguf\]'"):
        resolve_model(str(bad))


def test_an_architecture_transformers_gguf_support_lacks_is_one_line(tmp_path, cache):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-arch")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="transformers cannot load it") as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_the_engine_on_a_gguf_file_matches_transformers_on_it(ggufs, cache, qtype, model_impl):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    path = ggufs[qtype]
    where, name = str(path.parent), path.name
    hf = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    llm = LLM(EngineConfig(model=str(path), model_impl=model_impl, num_kv_blocks=64, block_size=4))
    try:
        assert llm.engine.config.served_model_name == path.stem
        conversations = [
            [{"role": "user", "content": "Hello there, how are you?"}],
            [{"role": "user", "content": "Name three colours."}],
        ]
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        requests = [llm.make_request(c, sampling) for c in conversations]
        outputs = llm.generate(requests)
        for conversation, request, output in zip(conversations, requests, outputs, strict=True):
            prompt = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert request.prompt_token_ids == list(prompt)  # the file's tokenizer and template
            with torch.no_grad():
                ids = torch.tensor([prompt])
                want = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert output.outputs[0].token_ids == want[0, len(prompt) :].tolist()
    finally:
        llm.shutdown()
