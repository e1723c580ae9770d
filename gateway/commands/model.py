"""``loraplex model init-tiny DIR [--seed N] [--text-only]``, ``loraplex model targets MODEL``."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers) -> None:
    """Add the ``model`` command group."""
    model = subparsers.add_parser("model", help="model utilities")
    sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    tiny = sub.add_parser("init-tiny", help="write the built-in tiny random-weight model")
    tiny.add_argument("directory", help="where to write it (created; a Hugging Face directory)")
    tiny.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (serve's own model: 0)"
    )
    tiny.add_argument(
        "--text-only", action="store_true", help="a Llama text model instead of the LLaVA"
    )
    tiny.add_argument(
        "--preset",
        default=None,
        help="a larger named configuration (e.g. 'bench', about 30M parameters; default: the "
        "tiny one)",
    )
    tiny.set_defaults(func=_init_tiny)
    targets = sub.add_parser(
        "targets",
        help="what a LoRA adapter for a model may target (from its config; no weights are read)",
    )
    targets.add_argument(
        "model",
        help="a model directory (config.json), or a Hub id AutoConfig.from_pretrained takes",
    )
    targets.set_defaults(func=_targets)


def _init_tiny(args: argparse.Namespace) -> int:
    from loraplex.engine.models.tiny_model import init_tiny

    kwargs = {"seed": args.seed, "text_only": args.text_only}
    if args.preset:
        kwargs["preset"] = args.preset
    path = init_tiny(args.directory, **kwargs)
    print(json.dumps({"model": str(path), "seed": args.seed, "text_only": args.text_only}))
    return 0


def _targets(args: argparse.Namespace) -> int:
    """Print ``ModelTargets.summary()`` of the model's config as one JSON line (1 on error)."""
    from transformers import AutoConfig

    from loraplex.adapters.base_model import model_targets

    model = args.model
    if not os.path.exists(model) and (model.startswith(("/", ".", "~")) or model.count("/") > 1):
        print(json.dumps({"error": f"model directory not found: {model}"}), file=sys.stderr)
        return 1
    try:
        config = AutoConfig.from_pretrained(model)
        summary = model_targets(config).summary()
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": f"cannot read the model's targets: {exc}"}), file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0
