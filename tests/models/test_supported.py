"""docs/supported_models.md is what engine/models/supported.py generates, and cites real tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loraplex.engine.models import supported
from loraplex.engine.models.registry import SUPPORTED_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "supported_models.md"
REGENERATE = "python -m loraplex.engine.models.supported docs/supported_models.md"


def _cited() -> dict[str, list[str]]:
    """Cited test file -> the test functions the table names in it."""
    files: dict[str, list[str]] = {}
    for arch in supported.architectures():
        for node in arch.tests:
            path, _, function = node.partition("::")
            assert function and "::" not in function, f"{node}: expected path::test_function"
            files.setdefault(path, []).append(function)
    return files


def _test_functions(path: Path) -> set[str]:
    """Top-level ``test_*`` functions of a test file (what ``path::name`` node ids name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_committed_table_is_the_generated_one():  # ~20 models on the meta device: 1.3 s
    assert DOC.read_text() == supported.table(), f"docs/supported_models.md is stale: {REGENERATE}"


def test_every_native_architecture_has_a_row():
    assert list(supported.NATIVE) == list(SUPPORTED_ARCHITECTURES)


def test_the_issue_architectures_are_rows():
    types = {arch.model_type for arch in supported.TRANSFORMERS}
    assert types >= {
        "qwen3", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "mixtral", "qwen3_moe",
        "llava_next", "llava_onevision", "idefics3", "smolvlm", "mistral3", "gemma3",
        "qwen2_5_vl", "qwen3_vl",
    }  # fmt: skip


@pytest.mark.parametrize("path", sorted(_cited()))
def test_cited_tests_exist(path):
    file = ROOT / path
    if not file.exists():
        # Written in another branch of issue 29 (text and vision architectures); the reviewer
        # merges them. Once the file is here, every function the table cites must be in it.
        pytest.xfail(f"{path} is not in this branch yet")
    missing = sorted(set(_cited()[path]) - _test_functions(file))
    assert not missing, f"{path} has no {missing}: fix engine/models/supported.py"


def test_a_row_no_implementation_serves_fails_the_generation():
    from transformers import T5Config

    broken = supported.Architecture("t5", T5Config, ("tests/x.py::test_t5",))
    with pytest.raises(ValueError, match="row t5: .*no causal-LM model for model_type 't5'"):
        supported.rows([broken])


def _row(model_type):
    return next(a for a in supported.architectures() if a.model_type == model_type)


def test_rows_are_computed_from_the_serving_code():
    """Implementations, auto's pick and LoRA targets come from the code, not from a list."""
    import torch
    from transformers import MixtralForCausalLM

    from loraplex.engine.models.transformers_backend import TransformersForCausalLM

    mistral, phi3, mixtral = supported.rows([_row("mistral"), _row("phi3"), _row("mixtral")])
    assert (mistral.implementations, mistral.auto) == (("native", "transformers"), "native")
    assert mistral.lora_targets == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip
    assert (phi3.implementations, phi3.auto, phi3.vision) == (
        ("transformers",),
        "transformers",
        False,
    )
    assert {"qkv_proj", "gate_up_proj"} <= set(phi3.lora_targets)  # Phi-3's fused projections
    # The same names as the engine model of a real (not meta) Mixtral.
    torch.manual_seed(0)
    real = TransformersForCausalLM(MixtralForCausalLM(_row("mixtral").config()))
    assert mixtral.lora_targets == tuple(dict.fromkeys(n for _, n, _ in real.lora_targets()))
