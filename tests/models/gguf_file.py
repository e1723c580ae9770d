"""A GGUF file of a Hugging Face Llama directory, written with the ``gguf`` package's writer.

What llama.cpp's ``convert_hf_to_gguf.py`` does for a Llama, at the tiny model's size: the
``llama.*`` metadata, llama.cpp's tensor names (``gguf.get_tensor_name_map``), the Q and K rows
permuted into llama.cpp's rotary layout (its ``LlamaModel.permute``, which transformers' GGUF
loader undoes), and the byte-level BPE tokenizer as a ``gpt2`` vocabulary with its merges,
special tokens marked CONTROL and the chat template. Tensors may be stored as F32, F16 or Q8_0
(Q8_0 only where a row is a whole number of its 32-value blocks; the others stay F32, as
llama.cpp does).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama.cpp's general.file_type


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for a Q or K projection (``LlamaModel.permute``)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_llama_gguf(model_dir: Path, out: Path, qtype: str = "F32") -> Path:
    """Write the Llama in ``model_dir`` (``init_tiny(..., text_only=True)``) as ``out``.

    Returns:
        ``out``.
    """
    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    ids = {**tok["model"]["vocab"], **added}
    tokens = sorted(ids, key=ids.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_unk_token_id(0)
    template = model_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        weight = weight.astype(np.float32)
        if name.endswith("q_proj.weight"):
            weight = _permute(weight, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = _permute(weight, cfg["num_key_value_heads"])
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if weight.ndim != 2 or qtype == "F32" or (qtype == "Q8_0" and weight.shape[1] % 32):
            writer.add_tensor(gguf_name, weight)
        elif qtype == "F16":
            writer.add_tensor(gguf_name, weight.astype(np.float16))
        else:
            data = gguf.quants.quantize(weight, quant)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
