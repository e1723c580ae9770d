"""The engine flags of ``serve`` and ``generate``, generated from ``EngineConfig`` (docs/cli.md).

Every field of :class:`~loraplex.engine.config.EngineConfig` is a flag here, named after the
field and helped by its docstring (``gateway.commands.config_flags``), except ``model`` (a
directory, a Hub id, a .gguf file or the built-in tiny model: ``--model``, resolved by the
command), ``model_source`` (set by that resolution) and ``enable_kv_events`` (the replica set
sets it). What the field cannot say (another flag name, a size parser) is in
:data:`FLAG_SPECS`. The engine core process's timeouts are ``serve``'s alone: ``generate`` runs
the engine on its own thread.
"""

from __future__ import annotations

import argparse
import dataclasses

from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache.sizing import parse_size
from loraplex.gateway.commands.config_flags import FlagSpec, add_config_flags, config_kwargs


def _size(text: str) -> int:
    """The argparse type of a size flag: ``4GiB``, ``512MiB`` or bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_or_zero(text: str) -> int:
    """A size, or ``0`` for none."""
    return 0 if text.strip() == "0" else _size(text)


def _show_size(n: int) -> str:
    """Bytes as the largest binary unit that divides them: 2GiB, 256MiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _gib_or_size(text: str) -> int:
    """A size (``8GiB``), or a bare number of GiB as vLLM's ``--kv-offloading-size``; 0: none."""
    try:
        gib = float(text)
    except ValueError:
        return _size(text)
    if gib < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(gib * 1024**3)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """The argparse type of ``--cuda-graph-sizes``: comma-separated positive integers."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes such as 1,2,4,8, got {text!r}"
        ) from None
    if not sizes or min(sizes) <= 0 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(
            f"batch sizes must be distinct positive integers, got {text!r}"
        )
    return sizes


def _cpu_threads_bind(text: str) -> str:
    """The argparse type of ``--cpu-threads-bind``: auto, nobind or CPU lists of this machine.

    Checked here, before anything loads: the syntax and that every CPU is one this process
    may run on (``engine.core.cpu_bind``); a list per replica is checked against
    ``--replicas`` by ``serve``.
    """
    from loraplex.engine.core.cpu_bind import check_allowed, normalize_bind, parse_bind

    try:
        parsed = parse_bind(text)
        if not isinstance(parsed, str):
            check_allowed(parsed)
        return normalize_bind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Flags whose name, metavar or parser is not the field's own.
FLAG_SPECS: dict[str, FlagSpec] = {
    "kv_cache_memory_bytes": FlagSpec(flag="--kv-cache-memory", metavar="SIZE", parse=_size),
    "swap_space_bytes": FlagSpec(
        flag="--swap-space", metavar="SIZE", parse=_size, show_default=_show_size
    ),
    "kv_offloading_bytes": FlagSpec(
        flag="--kv-offloading-size", metavar="SIZE", parse=_gib_or_size, show_default=_show_size
    ),
    "kv_disk_dir": FlagSpec(metavar="DIR"),
    "kv_disk_bytes": FlagSpec(
        flag="--kv-disk-size", metavar="SIZE", parse=_size_or_zero, show_default=_show_size
    ),
    "kv_remote_url": FlagSpec(metavar="URL"),
    "kv_remote_bytes": FlagSpec(
        flag="--kv-remote-size", metavar="SIZE", parse=_size_or_zero, show_default=_show_size
    ),
    "cuda_graph_sizes": FlagSpec(metavar="N,N,...", parse=_batch_sizes),
    "num_speculative_tokens": FlagSpec(metavar="K"),
    "batch_yield_s": FlagSpec(metavar="S", show_default="{:g}".format),
    "num_cpu_threads": FlagSpec(flag="--cpu-threads", metavar="N", aliases=("--num-cpu-threads",)),
    "cpu_threads_bind": FlagSpec(metavar="auto|nobind|CPUS", parse=_cpu_threads_bind),
    "speculative_model": FlagSpec(metavar="MODEL"),
    "grammar_workers": FlagSpec(metavar="N"),
    "grammar_cpu_seconds": FlagSpec(
        flag="--grammar-timeout", metavar="S", show_default="{:g}".format
    ),
    "grammar_memory_bytes": FlagSpec(
        flag="--grammar-memory", metavar="SIZE", parse=_size_or_zero, show_default=_show_size
    ),
    "unresponsive_timeout_s": FlagSpec(
        flag="--engine-unresponsive-timeout", metavar="S", show_default="{:g}".format
    ),
    "dead_timeout_s": FlagSpec(
        flag="--engine-dead-timeout", metavar="S", show_default="{:g}".format
    ),
    "step_timeout_s": FlagSpec(
        flag="--engine-step-timeout", metavar="S", show_default="{:g}".format
    ),
}

#: Fields that are not flags: the command resolves ``model`` (and sets ``model_source`` doing
#: it); the replica set sets ``enable_kv_events``.
NOT_FLAGS = ("model", "model_source", "enable_kv_events")

#: Fields only ``serve`` has a flag for: they watch an engine core in its own process.
CORE_PROCESS_FIELDS = ("unresponsive_timeout_s", "dead_timeout_s", "step_timeout_s")


def engine_flag_fields(*, core_process: bool) -> list[str]:
    """The ``EngineConfig`` fields that are flags of a command, in declaration order."""
    skip = set(NOT_FLAGS) | (set() if core_process else set(CORE_PROCESS_FIELDS))
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in skip]


def add_engine_args(parser: argparse.ArgumentParser, *, core_process: bool = False) -> None:
    """Add ``--model``, ``--data-dir`` and one flag per engine field to a subcommand's parser.

    Args:
        parser: The subcommand's parser.
        core_process: Also the flags of the engine core process's timeouts (``serve``).
    """
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory, a Hub id (org/name: fetched into the HF cache, "
        "see --revision; HF_TOKEN, HF_HUB_OFFLINE) or a .gguf file (dequantized once into a "
        "cached directory) (default: the built-in tiny LLaVA)",
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="data directory (default: $LORAPLEX_DATA_DIR or ./.loraplex)",
    )
    add_config_flags(g, EngineConfig, engine_flag_fields(core_process=core_process), FLAG_SPECS)


def config_from_args(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    """The frozen engine config of parsed flags (fields without a flag keep their default).

    Raises:
        ValueError: an invalid combination (``EngineConfig``'s checks).
    """
    present = [f for f in engine_flag_fields(core_process=True) if hasattr(args, f)]
    return EngineConfig(model=model_dir, **config_kwargs(args, present))
