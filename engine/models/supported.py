"""The supported-models table (docs/supported_models.md), generated from the code that serves them.

Each row is an architecture the engine runs, with a tiny config of its real transformers
config class (random-weight tests build the same shapes) and the pytest node ids that prove it.
Everything else in the row is computed, not written down: which implementations accept the
config (``engine.models.registry.resolve_model_impl``: ``native`` for
:data:`~engine.models.registry.SUPPORTED_ARCHITECTURES`, the transformers backend for the
rest), which one ``--model-impl auto`` picks, whether it has a vision tower, and the LoRA
target names the served model offers (its ``lora_targets()``, built on the meta device, so the
names are the backend's own naming rule, ``adapters.base_model.lora_target_names``).

Regenerate after changing a row or the code it reflects::

    python -m loraplex.engine.models.supported docs/supported_models.md

``tests/models/test_supported.py`` fails when the committed table differs from the generated
one, and when a cited test does not exist.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.models.registry import SUPPORTED_ARCHITECTURES, build_model, resolve_model_impl

TEXT_TESTS = "tests/models/test_transformers_text.py"
VISION_TESTS = "tests/models/test_transformers_vision.py"
VISION_LORA = (
    "tests/models/test_transformers_vision_lora.py"
    "::test_vision_language_model_with_adapters_matches_peft"
)
VISION_PREEMPTION = f"{VISION_TESTS}::test_images_survive_preemption_forks_and_speculation"

# A decoder of two layers, GQA 4/2, head_dim 16 (the fields every causal-LM config has), and
# special tokens inside its vocabulary.
_TEXT = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A vision tower of one layer (CLIP / SigLIP / Pixtral / Idefics3 field names).
_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}


@dataclass(frozen=True)
class Architecture:
    """One architecture of the table.

    Attributes:
        model_type: transformers' ``model_type``.
        config: Builds a tiny config of the architecture's real config class (``None``: this
            transformers has no such class; the row says so).
        tests: Pytest node ids (``path::function``) that prove the architecture token-exact.
    """

    model_type: str
    config: Callable[[], Any] | None
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    """A computed row of the table (see :func:`rows`)."""

    architecture: str
    model_type: str
    implementations: tuple[str, ...]
    auto: str
    vision: bool
    lora_targets: tuple[str, ...]
    tests: tuple[str, ...]


def _config(class_name: str, **fields: Any) -> Callable[[], Any] | None:
    """A factory of ``transformers.<class_name>(**fields)``, None when it is not installed."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return None
    return lambda: cls(**fields)


def _text_row(model_type: str, class_name: str, **fields: Any) -> Architecture:
    return Architecture(
        model_type,
        _config(class_name, **_TEXT, **fields),
        (f"{TEXT_TESTS}::test_{model_type}",),
    )


def _vision_row(
    model_type: str,
    class_name: str,
    text: dict | None = None,
    vision: dict | None = None,
    more_tests: tuple[str, ...] = (),
    **kw: Any,
) -> Architecture:
    return Architecture(
        model_type,
        _config(
            class_name,
            text_config={**_TEXT, **(text or {})},
            vision_config={**_VISION, **(vision or {})},
            **kw,
        ),
        (f"{VISION_TESTS}::test_{model_type}", *more_tests),
    )


NATIVE: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama",
        _config("LlamaConfig", **_TEXT),
        (
            "tests/models/test_parity.py::test_greedy_matches_generate",
            "tests/models/test_variants.py::test_llama_rope_scaling",
            "tests/models/test_variants.py::test_llama_tied_embeddings_and_biases",
            "tests/engine/test_engine_parity.py::test_text_parity",
        ),
    ),
    "MistralForCausalLM": Architecture(
        "mistral",
        _config("MistralConfig", **_TEXT, sliding_window=8),
        ("tests/models/test_variants.py::test_mistral_sliding_window_prefill_and_decode",),
    ),
    "Qwen2ForCausalLM": Architecture(
        "qwen2",
        _config("Qwen2Config", **_TEXT),
        ("tests/models/test_variants.py::test_qwen2_qkv_bias_and_mixed_sliding_layers",),
    ),
    "LlavaForConditionalGeneration": Architecture(
        "llava",
        _config(
            "LlavaConfig",
            text_config={"model_type": "llama", **_TEXT},
            vision_config={"model_type": "clip_vision_model", **_VISION},
        ),
        (
            "tests/models/test_llava.py::test_two_images_long_prompt_greedy_matches_generate",
            "tests/engine/test_engine_parity.py::test_llava_parity",
            "tests/engine/test_lora_parity.py::test_mixed_adapter_batch_matches_peft",
            f"{VISION_TESTS}::test_llava_through_transformers_is_the_native_llava",
        ),
    ),
}
"""The native architectures (``registry.SUPPORTED_ARCHITECTURES``), by architecture name."""

_MOE = {"num_experts_per_tok": 2}
_VL_TEXT = {"model_type": "qwen2"}

TRANSFORMERS: tuple[Architecture, ...] = (
    _text_row("qwen3", "Qwen3Config", head_dim=16),
    _text_row("gemma2", "Gemma2Config", head_dim=16),
    _text_row("gemma3_text", "Gemma3TextConfig", head_dim=16),
    _text_row("phi3", "Phi3Config"),
    _text_row("granite", "GraniteConfig"),
    _text_row("olmo2", "Olmo2Config"),
    _text_row("mixtral", "MixtralConfig", num_local_experts=4, **_MOE),
    _text_row(
        "qwen3_moe", "Qwen3MoeConfig", head_dim=16, num_experts=4, moe_intermediate_size=32, **_MOE
    ),
    _text_row("gpt_neox", "GPTNeoXConfig"),
    _text_row("gpt_oss", "GptOssConfig", head_dim=16, num_local_experts=4, **_MOE),
    _vision_row(
        "llava_next",
        "LlavaNextConfig",
        {"model_type": "llama"},
        {"model_type": "clip_vision_model"},
    ),
    _vision_row(
        "llava_onevision", "LlavaOnevisionConfig", _VL_TEXT, {"model_type": "siglip_vision_model"}
    ),
    _vision_row("idefics3", "Idefics3Config", {"model_type": "llama"}),
    _vision_row("smolvlm", "SmolVLMConfig", {"model_type": "llama"}),
    _vision_row(
        "mistral3",
        "Mistral3Config",
        {"model_type": "mistral"},
        {"model_type": "pixtral", "head_dim": 16},
    ),
    _vision_row(
        "gemma3",
        "Gemma3Config",
        {"model_type": "gemma3_text", "head_dim": 16},
        {"model_type": "siglip_vision_model"},
        (VISION_LORA,),
        mm_tokens_per_image=4,
    ),
    _vision_row(
        "qwen2_5_vl",
        "Qwen2_5_VLConfig",
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2},
        (VISION_LORA, VISION_PREEMPTION),
    ),
    _vision_row(
        "qwen3_vl",
        "Qwen3VLConfig",
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2},
    ),
)
"""Architectures served by the transformers backend that a test proves token-exact."""


def architectures() -> Iterator[Architecture]:
    """Every row's architecture: the native ones first, in registry order."""
    for name in SUPPORTED_ARCHITECTURES:
        yield NATIVE[name]
    yield from TRANSFORMERS


def _engine_model(hf_config: Any, impl: str) -> torch.nn.Module:
    """The engine model ``impl`` would serve ``hf_config`` with (random weights: tiny configs).

    On the CPU, not the meta device: the transformers wrapper runs its decoder once at
    construction to measure the attention shapes (``.probe``), and some kernels (the fused MoE
    experts' grouped matmul) have no float32 meta implementation.
    """
    if impl == "native":
        with torch.device("meta"):
            return build_model(hf_config)
    with torch.device("cpu"):
        from loraplex.engine.models.transformers_backend import (
            TransformersForCausalLM,
            TransformersForImageTextToText,
            model_class_of,
        )

        cls, _ = model_class_of(hf_config)
        vision = getattr(hf_config, "vision_config", None) is not None  # as the loader wraps it
        wrapper = TransformersForImageTextToText if vision else TransformersForCausalLM
        return wrapper(cls(hf_config))


def _accepts(hf_config: Any, impl: str) -> bool:
    try:
        return resolve_model_impl(hf_config, impl) == impl
    except ValueError:
        return False


def rows(archs: list[Architecture] | None = None) -> list[Row]:
    """The table's rows, computed (see the module docstring).

    Args:
        archs: The architectures (default: :func:`architectures`, the whole table).

    Raises:
        ValueError: a row whose config no implementation accepts (a broken row).
    """
    out = []
    for arch in architectures() if archs is None else archs:
        if arch.config is None:
            out.append(Row("-", arch.model_type, (), "", False, (), arch.tests))
            continue
        try:
            out.append(_row(arch))
        except ValueError as exc:
            raise ValueError(f"supported-models row {arch.model_type}: {exc}") from exc
    return out


def _row(arch: Architecture) -> Row:
    from loraplex.engine.models.transformers_backend import model_class_of

    hf_config = arch.config()
    cls, reason = model_class_of(hf_config)
    if cls is None:
        raise ValueError(reason)
    hf_config.architectures = [cls.__name__]
    auto = resolve_model_impl(hf_config, "auto")
    impls = tuple(i for i in ("native", "transformers") if _accepts(hf_config, i))
    names = dict.fromkeys(n for _, n, _ in _engine_model(hf_config, auto).lora_targets())
    vision = getattr(hf_config, "vision_config", None) is not None
    return Row(cls.__name__, arch.model_type, impls, auto, vision, tuple(names), arch.tests)


HEADER = """\
# Supported models

<!-- Generated by `python -m loraplex.engine.models.supported docs/supported_models.md` from
engine/models/supported.py; tests/models/test_supported.py fails when this file differs. -->

Every architecture here has tests proving it token-exact against transformers `generate`
(greedy, float32). "Implementations": what `--model-impl native` and `--model-impl
transformers` accept; `auto` picks the one in bold (the native model where one exists:
docs/transformers_backend.md). Other `AutoModelForCausalLM` architectures may run through the
transformers backend too, untested here, unless it refuses them (docs/transformers_backend.md,
"What it refuses"). "LoRA targets": the decoder module names an adapter's `target_modules` may
name (the served model's `lora_targets()`, computed on a tiny config of the architecture's
config class); vision-tower modules are not targets.

| architecture | model_type | implementations | vision | LoRA targets | tested |
| --- | --- | --- | --- | --- | --- |
"""


def table(computed: list[Row] | None = None) -> str:
    """The whole of docs/supported_models.md."""
    lines = [HEADER]
    for row in rows() if computed is None else computed:
        if not row.implementations:
            impls = "not in this transformers"
        else:
            impls = ", ".join(f"**{i}**" if i == row.auto else i for i in row.implementations)
        targets = ", ".join(f"`{t}`" for t in row.lora_targets)
        tests = "<br>".join(f"`{t}`" for t in row.tests)
        vision = "yes" if row.vision else "no"
        arch = f"`{row.architecture}`"
        lines.append(
            f"| {arch} | `{row.model_type}` | {impls} | {vision} | {targets} | {tests} |\n"
        )
    return "".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Write the table to the given path (docs/supported_models.md), or print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="file to write (default: print)")
    args = parser.parse_args(argv)
    text = table()
    if args.path is None:
        print(text, end="")
    else:
        Path(args.path).write_text(text)


if __name__ == "__main__":
    main()
