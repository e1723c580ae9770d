"""Adapter patterns run on RE2 with PEFT's exact meaning; catastrophic ones never reach ``re``.

The oracles are Python's ``re`` (on benign patterns) and PEFT's own
``check_target_module_exists`` / ``get_pattern_key``; hostile patterns are shown never to be
compiled by Python's regex engine by hooking ``re._compiler.compile``, which every ``re`` call
goes through, and failing on any client text.
"""

from __future__ import annotations

import re
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.layouts import layouts_of
from loraplex.adapters.patterns import FOLDS_TO_ASCII, PatternBudget, char_mask, compile_pattern
from loraplex.adapters.peft_match import PatternKeys, TargetMatcher
from loraplex.adapters.targets import MAX_PATTERN_EVALUATIONS, resolve_targets
from tests.adapters.conftest import LLAMA_PROJECTIONS as PROJECTIONS
from tests.adapters.conftest import llama_targets

# ------------------------------------------------------------------ strategies
_ATOMS = [
    "a", "e", "k", "K", "l", "m", "o", "p", "q", "s", "S", "x", "_", "0", "1", "2", "9",
    r"\.", ".", r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "[a-z]", "[^.]", "[0-9]", "[A-Z_]",
    "[^a-z]", r"[\w.]", r"[^\d\W]", "[k-q]", "[K]", "[\u212a]", "[\u017f]", "\u0130", "\u0131",
    "\u017f", "q_proj", "proj", "layers", "self_attn", "mlp", "lm_head", "model",
]  # fmt: skip
_QUANTS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{0,2}?", "{2,}"]
_ANCHORS = ["^", "$", r"\A", r"\Z", r"\b", r"\B"]
_FLAGS = ["", "", "", "(?i)", "(?a)", "(?s)", "(?ai)", "(?m)"]


@st.composite
def regexes(draw, depth: int = 2, quantified: bool = False) -> str:
    """Benign Python regexes over the module-name alphabet (star height at most 1)."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 9 if depth > 0 else 5))
        if kind <= 4:
            part = draw(st.sampled_from(_ATOMS))
        elif kind == 5:
            part = draw(st.sampled_from(_ANCHORS))
        elif kind <= 7:
            inner = draw(regexes(depth - 1, quantified))
            opener = draw(st.sampled_from(["(", "(?:", "(?i:", "(?-i:", "(?s:"]))
            part = opener + inner + ")"
        else:
            branches = draw(st.lists(regexes(depth - 1, quantified), min_size=2, max_size=3))
            part = "(?:" + "|".join(branches) + ")"
        if not quantified and part not in _ANCHORS and draw(st.booleans()):
            if kind >= 6 and "*" in part or "+" in part or "{" in part:
                pass  # keep star height 1, so Python's re stays quick as the oracle
            else:
                part = "(?:" + part + ")" + draw(st.sampled_from(_QUANTS))
        parts.append(part)
    return "".join(parts)


_SEGMENTS = [
    "model", "layers", "0", "1", "2", "11", "self_attn", "mlp", "q_proj", "k_proj", "v_proj",
    "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens", "language_model",
    "vision_tower", "fc1", "Q_PROJ", "kk", "ss", "x", "a_b", "",
]  # fmt: skip
names = st.lists(st.sampled_from(_SEGMENTS), min_size=1, max_size=6).map(".".join)


def _python(fn, pattern: str, name: str):
    """Python's answer, or "error" when Python refuses the pattern."""
    try:
        return fn(pattern, name) is not None
    except re.error:
        return "error"


def _ours(pattern: str, name: str, anchor: str):
    try:
        compiled = compile_pattern(pattern, "test")
    except AdapterError:
        return "error"
    return getattr(compiled.regex, anchor)(name.encode()) is not None


# --------------------------------------------------------- translation == re
@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.tuples(st.sampled_from(_FLAGS), regexes()).map("".join), name=names)
def test_translation_agrees_with_python_re(pattern, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn, anchor in ((re.fullmatch, "fullmatch"), (re.match, "match")):
            assert _ours(pattern, name, anchor) == _python(fn, pattern, name), pattern


@pytest.mark.parametrize("flags", [0, re.I, re.A, re.I | re.A, re.S])
def test_every_one_character_matcher_agrees_with_sre(flags):
    """Every class and literal over the case-folding-relevant code points, on all ASCII."""
    specials = [*"aksiKSI_5.\n\x1c", *map(chr, FOLDS_TO_ASCII)]
    classes = [re.escape(c) for c in specials] + [
        f"[{re.escape(c)}]" for c in specials
    ] + [f"[^{re.escape(c)}]" for c in specials] + [
        r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "[a-z]", "[A-Z]", "[Z-a]", "[^\\W\\d]",
        "[\u0100-\u2200]", "[\u0130-\u0131]", "[\x00-\U0010ffff]", "[^\x00-\x7f]", ".",
    ]  # fmt: skip
    from re import _parser

    for cls in classes:
        tree = list(_parser.parse(cls, flags))
        assert len(tree) == 1
        op, av = tree[0]
        mask = char_mask(op, av, _parser.parse(cls, flags).state.flags)
        expected = sum(1 << c for c in range(128) if re.fullmatch(cls, chr(c), flags))
        assert mask == expected, (cls, flags)


def test_folds_to_ascii_is_complete():
    """Every code point sre's Unicode case folding relates to ASCII is in the table."""
    import _sre
    from re import _casefix

    found = []
    for c in range(128, 0x110000):
        low = _sre.unicode_tolower(c)
        if low < 128 or any(x < 128 for x in _casefix._EXTRA_CASES.get(low, ())):
            found.append(c)
    assert tuple(found) == FOLDS_TO_ASCII


# ------------------------------------------------------------ PEFT semantics
def _llama_module(prefix: str, layer: int, projection: str) -> str:
    block = "self_attn" if projection in PROJECTIONS[:4] else "mlp"
    return f"{prefix}layers.{layer}.{block}.{projection}"


def _universe(num_layers: int = 12) -> list[str]:
    out = []
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        out += [_llama_module(prefix, i, p) for i in range(num_layers) for p in PROJECTIONS]
        out += [prefix + "embed_tokens", "lm_head"]
    out += [f"model.vision_tower.vision_model.encoder.layers.{i}.mlp.fc1" for i in range(3)]
    out += ["model.multi_modal_projector.linear_1", "Q_PROJ", "kk.ss"]
    return out


UNIVERSE = _universe()
_ENTRIES = st.sampled_from(
    ["q_proj", "v_proj", "down_proj", "self_attn.q_proj", "mlp.up_proj", "lm_head", "fc1",
     "layers.1.mlp.down_proj", "model.layers.3.self_attn.k_proj", "linear_1", "nothing"]
)  # fmt: skip
_KEYS = st.one_of(
    _ENTRIES,
    st.sampled_from(UNIVERSE),
    regexes(depth=1),
    st.sampled_from([r"layers\.1\d\..*", "layers.[0-4].self_attn.(q|k)_proj", "a)|(b", r".*"]),
)


@st.composite
def lora_configs(draw) -> LoraConfig:
    kwargs = {"r": 4, "lora_alpha": 8}
    if draw(st.booleans()):
        kwargs["target_modules"] = draw(st.lists(_ENTRIES, min_size=1, max_size=4))
        if draw(st.booleans()):
            kwargs["layers_to_transform"] = draw(
                st.one_of(st.integers(0, 12), st.lists(st.integers(0, 12), max_size=4))
            )
            kwargs["layers_pattern"] = draw(
                st.one_of(
                    st.none(),
                    st.sampled_from(["layers", "h", "", "lay.rs", "(?:layers|blocks)"]),
                    st.lists(st.sampled_from(["layers", "h", "encoder.layers"]), max_size=2),
                )
            )
    else:
        kwargs["target_modules"] = draw(
            st.one_of(regexes(), st.sampled_from([r".*\.(q|v)_proj", r".*language_model.*"]))
        )
    if draw(st.booleans()):
        kwargs["exclude_modules"] = draw(
            st.one_of(st.lists(_ENTRIES, max_size=3), regexes(depth=1))
        )
    kwargs["rank_pattern"] = {
        k: draw(st.integers(1, 16)) for k in draw(st.lists(_KEYS, max_size=5))
    }
    kwargs["alpha_pattern"] = {
        k: draw(st.integers(1, 64)) for k in draw(st.lists(_KEYS, max_size=5))
    }
    return LoraConfig(**kwargs)


def _peft_answers(config: LoraConfig):
    try:
        targeted = [bool(check_target_module_exists(config, m)) for m in UNIVERSE]
        ranks = [
            (
                config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), m), config.r),
                config.alpha_pattern.get(
                    get_pattern_key(config.alpha_pattern.keys(), m), config.lora_alpha
                ),
            )
            for m in UNIVERSE
        ]
    except re.error:
        return "error"
    return targeted, ranks


def _our_answers(config: LoraConfig):
    budget = PatternBudget(10**9)
    try:
        matcher = TargetMatcher(config, budget)
        targeted = [matcher.targets_module(m) for m in UNIVERSE]
        ranks = [
            (
                config.rank_pattern.get(matcher.rank_keys.key_for(m, budget), config.r),
                config.alpha_pattern.get(matcher.alpha_keys.key_for(m, budget), config.lora_alpha),
            )
            for m in UNIVERSE
        ]
    except AdapterError:
        return "error"
    return targeted, ranks


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=lora_configs())
def test_targets_ranks_and_alphas_agree_with_peft(config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = _peft_answers(config)
        ours = _our_answers(config)
        if ours == "error":  # refused up front: some pattern PEFT would fail on when it ran it
            assert _python_refuses_a_pattern(config)
        else:
            assert ours == peft


def _python_refuses_a_pattern(config: LoraConfig) -> bool:
    sources = [rf"(.*\.)?({k})$" for k in [*config.rank_pattern, *config.alpha_pattern]]
    for value in (config.target_modules, config.exclude_modules):
        if isinstance(value, str):
            sources.append(value)
    layers = config.layers_pattern
    for p in [layers] if isinstance(layers, str) else layers or []:
        sources.append(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
    for source in sources:
        try:
            re.compile(source)
        except re.error:
            return True
    return False


def test_eva_sized_rank_pattern_fits_the_budget():
    """One rank and one alpha key per module of an 80-layer model, as EVA writes them."""
    targets = llama_targets(80)
    keys = [(i, p) for i in range(80) for p in PROJECTIONS]
    modules = [_llama_module("model.", i, p) for i, p in keys]
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=list(PROJECTIONS),
        rank_pattern={m: 1 + i % 16 for i, m in enumerate(modules)},
        alpha_pattern={m: 2 + i % 16 for i, m in enumerate(modules)},
    )
    specs = resolve_targets(config, layouts_of(targets)[0], targets)
    assert len(specs) == len(modules)
    for i, (key, m) in enumerate(zip(keys, modules, strict=True)):
        assert specs[key].module == m
        assert specs[key].rank == 1 + i % 16
        assert specs[key].alpha == 2 + i % 16


def test_many_regex_keys_are_refused_by_the_evaluation_budget():
    targets = llama_targets(80)
    keys = {f"(?:x|y)*{i}z": 2 for i in range(400)}  # none matches: every module tries all
    config = LoraConfig(r=8, target_modules=list(PROJECTIONS), rank_pattern=keys)
    with pytest.raises(AdapterError, match=f"more than {MAX_PATTERN_EVALUATIONS} regex"):
        resolve_targets(config, layouts_of(targets)[0], targets)


def test_fixed_keys_index_keeps_peft_order():
    keys = PatternKeys(["zz", "q.proj", "q_proj", r"self_attn\.q_proj", "[pq]_proj"], "rank")
    budget = PatternBudget(1000)
    assert keys.key_for("model.layers.0.self_attn.q_proj", budget) == "q.proj"
    assert keys.key_for("model.layers.0.self_attn.p_proj", budget) == "[pq]_proj"
    assert keys.key_for("model.layers.0.mlp.up_proj", budget) == "model.layers.0.mlp.up_proj"


# ------------------------------------------------------------ hostile patterns
HOSTILE = [
    "(.*)(.*)(.*)(.*)(.*)(.*)(.*)x",
    "(a+)+$",
    "(a|aa)+b",
    "(a*)*b",
    r"(\w+\.)+q_projx",
    "((a+)+)+c",
    "(.*a){12}",
    "(x+x+)+y",
    "(x{1000}){1000}",
    "(.{0,999}){999}",
    "(?:a|a?)+$",
    r"(.*)\1",
    "(?=(.*)+x).*",
    "(?>.*)x",
    ".*+x",
]


@pytest.fixture
def no_python_regex_on(monkeypatch):
    """Fail if Python's regex compiler ever sees text containing a marker."""
    from re import _compiler

    markers: list[str] = []
    real = _compiler.compile

    def guarded(p, flags=0):
        text = p if isinstance(p, str) else getattr(p, "pattern", "")
        if isinstance(text, str):
            for marker in markers:
                assert marker not in text, f"Python re compiled a client pattern: {text!r}"
        return real(p, flags)

    re.purge()
    monkeypatch.setattr(_compiler, "compile", guarded)
    yield markers
    re.purge()


@pytest.mark.parametrize("pattern", HOSTILE)
@pytest.mark.parametrize(
    "field",
    ["target_modules", "exclude_modules", "rank_pattern", "alpha_pattern", "layers_pattern"],
)
def test_hostile_patterns_never_reach_python_re(pattern, field, no_python_regex_on):
    from loraplex.adapters.peft_config import parse_lora_config

    targets = llama_targets(2)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    if field in ("rank_pattern", "alpha_pattern"):
        config[field] = {pattern: 2}
    elif field == "layers_pattern":
        config.update(layers_pattern=pattern, layers_to_transform=[0])
    else:
        config[field] = pattern
    no_python_regex_on.append(pattern)
    import json

    try:  # matched by RE2 (accepted or refused for what it targets) or refused as a pattern
        parsed = parse_lora_config(json.dumps(config).encode(), max_rank=16)
        resolve_targets(parsed, layouts_of(targets)[0], targets)
    except AdapterError:
        pass
