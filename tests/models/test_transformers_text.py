"""The transformers backend token-exact on today's text architectures (issue 29, must-show 2).

For each architecture (tests/models/text_archs.py: a tiny random checkpoint from the real config
class), the engine with ``model_impl="transformers"`` runs two batches of mixed requests and
must give the greedy tokens of transformers ``generate`` (base requests) and of peft's own
``generate`` (adapter requests) on the same checkpoint, float32:

- every prompt is prefilled in chunks (``max_num_batched_tokens=16``, block size 4), several
  sequences share each step;
- the second batch shares a long prefix with the first, per adapter: its requests hit the
  prefix cache (``num_cached_tokens > 0``) and must still be exact;
- a LoRA adapter made with peft's ``get_peft_model`` (every Llama projection, or the attention
  ones on the mixtures of experts) runs beside base requests in the same batch.

On Qwen3 and Gemma 2 the rest of the engine runs too: speculative decoding (n-gram and a
1-layer draft of the same architecture), ``n=2``, preemption (recompute and swap), structured
output. The Triton attention backend, which has no soft-capping, refuses Gemma 2 at load.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import StructuredOutputSpec
from tests.media import long_text
from tests.models.text_archs import (
    ARCHS,
    build_checkpoint,
    hf_greedy,
    load_hf,
    make_adapter,
)

CHUNK = 16  # max_num_batched_tokens: every prompt below is prefilled in several chunks
ENGINE = dict(
    model_impl="transformers",
    block_size=4,
    max_num_batched_tokens=CHUNK,
    long_prefill_token_threshold=0,
    max_lora_rank=8,
)
# Attention the Triton backend refuses at load (soft-capping, sinks): these run on the torch
# backend whatever LORAPLEX_TEST_ATTENTION_BACKEND says (test_triton_refusals checks the refusal).
TORCH_ATTENTION = {"gemma2", "gpt_oss"}


def engine_fields(name: str, **over) -> dict:
    """``ENGINE`` for architecture ``name``, its attention backend pinned where it must be."""
    pinned = {"attention_backend": "torch"} if name in TORCH_ATTENTION else {}
    return {**ENGINE, **pinned, **over}


SHARED = long_text(40, seed=4)  # about 100 tokens: the prefix both batches share
LORA = "lora"
# (adapter or None, user message, max_tokens): the first batch, then one hitting its prefixes.
FIRST = [
    (None, "hello", 8),
    (None, SHARED + " tell me more", 10),
    (LORA, "hello", 8),
    (LORA, SHARED + " why", 10),
    (None, long_text(25, seed=5), 12),
]
SECOND = [
    (None, SHARED + " and then?", 8),
    (LORA, SHARED + " go on", 9),
    (LORA, long_text(15, seed=6), 7),
]
BASE_ONLY = [[(None, text, k) for _, text, k in batch] for batch in (FIRST, SECOND)]


class Built:
    """One architecture's checkpoint, tokenizer, transformers model and (lazily) adapter."""

    def __init__(self, name, root):
        from transformers import AutoTokenizer

        self.name = name
        self.dir = build_checkpoint(name, root / name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir)
        self.hf = load_hf(self.dir)
        self._adapter = None
        self._draft = None

    @property
    def adapter(self):
        """``(peft model, adapter directory)``, made once."""
        if self._adapter is None:
            out = self.dir.parent / f"{self.name}-adapter"
            self._adapter = (make_adapter(self.dir, ARCHS[self.name].lora_targets, out), out)
        return self._adapter

    def draft(self):
        """A draft of the same architecture: the checkpoint cut to its first layer.

        (LayerSkip's early exit, as ``engine.spec_decode.layer_skip`` cuts Llama drafts: the
        target's embeddings, first layer, final norm and head, so it agrees with the target
        more often than chance.)
        """
        if self._draft is None:
            model = load_hf(self.dir)
            model.model.layers = model.model.layers[:1]
            model.config.num_hidden_layers = 1
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[:1]
            self._draft = self.dir.parent / f"{self.name}-draft"
            model.save_pretrained(self._draft, safe_serialization=True)
            self.tokenizer.save_pretrained(self._draft)
        return str(self._draft)

    def oracle(self, batch):
        """``[(prompt ids, greedy ids)]``: transformers for base rows, peft for adapter rows."""
        return [
            hf_greedy(self.hf if a is None else self.adapter[0], self.tokenizer, text, k)
            for a, text, k in batch
        ]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> Built``, made once a module."""
    root = tmp_path_factory.mktemp("archs")
    made = {}

    def get(name):
        if name not in made:
            made[name] = Built(name, root)
        return made[name]

    return get


def requests(llm, batch, digest, tag, **sampling):
    """Engine requests of ``batch`` rows (greedy, the sampled token's logprob, ``sampling``)."""
    sampling = {"temperature": 0.0, "logprobs": 0, **sampling}
    return [
        llm.make_request(
            [{"role": "user", "content": text}],
            SamplingParams(max_tokens=k, **sampling),
            lora_digest=digest if a else None,
            request_id=f"{tag}-{i}",
        )
        for i, (a, text, k) in enumerate(batch)
    ]


def check(outs, oracle, tag=""):
    """Prompt and greedy tokens exact; the tokens' logprobs within 1e-3 of transformers'."""
    for i, (out, (prompt, expected, logprobs)) in enumerate(zip(outs, oracle, strict=True)):
        assert out.prompt_token_ids == prompt, f"{tag} request {i}: prompt tokens differ"
        completion = out.outputs[0]
        got = list(completion.token_ids)
        assert got == expected, f"{tag} request {i}: engine {got} != transformers {expected}"
        if completion.logprobs is not None:
            ours = [lp for lp, _ in completion.logprobs]
            torch.testing.assert_close(ours, logprobs, atol=1e-3, rtol=0)


def assert_clean(llm):
    assert llm.engine.kv.pool.num_used == 0
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def run_mixed(b, batches=(FIRST, SECOND), lora=True, hits=True, **engine):
    """Both batches through one engine, against the oracles; returns the engine.

    ``hits``: the second batch's shared-prefix rows must hit the prefix cache (not under a KV
    pool too small to keep the first batch's blocks).
    """
    llm = LLM(EngineConfig(model=str(b.dir), **engine_fields(b.name, **engine)))
    digest = llm.engine.add_lora_dir(b.adapter[1]).digest if lora else None
    for n, batch in enumerate(batches):
        oracle = b.oracle(batch)
        assert sum(len(p) > 2 * CHUNK for p, _, _ in oracle) >= 2, "prefills must be chunked"
        outs = llm.generate(requests(llm, batch, digest, f"b{n}"))
        check(outs, oracle, f"{b.name} batch {n}")
        if n == 1 and hits:  # the second batch's shared-prefix rows hit the first's blocks
            shared = [
                o for o, (_, text, _) in zip(outs, batch, strict=True) if text.startswith(SHARED)
            ]
            assert shared and all(o.num_cached_tokens > 0 for o in shared)
    assert_clean(llm)
    return llm


def adapter_matters(b):
    """The oracle itself: the adapter changes peft's greedy tokens on some prompt."""
    base = b.oracle([(None, t, k) for _, t, k in FIRST])
    lora = b.oracle([(LORA, t, k) for _, t, k in FIRST])
    return any(x[1] != y[1] for x, y in zip(base, lora, strict=True))


def check_architecture(b, **engine):
    """The adapter matters, then both mixed batches are exact (see the module docstring)."""
    assert adapter_matters(b)
    return run_mixed(b, **engine)


def test_qwen3_quick(built):
    # The fast tier's check: base rows only (no peft), chunked prefill and a prefix hit.
    run_mixed(built("qwen3"), BASE_ONLY, lora=False)


@pytest.mark.slow
def test_qwen3(built):
    check_architecture(built("qwen3"))


@pytest.mark.slow
def test_gemma2(built):
    check_architecture(built("gemma2"))


@pytest.mark.slow
def test_gemma3_text(built):
    check_architecture(built("gemma3_text"))


@pytest.mark.slow
def test_phi3(built):
    # Fused qkv_proj and gate_up_proj carry the adapter as they are.
    check_architecture(built("phi3"))


@pytest.mark.slow
def test_llama_native_and_transformers(built):
    # The engine's own Llama and transformers' through the backend: both exact against
    # transformers and peft, and seeded sampling (n=2) draws the same tokens from both.
    b = built("llama")
    assert adapter_matters(b)
    engines = {impl: run_mixed(b, model_impl=impl) for impl in ("native", "transformers")}
    assert type(engines["native"].engine.model).__name__ == "LlamaForCausalLM"
    sampled = {}
    for impl, llm in engines.items():
        digest = llm.engine.add_lora_dir(b.adapter[1]).digest
        outs = llm.generate(requests(llm, FIRST, digest, "s", n=2, temperature=1.0, seed=3))
        sampled[impl] = [[list(c.token_ids) for c in o.outputs] for o in outs]
        logprobs = [[lp for c in o.outputs for lp, _ in c.logprobs] for o in outs]
        sampled[impl + " logprobs"] = logprobs
    assert sampled["native"] == sampled["transformers"]
    torch.testing.assert_close(
        sampled["native logprobs"], sampled["transformers logprobs"], atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_gpt_neox(built):
    check_architecture(built("gpt_neox"))


@pytest.mark.slow
def test_gpt_bigcode(built):
    # One K/V head: the paged cache takes the head counts the layers pass, not the config's.
    llm = check_architecture(built("gpt_bigcode"))
    assert llm.engine.model.num_kv_heads == 1


@pytest.mark.slow
def test_gpt_oss(built):
    # Attention sinks (s_aux) in the paged attention, alternating sliding/full layers, yarn,
    # 4 experts top-2, attention biases; the adapter on the attention.
    check_architecture(built("gpt_oss"))


def test_attention_the_paged_attention_cannot_compute_is_refused_at_load(built, monkeypatch):
    # The load-time probe (engine/models/transformers_backend/probe.py). BLOOM's ALiBi attention
    # bypasses AttentionInterface; a model whose sinks the paged attention ignored (as before
    # it took s_aux) would go through it and give other hidden states. Both would run and
    # produce wrong tokens.
    with pytest.raises(ValueError, match="each of the 2 decoder layers must call it exactly once"):
        LLM(EngineConfig(model=str(built("bloom").dir), **ENGINE))
    from loraplex.engine.models.transformers_backend import attention

    forward = attention.paged_attention_forward

    def without_sinks(*args, s_aux=None, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention_forward", without_sinks)
    attention.register()
    try:
        with pytest.raises(ValueError, match="does not reproduce the model's own attention"):
            LLM(EngineConfig(model=str(built("gpt_oss").dir), **engine_fields("gpt_oss")))
    finally:
        monkeypatch.undo()
        attention.register()


LONGROPE = [
    (None, "hello", 8),  # short factors throughout
    (None, long_text(10, seed=1), 8),
    (None, long_text(40, seed=2), 8),  # a prompt past 64: long factors from the start
    (None, long_text(18, seed=9), 30),  # a prompt under 64 decoding past it
]


@pytest.mark.slow
def test_phi3_longrope(built):
    # longrope picks its factors from the sequence's length; in one batch row of every
    # sequence, each must still get its own (a short request batched with a long one got the
    # long factors: engine/models/transformers_backend/rotary.py).
    b = built("phi3_longrope")
    oracle = b.oracle(LONGROPE)
    lengths = [len(p) for p, _, _ in oracle]
    assert lengths[1] + 8 <= 64 < lengths[2] and lengths[3] < 64 < lengths[3] + 30
    crossing = 64 - lengths[3]  # tokens of the last row generated within 64 positions
    for chunk, exact in ((512, 3), (CHUNK, 2)):
        llm = LLM(
            EngineConfig(model=str(b.dir), **engine_fields(b.name, max_num_batched_tokens=chunk))
        )
        outs = llm.generate(requests(llm, LONGROPE, None, f"c{chunk}"))
        # Unchunked, the long prompt is exact too; chunked, its first chunks (within 64
        # positions) get the short factors, transformers' whole prompt the long ones.
        check(outs[:exact], oracle[:exact], f"chunks of {chunk}")
        # Past 64 positions transformers recomputes the whole sequence with the long factors
        # (Phi3ForCausalLM.prepare_inputs_for_generation); the engine keeps the KV it has:
        # exact up to the switch-over only (docs/transformers_text_archs.md).
        got = list(outs[3].outputs[0].token_ids)
        assert got[:crossing] == oracle[3][1][:crossing]


@pytest.mark.slow
def test_granite(built):
    check_architecture(built("granite"))


@pytest.mark.slow
def test_olmo2(built):
    check_architecture(built("olmo2"))


@pytest.mark.slow
def test_mixtral(built):
    check_architecture(built("mixtral"))


@pytest.mark.slow
def test_qwen3_moe(built):
    check_architecture(built("qwen3_moe"))


# The rest of the engine on two architectures: Qwen3 (q/k norms, yarn) and Gemma 2 (sliding
# windows, soft-capping, tied embeddings).
ENGINE_ARCHS = ["qwen3", "gemma2"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_speculative_decoding(built, name, kind):
    b = built(name)
    if kind == "ngram":
        spec = {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    else:  # a 1-layer draft of the same architecture, also through the transformers backend
        spec = {
            "speculative_method": "draft",
            "num_speculative_tokens": 3,
            "speculative_model": b.draft(),
        }
    llm = run_mixed(b, **spec)
    assert type(
        llm.engine.runner.draft.model if kind == "draft" else llm.engine.model
    ).__name__ == ("TransformersForCausalLM")
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "swap"])
@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_preemption(built, name, policy):
    # 40 blocks of 4 tokens hold the longest request but not the batch (about 90 blocks).
    llm = run_mixed(built(name), hits=False, num_kv_blocks=40, preemption=policy)
    assert llm.engine.scheduler.num_preemptions > 0
    assert (llm.engine.scheduler.num_swapped_out > 0) == (policy == "swap")


def teacher_forced_logprobs(model, prompt, tokens):
    """transformers' logprobs of ``tokens`` after ``prompt``, in one forward over both."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    steps = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    return steps[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_n_greater_than_one(built, name):
    b = built(name)
    llm = LLM(EngineConfig(model=str(b.dir), **engine_fields(b.name)))
    digest = llm.engine.add_lora_dir(b.adapter[1]).digest
    # Greedy, n=2: both children are the oracle's tokens (forked from one prefill).
    for out, (_, expected, _) in zip(
        llm.generate(requests(llm, FIRST, digest, "greedy", n=2)), b.oracle(FIRST), strict=True
    ):
        assert [list(c.token_ids) for c in out.outputs] == [expected, expected]
    # Seeded sampling, n=2: the children diverge from their shared prompt blocks; each child's
    # logprobs are transformers' (or peft's) over the prompt and that child's own tokens.
    outs = llm.generate(requests(llm, FIRST, digest, "sampled", n=2, temperature=1.0, seed=7))
    for out, (a, _, _) in zip(outs, FIRST, strict=True):
        model = b.hf if a is None else b.adapter[0]
        for child in out.outputs:
            tokens = list(child.token_ids)
            expected = teacher_forced_logprobs(model, out.prompt_token_ids, tokens)
            ours = [lp for lp, _ in child.logprobs]
            torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert sum(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outs) >= 3
    assert_clean(llm)


REPLY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_structured_output(built, name):
    # JSON-schema rows (base and adapter) in a batch with free rows: the constrained outputs
    # parse and validate, the free rows stay token-exact.
    b = built(name)
    llm = LLM(EngineConfig(model=str(b.dir), **engine_fields(b.name)))
    digest = llm.engine.add_lora_dir(b.adapter[1]).digest
    free = requests(llm, FIRST, digest, "free")
    spec = StructuredOutputSpec.json_schema(REPLY)
    constrained = requests(llm, [(None, "reply in JSON", 80), (LORA, SHARED, 80)], digest, "json")
    constrained = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, structured_output=spec))
        for r in constrained
    ]
    outs = llm.generate(free + constrained)
    check(outs[: len(free)], b.oracle(FIRST), name)
    replies = [json.loads(o.outputs[0].text) for o in outs[len(free) :]]
    for reply in replies:
        jsonschema.validate(reply, REPLY)
    assert replies[0] != replies[1]
    assert_clean(llm)


def test_triton_backend_refuses_soft_capping_and_sinks_at_load(built):
    # The Triton kernel has no attention soft cap: Gemma 2 is refused before anything runs,
    # as a target and as a draft.
    gemma2, qwen3 = built("gemma2"), built("qwen3")
    triton = {**ENGINE, "attention_backend": "triton"}
    with pytest.raises(ValueError, match="no attention logit soft-capping.*attn_logit_softcapping"):
        LLM(EngineConfig(model=str(gemma2.dir), **triton))
    draft = {"speculative_method": "draft", "speculative_model": str(gemma2.dir)}
    with pytest.raises(ValueError, match="speculative model needs"):
        LLM(EngineConfig(model=str(qwen3.dir), **triton, **draft, num_speculative_tokens=2))
    # Nor has it attention sinks (gpt-oss).
    with pytest.raises(ValueError, match="no attention sinks, which the model needs"):
        LLM(EngineConfig(model=str(built("gpt_oss").dir), **triton))


@pytest.mark.slow
def test_triton_backend(built):
    # The Triton kernels (interpreted on CPU, so one batch): paged attention with Gemma 3's
    # sliding windows, chunked prefill, and the Triton LoRA kernels on transformers' linears.
    run_mixed(built("gemma3_text"), (FIRST,), attention_backend="triton", max_num_batched_tokens=64)


def test_bidirectional_attention_is_refused(tmp_path):
    # An embedding model's bidirectional attention (Gemma 3's use_bidirectional_attention) has
    # no causal paged equivalent: refused at load, and ``auto`` says why.
    from loraplex.engine.models.loader import load_config
    from loraplex.engine.models.transformers_backend import supports

    model_dir = build_checkpoint("gemma3_text", tmp_path / "bidi", use_bidirectional_attention=True)
    assert "bidirectional" in supports(load_config(model_dir))
    with pytest.raises(ValueError, match="bidirectional"):
        LLM(EngineConfig(model=str(model_dir), model_impl="transformers"))
    # Whatever the config calls it, a decoder attention module that is not causal is refused.
    from loraplex.engine.models.transformers_backend import TransformersForCausalLM

    hf = load_hf(build_checkpoint("gemma3_text", tmp_path / "causal"))
    hf.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match="layer 1's attention is bidirectional"):
        TransformersForCausalLM(hf)
