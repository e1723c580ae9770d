"""Map tensor names to decoder projections, and resolve a config's targets as PEFT does.

PEFT names an adapter's tensors ``base_model.model.<module>.lora_A.weight`` (``lora_B``;
sometimes with the adapter name, ``lora_A.default.weight``), where ``<module>`` is the module's
name in the model it was trained on. Three layouts are accepted (see
:data:`adapters.base_model.LAYOUTS`); one file uses one. Targets are resolved by running PEFT's
own ``check_target_module_exists`` and ``get_pattern_key`` over the module names of that
layout, so list entries, regexes, ``layers_to_transform`` / ``layers_pattern``,
``exclude_modules`` and ``rank_pattern`` / ``alpha_pattern`` mean exactly what they mean in PEFT.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.adapters.base_model import CURRENT_LAYOUT, LAYOUTS, PROJECTIONS, BaseModelInfo, Layout
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.patterns import PatternBudget
from loraplex.adapters.peft_match import TargetMatcher, dot_suffixes

if TYPE_CHECKING:  # peft (with transformers and torch._dynamo) loads only where a config is parsed
    from peft import LoraConfig

_KEY_RE = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<ab>lora_[AB])(?:\.default)?\.weight")
ModuleKey = tuple[int, str]
"""``(layer_idx, projection)``, e.g. ``(3, "q_proj")``."""
MAX_PATTERN_EVALUATIONS = 10_000
"""Most regex evaluations (RE2 matches or index lookups) one adapter's config may need against
the served model's module names (a few microseconds each); past it the adapter is refused."""


@dataclass(frozen=True)
class TargetSpec:
    """One targeted projection as the config defines it.

    Attributes:
        module: Its full module name in the adapter's layout.
        rank: ``r`` (after ``rank_pattern``).
        alpha: ``lora_alpha`` (after ``alpha_pattern``).
        scale: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``.
    """

    module: str
    rank: int
    alpha: float
    scale: float


def _describe(module: str) -> str:
    """Name the part of the model an unsupported module belongs to."""
    if "vision_tower" in module or "vision_model" in module:
        return f"{module} (vision tower)"
    if "multi_modal_projector" in module:
        return f"{module} (multimodal projector)"
    if "embed_tokens" in module:
        return f"{module} (token embedding)"
    if module.split(".")[-1] == "lm_head":
        return f"{module} (output head)"
    return module


def _unsupported(modules: Iterable[str], what: str) -> AdapterError:
    names = sorted(set(modules))
    shown = ", ".join(_describe(m) for m in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return AdapterError(
        f"{what} {shown}{more}: only the language model's {', '.join(PROJECTIONS)} "
        "projections can carry LoRA here"
    )


def map_tensor_names(
    names: Iterable[str], info: BaseModelInfo
) -> tuple[Layout, dict[ModuleKey, dict[str, str]]]:
    """Assign every tensor to a decoder projection.

    Args:
        names: The tensor names of the weights file.
        info: Whether the served model is LLaVA (restricts the accepted layouts).

    Returns:
        The layout the names use, and ``(layer, projection) -> {"lora_A": name, "lora_B": name}``.

    Raises:
        AdapterError: a tensor for a module outside the decoder projections (named, with the
            part of the model it belongs to), an embedding LoRA, DoRA magnitudes, a bias or
            any other tensor; two layouts in one file; a layout of the other model kind.
    """
    allowed = [lay for lay in LAYOUTS if info.multimodal in (None, lay.multimodal)]
    found: dict[ModuleKey, dict[str, str]] = {}
    layouts: set[str] = set()
    outside: list[str] = []
    for name in names:
        match = _KEY_RE.fullmatch(name)
        if match is None:
            raise AdapterError(_odd_tensor(name))
        module = match["module"]
        parsed = next(((lay, lay.parse(module)) for lay in LAYOUTS if lay.parse(module)), None)
        if parsed is None:
            outside.append(module)
            continue
        layout, key = parsed
        if layout not in allowed:
            raise AdapterError(
                f"adapter was made for {layout.description} (tensor {name}), but the served "
                f"model is {CURRENT_LAYOUT[bool(info.multimodal)].description}"
            )
        layouts.add(layout.name)
        slot = found.setdefault(key, {})
        if match["ab"] in slot:
            raise AdapterError(f"tensor {name} duplicates {slot[match['ab']]}")
        slot[match["ab"]] = name
    if outside:
        raise _unsupported(outside, "adapter has LoRA weights for")
    if len(layouts) > 1:
        raise AdapterError(f"tensor names mix model layouts: {', '.join(sorted(layouts))}")
    layout = next((lay for lay in LAYOUTS if lay.name in layouts), None)
    return layout or CURRENT_LAYOUT[bool(info.multimodal)], found


def _odd_tensor(name: str) -> str:
    """Why a tensor that is not ``...lora_A/B.weight`` is refused."""
    if "lora_magnitude_vector" in name:
        return f"tensor {name} is a DoRA magnitude vector; DoRA is not supported"
    if "lora_embedding_" in name:
        return f"tensor {name} is an embedding LoRA; embeddings cannot carry LoRA here"
    if name.endswith(".bias"):
        return f"tensor {name} is a bias; adapters with biases are not supported"
    if name.startswith("base_model.model.") and name.endswith(".weight"):
        module = name[len("base_model.model.") : -len(".weight")].removesuffix(".base_layer")
        return (
            f"tensor {name} is a full weight of {_describe(module)}; adapters that carry base "
            "weights (a targeted or resized embedding or head, modules_to_save) are not supported"
        )
    return (
        f"unexpected tensor {name} (PEFT LoRA tensors are base_model.model.<module>.lora_A.weight)"
    )


def resolve_targets(
    config: LoraConfig, layout: Layout, num_layers: int, info: BaseModelInfo
) -> dict[ModuleKey, TargetSpec]:
    """The decoder projections the config targets, with their rank, alpha and scale.

    Args:
        config: The parsed config.
        layout: The layout of the adapter's tensor names (module names are resolved in it).
        num_layers: Decoder layers of the served model.
        info: The served model's other modules (resolved too, to refuse what they match).

    Returns:
        ``(layer, projection) -> TargetSpec``.

    Raises:
        AdapterError: the config also targets a module outside the decoder projections
            (vision tower, projector, embeddings, ``lm_head``); a ``target_modules`` list entry
            matching no module of the served model; no target at all; a pattern without a
            linear-time equivalent; more than :data:`MAX_PATTERN_EVALUATIONS` evaluations.
    """
    projections = {layout.module_name(i, p): (i, p) for i in range(num_layers) for p in PROJECTIONS}
    others = {layout.from_current(n): kind for n, kind in _other_modules(info, layout).items()}
    config = _expand_all_linear(config, list(projections), others, layout)
    universe = list(projections) + sorted(others)
    matcher = TargetMatcher(config, PatternBudget(MAX_PATTERN_EVALUATIONS))
    matched = [m for m in universe if matcher.targets_module(m)]
    bad = [m for m in matched if m not in projections]
    if bad:
        raise _unsupported(bad, "target_modules matches")
    if isinstance(config.target_modules, set | list | tuple):
        reachable = {s for m in universe for s in dot_suffixes(m)}
        for entry in sorted(config.target_modules):
            if entry not in reachable:
                raise AdapterError(
                    f"target_modules entry {entry!r} matches no module of the served model"
                )
    if not matched:
        raise AdapterError("adapter targets no module of the served model")
    return {projections[m]: _spec(config, matcher, m) for m in matched}


def _other_modules(info: BaseModelInfo, layout: Layout) -> Mapping[str, str]:
    """The served model's non-projection modules; at least its embedding and output head."""
    if info.module_types:
        return info.module_types
    current = CURRENT_LAYOUT[layout.multimodal]
    return {f"{current.decoder_prefix}embed_tokens": "Embedding", "lm_head": "Linear"}


def _expand_all_linear(
    config: LoraConfig, projections: list[str], others: Mapping[str, str], layout: Layout
) -> LoraConfig:
    """PEFT's ``"all-linear"``: every ``nn.Linear`` except the output head, as a name set."""
    targets = config.target_modules
    if not (isinstance(targets, str) and targets.lower() == "all-linear"):
        return config
    head = "language_model.lm_head" if layout.name == "llava-legacy" else "lm_head"
    linear = {n for n, kind in others.items() if kind in ("Linear", "Conv1D") and n != head}
    config = copy.copy(config)
    config.target_modules = set(projections) | linear
    return config


def _spec(config: LoraConfig, matcher: TargetMatcher, module: str) -> TargetSpec:
    """Rank, alpha and scale of one module, as PEFT's ``LoraModel._create_and_replace``."""
    budget = matcher.budget
    rank = (config.rank_pattern or {}).get(matcher.rank_keys.key_for(module, budget), config.r)
    alpha = (config.alpha_pattern or {}).get(
        matcher.alpha_keys.key_for(module, budget), config.lora_alpha
    )
    scale = lora_scale(alpha, rank, bool(config.use_rslora))
    return TargetSpec(module=module, rank=int(rank), alpha=float(alpha), scale=float(scale))


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank
