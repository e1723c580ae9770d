"""``loraplex model init-tiny DIR [--seed N] [--text-only]``."""

from __future__ import annotations

import argparse
import json


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


def _init_tiny(args: argparse.Namespace) -> int:
    from loraplex.engine.models.tiny_model import init_tiny

    kwargs = {"seed": args.seed, "text_only": args.text_only}
    if args.preset:
        kwargs["preset"] = args.preset
    path = init_tiny(args.directory, **kwargs)
    print(json.dumps({"model": str(path), "seed": args.seed, "text_only": args.text_only}))
    return 0
