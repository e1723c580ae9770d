"""The slowest adapter-config validation over a set of hostile module patterns.

Run from the repository root: ``python -m bench.hostile.patterns`` (a table, then one JSON line).

Each case is an ``adapter_config.json`` a hostile tenant could upload: catastrophic-backtracking
regexes (the 7-group pattern that froze a server for 64 s, ``(a+)+$``, ``(a|aa)+b``, nested
quantifiers, huge counted repetitions) in every pattern field, and the most expensive configs the
caps admit (4,096 ``rank_pattern`` keys, the full regex-character budget in 1,000-character
patterns, as many small regex keys as the character budget admits, which spend the whole
evaluation budget before they are refused). Validation is what an upload runs
before any tensor: ``parse_lora_config`` and ``resolve_targets`` against LLaVA-1.5-7B's module
names (``LlavaConfig()`` built on the meta device: 32 decoder layers, 224 projections, and the
24-layer CLIP vision tower in the universe). Each case is
timed alone (the slowest of three runs, after one untimed validation that imports what
validation imports on first use; the start-up heap frozen as ``serve`` does);
``max_pattern_ms`` is the slowest case, and the issue's bound is 100 ms. Every case is either
matched by RE2 or refused: none reaches Python's ``re``.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

from loraplex.adapters.base_model import ModelTargets, model_targets
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.layouts import layouts_of
from loraplex.adapters.peft_config import (
    MAX_PATTERN_KEYS,
    MAX_REGEX_CHARS,
    REGEX_PATTERN_COST,
    parse_lora_config,
)
from loraplex.adapters.targets import resolve_targets

NUM_LAYERS = 32
CATASTROPHIC = [
    "(.*)(.*)(.*)(.*)(.*)(.*)(.*)x",
    "(a+)+$",
    "(a|aa)+b",
    "((a*)*)*b",
    r"(\w+\.)+q_projx",
    "(x{1000}){1000}",
    "(.{0,999}){999}",
    "(.*a){20}",
]


def _llava_targets() -> ModelTargets:
    """LLaVA-1.5-7B's targets (transformers' default ``LlavaConfig``, on the meta device)."""
    from transformers import LlavaConfig

    targets = model_targets(LlavaConfig())
    assert targets.num_layers == NUM_LAYERS
    return targets


def cases(targets: ModelTargets) -> dict[str, dict[str, Any]]:
    """Name -> the config's JSON object."""
    lm_only = r".*language_model.*\.(q_proj|v_proj)"
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": lm_only}
    listed = {**base, "target_modules": ["q_proj"], "exclude_modules": r".*vision_tower.*"}
    out: dict[str, dict[str, Any]] = {}
    for i, pattern in enumerate(CATASTROPHIC):
        out[f"target_modules #{i}"] = {**base, "target_modules": pattern}
        out[f"exclude_modules #{i}"] = {**listed, "exclude_modules": pattern}
        out[f"rank_pattern #{i}"] = {**base, "rank_pattern": {pattern: 4}}
        out[f"layers_pattern #{i}"] = {
            **listed,
            "layers_pattern": pattern,
            "layers_to_transform": [0],
        }
    layout = layouts_of(targets)[0]  # model.language_model.layers.N...
    modules = [layout.module_name(i, t.path) for i in range(NUM_LAYERS) for t in targets.layer(i)]
    keys = [f"{m}.x{j}" for j in range(MAX_PATTERN_KEYS // len(modules) + 1) for m in modules]
    out["4096 plain rank/alpha keys"] = {
        **base,
        "rank_pattern": {k: 4 for k in keys[: MAX_PATTERN_KEYS // 2]},
        "alpha_pattern": {k: 8 for k in keys[MAX_PATTERN_KEYS // 2 : MAX_PATTERN_KEYS]},
    }
    width = 1000 - REGEX_PATTERN_COST
    groups = "(?:a|b)" * (width // 7)
    count = MAX_REGEX_CHARS // 1000 - 1  # the target regex takes its share too
    out["regex budget in ~1000-char patterns"] = {
        **base,
        "rank_pattern": {groups + f"{i}": 4 for i in range(count)},
    }
    room = MAX_REGEX_CHARS - len(listed["exclude_modules"]) - REGEX_PATTERN_COST
    small = [f"(?:x|y)*{i:02d}z" for i in range(room // (12 + REGEX_PATTERN_COST))]
    out["small regex keys past the evaluation budget"] = {
        **listed,
        "target_modules": list(targets.names),
        "rank_pattern": {k: 4 for k in small},
    }
    return out


def validate(config: dict[str, Any], targets: ModelTargets) -> str:
    """``"accepted"`` or ``"refused: <reason>"``: the config's validation, no tensors."""
    try:
        parsed = parse_lora_config(json.dumps(config).encode(), max_rank=64)
        resolve_targets(parsed, layouts_of(targets)[0], targets)
    except AdapterError as exc:
        return "refused: " + str(exc)[:70]
    return "accepted"


def run() -> dict[str, Any]:
    """Time every case; ``max_pattern_ms`` is the slowest (milliseconds)."""
    targets = _llava_targets()
    gc.collect()
    gc.freeze()  # as ``serve`` does before serving: the collector skips the start-up heap
    all_cases = cases(targets)
    validate(next(iter(all_cases.values())), targets)  # untimed: its first call imports peft
    rows = {}
    for name, config in all_cases.items():
        worst, outcome = 0.0, ""
        for _ in range(3):
            start = time.perf_counter()
            outcome = validate(config, targets)
            worst = max(worst, (time.perf_counter() - start) * 1000)
        rows[name] = (worst, outcome)
    gc.unfreeze()
    slowest = max(rows, key=lambda n: rows[n][0])
    return {
        "max_pattern_ms": round(rows[slowest][0], 2),
        "slowest_case": slowest,
        "cases": len(rows),
        "refused": sum(outcome.startswith("refused") for _, outcome in rows.values()),
        "rows": {name: [round(ms, 2), outcome] for name, (ms, outcome) in rows.items()},
    }


if __name__ == "__main__":
    result = run()
    for name, (ms, outcome) in result.pop("rows").items():
        print(f"{name:40s} {ms:8.2f} ms  {outcome}")
    print(json.dumps(result))
