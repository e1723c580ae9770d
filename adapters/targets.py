"""Map tensor names to the served model's LoRA targets, and resolve a config's targets as PEFT does.

PEFT names an adapter's tensors ``base_model.model.<module>.lora_A.weight`` (``lora_B``;
sometimes with the adapter name, ``lora_A.default.weight``), where ``<module>`` is the module's
name in the model it was trained on. A target is ``<layers_prefix>.<layer>.<path>``, one of the
``nn.Linear`` modules of a decoder layer (:class:`adapters.base_model.ModelTargets`), in one of
the model's layouts (:mod:`adapters.layouts`); one file uses one layout. Targets are resolved by
running PEFT's own ``check_target_module_exists`` and ``get_pattern_key`` semantics
(:mod:`adapters.peft_match`) over the module names of that layout, so list entries, regexes,
``layers_to_transform`` / ``layers_pattern``, ``exclude_modules`` and ``rank_pattern`` /
``alpha_pattern`` mean exactly what they mean in PEFT. A config that also matches a module that
cannot carry LoRA here (vision tower, projector, embeddings, ``lm_head``) is refused, and the
message lists what the served model may target.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.adapters.base_model import ModelTargets
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.layouts import Layout, describe_layers, known_prefix, layouts_of
from loraplex.adapters.patterns import PatternBudget
from loraplex.adapters.peft_match import TargetMatcher, dot_suffixes

if TYPE_CHECKING:  # peft (with transformers and torch._dynamo) loads only where a config is parsed
    from peft import LoraConfig

_KEY_RE = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<ab>lora_[AB])(?:\.default)?\.weight")
_LAYER_RE = re.compile(r"0|[1-9][0-9]{0,5}")
_VISION = ("vision", "visual", "image_encoder", "image_tower")
_PROJECTOR = ("multi_modal_projector", "mm_projector", "connector", "projector")
_LISTED_NAMES = 24
ModuleKey = tuple[int, str]
"""``(layer_idx, target name)``, e.g. ``(3, "q_proj")``: the keys of ``model.lora_targets()``."""
MAX_PATTERN_EVALUATIONS = 10_000
"""Most regex evaluations (RE2 matches or index lookups) one adapter's config may need against
the served model's module names (a few microseconds each); past it the adapter is refused."""


@dataclass(frozen=True)
class TargetSpec:
    """One targeted module as the config defines it.

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


def may_target(targets: ModelTargets) -> str:
    """``"<architecture> may target: q_proj, k_proj, ..."``, for messages."""
    names = targets.names
    shown = ", ".join(names[:_LISTED_NAMES])
    more = f" and {len(names) - _LISTED_NAMES} more" if len(names) > _LISTED_NAMES else ""
    if not names:
        return f"{targets.architecture} has no linear layer in its decoder layers to target"
    return (
        f"{targets.architecture} may target: {shown}{more} (in its decoder layers "
        f"{targets.layers_prefix}.N)"
    )


class _Modules:
    """The served model's module names in every accepted layout, for tensor and target names."""

    def __init__(self, targets: ModelTargets) -> None:
        self.targets = targets
        self.layouts = layouts_of(targets)
        self._by_kind = [{t.path: t.name for t in kind} for kind in targets.kinds]
        self._any = {path: name for paths in self._by_kind for path, name in paths.items()}
        self.others = {
            lay.from_current(name): (name, kind)
            for lay in self.layouts
            for name, kind in targets.others.items()
        }

    def parse(self, module: str) -> tuple[Layout, ModuleKey] | None:
        """``(layout, (layer, name))`` of a target's module name, else None.

        A layer index past the model's last layer still parses (by any layer's paths), so the
        caller can say which layer is missing.
        """
        for layout in self.layouts:
            head = layout.layers_prefix + "."
            if not module.startswith(head):
                continue
            index, dot, path = module[len(head) :].partition(".")
            if not dot or _LAYER_RE.fullmatch(index) is None:
                continue
            layer = int(index)
            names = (
                self._by_kind[self.targets.layer_kinds[layer]]
                if layer < self.targets.num_layers
                else self._any
            )
            name = names.get(path)
            if name is not None:
                return layout, (layer, name)
        return None

    def foreign_prefix(self, module: str) -> str | None:
        """The decoder-layer prefix of another model kind's layout ``module`` uses, if any."""
        if module in self.others:
            return None
        parts = module.split(".")
        for k in range(1, len(parts) - 1):
            prefix = ".".join(parts[:k])
            if _LAYER_RE.fullmatch(parts[k]) is None or ".".join(parts[k + 1 :]) not in self._any:
                continue
            if known_prefix(prefix) and all(prefix != lay.layers_prefix for lay in self.layouts):
                return prefix
        return None

    def describe(self, module: str) -> str:
        """Name the part of the model a module that cannot carry LoRA belongs to."""
        current, kind = self.others.get(module, (module, None))
        segments = current.split(".")
        if any(v in s for s in segments for v in _VISION):
            return f"{module} (vision tower)"
        if any(p in s for s in segments for p in _PROJECTOR):
            return f"{module} (multimodal projector)"
        if kind == "Embedding" or (kind is None and "embed_tokens" in current):
            return f"{module} (token embedding)"
        if current == self.targets.head or segments[-1] == "lm_head":
            return f"{module} (output head)"
        return module


def _unsupported(modules: Iterable[str], what: str, index: _Modules) -> AdapterError:
    names = sorted(set(modules))
    shown = ", ".join(index.describe(m) for m in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return AdapterError(
        f"{what} {shown}{more}: only the linear layers of the language model's decoder layers "
        f"can carry LoRA here; {may_target(index.targets)}"
    )


def map_tensor_names(
    names: Iterable[str], targets: ModelTargets
) -> tuple[Layout, dict[ModuleKey, dict[str, str]]]:
    """Assign every tensor to a target of the served model.

    Args:
        names: The tensor names of the weights file.
        targets: The served model's targets.

    Returns:
        The layout the names use, and ``(layer, name) -> {"lora_A": tensor, "lora_B": tensor}``.

    Raises:
        AdapterError: a tensor for a module outside the targets (named, with the part of the
            model it belongs to, and what may be targeted), an embedding LoRA, DoRA magnitudes,
            a bias or any other tensor; two layouts in one file; another kind of model's layout.
    """
    index = _Modules(targets)
    found: dict[ModuleKey, dict[str, str]] = {}
    layouts: dict[str, Layout] = {}
    outside: list[str] = []
    for name in names:
        match = _KEY_RE.fullmatch(name)
        if match is None:
            raise AdapterError(_odd_tensor(name, index))
        module = match["module"]
        parsed = index.parse(module)
        if parsed is None:
            foreign = index.foreign_prefix(module)
            if foreign is not None:
                raise AdapterError(
                    f"adapter was made for {describe_layers(foreign)} (tensor {name}), but the "
                    f"served model is {describe_layers(targets.layers_prefix)}, "
                    f"{targets.architecture}"
                )
            outside.append(module)
            continue
        layout, key = parsed
        layouts[layout.name] = layout
        slot = found.setdefault(key, {})
        if match["ab"] in slot:
            raise AdapterError(f"tensor {name} duplicates {slot[match['ab']]}")
        slot[match["ab"]] = name
    if outside:
        raise _unsupported(outside, "adapter has LoRA weights for", index)
    if len(layouts) > 1:
        raise AdapterError(f"tensor names mix model layouts: {', '.join(sorted(layouts))}")
    return next(iter(layouts.values()), index.layouts[0]), found


def _odd_tensor(name: str, index: _Modules) -> str:
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
            f"tensor {name} is a full weight of {index.describe(module)}; adapters that carry "
            "base weights (a targeted or resized embedding or head, modules_to_save) are not "
            f"supported; {may_target(index.targets)}"
        )
    return (
        f"unexpected tensor {name} (PEFT LoRA tensors are base_model.model.<module>.lora_A.weight)"
    )


def resolve_targets(
    config: LoraConfig, layout: Layout, targets: ModelTargets
) -> dict[ModuleKey, TargetSpec]:
    """The served model's targets the config targets, with their rank, alpha and scale.

    Args:
        config: The parsed config.
        layout: The layout of the adapter's tensor names (module names are resolved in it).
        targets: The served model's targets and other modules (resolved too, to refuse what
            they match).

    Returns:
        ``(layer, name) -> TargetSpec``.

    Raises:
        AdapterError: the config also targets a module outside the targets (vision tower,
            projector, embeddings, ``lm_head``); a ``target_modules`` list entry matching no
            module of the served model; no target at all; a pattern without a linear-time
            equivalent; more than :data:`MAX_PATTERN_EVALUATIONS` evaluations.
    """
    index = _Modules(targets)
    modules = {
        layout.module_name(i, t.path): (i, t.name)
        for i in range(targets.num_layers)
        for t in targets.layer(i)
    }
    others = {layout.from_current(n): kind for n, kind in targets.others.items()}
    head = layout.from_current(targets.head) if targets.head else None
    config = _expand_all_linear(config, list(modules), others, head)
    universe = list(modules) + sorted(others)
    if isinstance(config.target_modules, set | list | tuple):
        reachable = {s for m in universe for s in dot_suffixes(m)}
        for entry in sorted(config.target_modules):
            if entry not in reachable:
                raise AdapterError(
                    f"target_modules entry {entry!r} matches no module of the served model that "
                    f"can carry LoRA; {may_target(targets)}"
                )
    matcher = TargetMatcher(config, PatternBudget(MAX_PATTERN_EVALUATIONS))
    matched = [m for m in universe if matcher.targets_module(m)]
    bad = [m for m in matched if m not in modules]
    if bad:
        raise _unsupported(bad, "target_modules matches", index)
    if not matched:
        raise AdapterError(f"adapter targets no module of the served model; {may_target(targets)}")
    return {modules[m]: _spec(config, matcher, m) for m in matched}


def _expand_all_linear(
    config: LoraConfig, modules: list[str], others: Mapping[str, str], head: str | None
) -> LoraConfig:
    """PEFT's ``"all-linear"``: every ``nn.Linear`` / ``Conv1D`` but the output head, as names."""
    targets = config.target_modules
    if not (isinstance(targets, str) and targets.lower() == "all-linear"):
        return config
    linear = {n for n, kind in others.items() if kind in ("Linear", "Conv1D") and n != head}
    config = copy.copy(config)
    config.target_modules = set(modules) | linear
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
