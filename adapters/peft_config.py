"""Parse ``adapter_config.json`` through PEFT's own ``LoraConfig`` and refuse what we cannot serve.

Served: plain LoRA (``y += scale * x @ A.T @ B.T``, ``scale = alpha / r`` or
``alpha / sqrt(r)`` with rsLoRA) with per-module ``rank_pattern`` / ``alpha_pattern``, list,
regex or ``"all-linear"`` targets, ``exclude_modules``, ``layers_to_transform`` /
``layers_pattern``. Refused, each with its own message: other PEFT types, DoRA, biases,
``modules_to_save``, ``fan_in_fan_out``, LoRA variants that change the forward pass (aLoRA,
QALoRA, BD-LoRA, Arrow, MonteCLoRA, KaSA, ``lora_bias``, ``layer_replication``,
``target_parameters``, trainable tokens) and initializations that rewrite the base weights
(PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) unless PEFT converted them back to plain LoRA on save.

Module patterns are only type-, count- and length-checked here: ``LoraConfig`` stores them
without running them, and they are compiled for RE2 (or refused) by :mod:`adapters.peft_match`
when targets are resolved, so no client pattern ever reaches Python's backtracking ``re``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from typing import TYPE_CHECKING, Any

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.patterns import MAX_PATTERN_CHARS, is_plain_name

if TYPE_CHECKING:
    from peft import LoraConfig


@functools.cache
def _lora_config_class() -> type[LoraConfig]:
    """PEFT's ``LoraConfig``, imported on the first config parsed.

    ``import peft`` pulls in transformers' modeling code and ``torch._dynamo`` (seconds of
    start-up, and triton with it); the server needs it only when an adapter is uploaded or read.
    """
    from peft import LoraConfig

    return LoraConfig


@functools.cache
def _fields() -> frozenset[str]:
    """The keyword arguments ``LoraConfig`` takes."""
    return frozenset(f.name for f in dataclasses.fields(_lora_config_class()))


# Keys with a truthy value that changes what the adapter computes, and why we refuse them.
_REFUSED = {
    "use_dora": "DoRA (use_dora=true) is not supported",
    "modules_to_save": "modules_to_save is not supported (only LoRA deltas are served)",
    "fan_in_fan_out": "fan_in_fan_out=true is not supported (the targets are nn.Linear)",
    "lora_bias": "lora_bias=true (a bias on lora_B) is not supported",
    "use_qalora": "QALoRA (use_qalora=true) is not supported",
    "target_parameters": (
        "target_parameters (LoRA on raw parameters, such as a mixture of experts' fused expert "
        "weights, which PEFT targets this way when target_modules names them) is not supported; "
        "only nn.Linear modules can carry LoRA here"
    ),
    "trainable_token_indices": "trainable_token_indices is not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported: it rewrites the base weights",
}
# init_lora_weights values that leave a residual in the base weights.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
MAX_CONFIG_BYTES = 256 * 1024
"""Largest ``adapter_config.json`` accepted (PEFT writes ~1 KiB; EVA's per-module
``rank_pattern`` and ``alpha_pattern`` for an 80-layer model ~60 KiB)."""
MAX_PATTERN_KEYS = 4096
"""Most ``rank_pattern`` plus ``alpha_pattern`` entries (EVA writes one per targeted module)."""
MAX_LAYERS_PATTERNS = 64
"""Most ``layers_pattern`` entries."""
MAX_REGEX_CHARS = 4096
"""Most characters of regex over all patterns of one config, each pattern counting
:data:`REGEX_PATTERN_COST` more than its length (its fixed cost to parse and compile). Keys that
are plain module names (``A-Z a-z 0-9 _ .`` only) do not count: they are matched from an index,
never parsed."""
REGEX_PATTERN_COST = 64


def parse_lora_config(config_bytes: bytes, *, max_rank: int) -> LoraConfig:
    """Parse and check ``adapter_config.json``.

    Args:
        config_bytes: The file's bytes (UTF-8 JSON).
        max_rank: The largest rank served (``--max-lora-rank``).

    Returns:
        PEFT's ``LoraConfig`` (``target_modules`` a set or a regex string).

    Raises:
        AdapterError: not a JSON object; ``peft_type`` missing or not LORA; an unsupported
            feature (see the module docstring); an unknown key with a non-empty value;
            ``r`` / ``rank_pattern`` values outside ``1..max_rank``; a non-positive or
            non-finite alpha; ``bias`` other than "none"; no ``target_modules``; a pattern
            longer than :data:`adapters.patterns.MAX_PATTERN_CHARS`, more of them than
            :data:`MAX_PATTERN_KEYS` / :data:`MAX_LAYERS_PATTERNS`, more regex than
            :data:`MAX_REGEX_CHARS` in all; a file over
            :data:`MAX_CONFIG_BYTES`; anything PEFT's own checks reject. The patterns
            themselves are compiled (or refused) when targets are resolved
            (:mod:`adapters.peft_match`); nothing here runs them, and ``LoraConfig`` only
            stores them.
    """
    if len(config_bytes) > MAX_CONFIG_BYTES:
        raise AdapterError(
            f"adapter_config.json is {len(config_bytes)} bytes; at most {MAX_CONFIG_BYTES} "
            "are accepted"
        )
    try:
        raw = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from None
    except RecursionError:
        raise AdapterError("adapter_config.json nests too deeply") from None
    if not isinstance(raw, dict):
        raise AdapterError("adapter_config.json must be a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type is None:
        raise AdapterError("adapter_config.json has no peft_type (expected LORA)")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    kwargs = _known_kwargs(raw)
    for key, reason in _REFUSED.items():
        if kwargs.get(key):
            raise AdapterError(reason)
    if kwargs.get("bias", "none") != "none":
        raise AdapterError(f"bias={kwargs['bias']!r} is not supported (only 'none')")
    init = kwargs.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"init_lora_weights={init!r} adapters need modified base weights; convert them "
            "with save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
    _check_numbers(kwargs, max_rank)
    _check_patterns(kwargs)
    kwargs.pop("runtime_config", None)  # not a saved setting; PEFT drops it too
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = _lora_config_class()(**kwargs)
    except Exception as exc:  # noqa: BLE001 - PEFT raises ValueError, TypeError, ImportError
        raise AdapterError(f"adapter_config.json is not a valid LoRA config: {exc}") from None
    if not config.target_modules:
        raise AdapterError("adapter_config.json names no target_modules")
    return config


def _known_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    """Drop unknown keys that are empty (a newer PEFT's feature, switched off); refuse others."""
    fields = _fields()
    unknown = {k: v for k, v in raw.items() if k not in fields}
    active = sorted(k for k, v in unknown.items() if v not in (None, False, "", [], {}))
    if active:
        raise AdapterError(
            f"adapter_config.json sets options this server does not know: {', '.join(active)}"
        )
    return {k: v for k, v in raw.items() if k in fields}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_numbers(kwargs: dict[str, Any], max_rank: int) -> None:
    """Ranks are integers in ``1..max_rank``; alphas are positive finite numbers."""
    ranks = {"r": kwargs.get("r", 8)}
    alphas = {"lora_alpha": kwargs.get("lora_alpha", 8)}
    for name, table in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        pattern = kwargs.get(name) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{name} must be an object of pattern -> value")
        table.update({f"{name}[{k!r}]": v for k, v in pattern.items()})
    for where, r in ranks.items():
        if not (isinstance(r, int) and not isinstance(r, bool)) or r < 1:
            raise AdapterError(f"{where} = {r!r} is not a positive integer rank")
        if r > max_rank:
            raise AdapterError(f"{where} = {r} exceeds the server's max LoRA rank {max_rank}")
    for where, alpha in alphas.items():
        if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
            raise AdapterError(f"{where} = {alpha!r} is not a positive number")
    if not isinstance(kwargs.get("use_rslora", False), bool):
        raise AdapterError("use_rslora must be true or false")


def _check_length(pattern: str, where: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{where} pattern is longer than {MAX_PATTERN_CHARS} characters")


def _check_patterns(kwargs: dict[str, Any]) -> None:
    """Types, counts and lengths of the matching options (the regexes compile later)."""
    targets = kwargs.get("target_modules")
    if isinstance(targets, str):
        _check_length(targets, "target_modules")
    elif targets is not None and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise AdapterError("target_modules must be a list of names or a regex string")
    excluded = kwargs.get("exclude_modules")
    if isinstance(excluded, str):
        _check_length(excluded, "exclude_modules")
    elif excluded is not None and not (
        isinstance(excluded, list) and all(isinstance(t, str) for t in excluded)
    ):
        raise AdapterError("exclude_modules must be a list of names or a regex string")
    keys = [(k, n) for n in ("rank_pattern", "alpha_pattern") for k in kwargs.get(n) or {}]
    if len(keys) > MAX_PATTERN_KEYS:
        raise AdapterError(
            f"rank_pattern and alpha_pattern hold {len(keys)} entries; at most "
            f"{MAX_PATTERN_KEYS} are accepted"
        )
    regexes = [(k, n) for k, n in keys if not is_plain_name(k)]
    for key, name in keys:
        _check_length(key, name)
    layers = kwargs.get("layers_to_transform")
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) for i in layers))
    ):
        raise AdapterError("layers_to_transform must be an integer or a list of integers")
    pattern = kwargs.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if patterns is not None:
        if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
            raise AdapterError("layers_pattern must be a string or a list of strings")
        if len(patterns) > MAX_LAYERS_PATTERNS:
            raise AdapterError(f"layers_pattern holds more than {MAX_LAYERS_PATTERNS} patterns")
        for p in patterns:
            _check_length(p, "layers_pattern")
        regexes += [(p, "layers_pattern") for p in patterns]
    regexes += [(v, n) for v, n in ((targets, "target_modules"), (excluded, "exclude_modules"))]
    total = sum(len(p) + REGEX_PATTERN_COST for p, _ in regexes if isinstance(p, str))
    if total > MAX_REGEX_CHARS:
        raise AdapterError(
            f"the config's regex patterns weigh {total} characters ({REGEX_PATTERN_COST} per "
            f"pattern plus its length); at most {MAX_REGEX_CHARS} are accepted (plain module "
            "names in rank_pattern / alpha_pattern do not count)"
        )
