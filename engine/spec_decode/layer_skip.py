"""A draft checkpoint cut from the target: its first layers, its embeddings, norm and head.

The simplest draft of the same family (the "early exit" drafts of LayerSkip, Elhoushi et al.
2024, without the fine-tuning): the target's token embeddings, its first ``num_layers``
decoder layers, its final norm and LM head, written as a text-only Llama checkpoint with the
target's tokenizer files. For a LLaVA target the language model is taken. Used by
``bench.speculative`` and the tests to get a draft that agrees with the target more often
than chance on random-weight models; ``--speculative-model`` takes any checkpoint with the
target's vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def write_layer_skip_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write the draft checkpoint.

    Args:
        target_dir: A Llama (``LlamaForCausalLM``) or LLaVA checkpoint directory.
        out_dir: Where the draft goes (created).
        num_layers: Decoder layers kept, from the first (``1 .. target's layers``).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``num_layers`` out of range, or a checkpoint that is not one file of
            safetensors.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    target, out = Path(target_dir), Path(out_dir)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    if not 1 <= num_layers <= text["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {text['num_hidden_layers']}]")
    files = list(target.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{target}: expected one .safetensors file, found {len(files)}")
    tensors = {}
    with safe_open(str(files[0]), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if name == "lm_head.weight":
                tensors[name] = f.get_tensor(name)
            elif name.startswith(prefix):
                rest = name[len(prefix) :]
                if rest.startswith("layers.") and int(rest.split(".")[1]) >= num_layers:
                    continue
                tensors["model." + rest] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    draft = {**text, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    draft["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(draft, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out
