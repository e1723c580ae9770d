"""Benchmark: where a decode step of the transformers backend spends more than the native model.

Both implementations load the same Llama checkpoint: SmolLM-135M's layer structure (30
layers, 9 query / 3 KV heads, tied embeddings) at tiny widths (hidden 72, head_dim 8, MLP 96,
vocab 512), so the matrix products cost next to nothing and what is left of a step is the
per-call cost of the Python module tree, the cost the transformers backend adds. One sequence
with a 100-token context decodes one token; each component is called alone, native and
transformers alternately, and the median of each is reported in microseconds, with the
difference per call and per step (components that run once per layer count 30 times).

Components: the whole forward pass; the same embedding, rotary embedding, decoder layers and
final norm called in a plain loop (the difference to the whole pass is the model-level code
around the layers: transformers' decorators, output classes, mask preparation); one decoder
layer; its attention module (projections,
rotary embedding, the paged attention, output projection); the paged attention itself through
the backend's hook (``paged_attention_forward``) against the attention backend called directly
(what the hook adds); the MLP; one RMSNorm; the rotary embedding of the step's positions.

Run: ``python -m bench.backend_overhead [--quick] [--threads N]``; prints a table, then one
JSON line. Default one torch thread (a step this small runs on one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.engine.attention import AttentionMetadata, TorchAttentionBackend
from loraplex.engine.models import load_model
from loraplex.engine.models.transformers_backend.attention import (
    PagedStep,
    paged_attention_forward,
    paged_step,
)

SHAPE = {
    "vocab_size": 512,
    "hidden_size": 72,
    "intermediate_size": 96,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 8,
    "tie_word_embeddings": True,
}
BLOCK = 16
CONTEXT = 100


def checkpoint(target: Path) -> Path:
    """The tiny-width Llama checkpoint (random weights, seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(target)
    return target


def metadata(start: int, count: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """One sequence computing positions ``[start, start + count)`` in blocks ``0, 1, ...``."""
    end = start + count
    blocks = -(-end // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, end),
        query_start_loc=torch.tensor([0, count], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=count,
        max_seq_len=end,
        num_decode_tokens=int(count == 1),
    )
    ids = torch.arange(16, 16 + count) % SHAPE["vocab_size"]
    return meta, torch.arange(start, end), ids


def paired(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median microseconds of ``a`` and of ``b``, called alternately ``reps`` times each."""
    times: tuple[list[int], list[int]] = ([], [])
    for _ in range(reps):
        for fn, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
    return statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3


@torch.inference_mode()
def measure(path: Path, reps: int) -> list[tuple[str, int, float, float]]:
    """``(component, calls per step, native us, transformers us)`` rows."""
    backend = TorchAttentionBackend()
    models = {
        impl: load_model(path, torch.float32, "cpu", impl)[0] for impl in ("native", "transformers")
    }
    caches = {}
    for impl, model in models.items():
        shape = (16, BLOCK, model.num_kv_heads, model.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
        meta, pos, ids = metadata(0, CONTEXT)
        model(ids, pos, kv, meta, backend)  # the prefill; every decode below reads it
        caches[impl] = kv
    meta, pos, ids = metadata(CONTEXT, 1)
    nat, tf = models["native"], models["transformers"]
    kv_n, kv_t = caches["native"], caches["transformers"]
    layers = nat.num_layers
    h = nat.embed_tokens(ids)
    cos, sin = nat.model.rotary_emb(pos, h.dtype)
    layer_n, dec = nat.model.layers[0], tf.decoder
    layer_t, h_t, pid = dec.layers[0], h[None], pos[None]
    emb = dec.rotary_emb(h_t, position_ids=pid)
    heads, kv_heads, dim = nat.num_heads, nat.num_kv_heads, nat.head_dim
    q, k = torch.randn(1, heads, dim), torch.randn(1, kv_heads, dim)
    v = torch.randn(1, kv_heads, dim)
    q_t, k_t, v_t = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]

    def loop_native():  # the forward pass without the model-level code around its layers
        x = nat.embed_tokens(ids)
        c, s = nat.model.rotary_emb(pos, x.dtype)
        for layer, kv in zip(nat.model.layers, kv_n, strict=True):
            x = layer(x, c, s, kv, meta, backend)
        return nat.model.norm(x)

    def loop_transformers():
        x = dec.embed_tokens(ids[None])
        e = dec.rotary_emb(x, position_ids=pid)
        for layer in dec.layers:
            x = layer(
                x,
                attention_mask=None,
                position_embeddings=e,
                position_ids=pid,
                cache=None,
                use_cache=False,
            )
        return dec.norm(x)

    rows = [
        ("forward pass (whole step)", 1,
         lambda: nat(ids, pos, kv_n, meta, backend), lambda: tf(ids, pos, kv_t, meta, backend)),
        ("the same layers in a plain loop", 1, loop_native, loop_transformers),
        ("rotary embedding of the positions", 1,
         lambda: nat.model.rotary_emb(pos, h.dtype), lambda: dec.rotary_emb(h_t, position_ids=pid)),
        ("decoder layer", layers,
         lambda: layer_n(h, cos, sin, kv_n[0], meta, backend),
         lambda: layer_t(h_t, attention_mask=None, position_embeddings=emb, position_ids=pid)),
        ("attention module", layers,
         lambda: layer_n.self_attn(h, cos, sin, kv_n[0], meta, backend),
         lambda: layer_t.self_attn(hidden_states=h_t, position_embeddings=emb,
                                   attention_mask=None)),
        ("paged attention (backend direct / hook)", layers,
         lambda: backend.forward(q, k, v, kv_n[0][0], kv_n[0][1], meta, 0.35),
         lambda: paged_attention_forward(layer_t.self_attn, q_t, k_t, v_t, None, scaling=0.35)),
        ("MLP", layers, lambda: layer_n.mlp(h), lambda: layer_t.mlp(h_t)),
        ("RMSNorm", 2 * layers + 1,
         lambda: layer_n.input_layernorm(h), lambda: layer_t.input_layernorm(h_t)),
    ]  # fmt: skip
    out = []
    with paged_step(PagedStep(kv_t, meta, backend, tf._layer_of)):
        for name, calls, fn_n, fn_t in rows:
            out.append((name, calls, *paired(fn_n, fn_t, reps)))
    return out


def main() -> None:
    """Print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(checkpoint(Path(tmp)), reps=60 if args.quick else 400)
    print(
        f"decode step, 1 sequence, context {CONTEXT}, {SHAPE['num_hidden_layers']} layers at "
        f"hidden {SHAPE['hidden_size']}; torch threads {torch.get_num_threads()}; median us"
    )
    print(f"{'component':<42}{'calls':>6}{'native':>10}{'transf.':>10}{'+/call':>9}{'+/step':>9}")
    figures = {}
    for name, calls, native, tf in rows:
        extra = tf - native
        print(f"{name:<42}{calls:>6}{native:>10.1f}{tf:>10.1f}{extra:>9.1f}{extra * calls:>9.0f}")
        figures[name] = {"native_us": round(native, 1), "transformers_us": round(tf, 1)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
