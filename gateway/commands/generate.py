"""``loraplex generate``: offline batch inference, JSONL in, JSONL out (README: Offline)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loraplex.gateway.commands.engine_args import add_engine_args, config_from_args
from loraplex.gateway.settings import data_dir, resolve_model

_FIELDS = {"messages", "adapter", "max_tokens", "temperature", "top_p", "seed", "n"}


def register(subparsers) -> None:
    """Add the ``generate`` command."""
    p = subparsers.add_parser("generate", help="offline batch inference over a JSONL file")
    p.add_argument("--input", required=True, help="JSONL: one request per line")
    p.add_argument("--output", required=True, help="JSONL results, in input order")
    add_engine_args(p)
    p.set_defaults(func=run)


def parse_line(line: str, number: int) -> dict[str, Any]:
    """One input line as a dict.

    Raises:
        ValueError: not a JSON object, or without ``messages``.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or "messages" not in obj:
        raise ValueError(f"line {number}: expected an object with 'messages'")
    return obj


def run(args: argparse.Namespace) -> int:
    """Run every request of the input file in one continuous batch.

    Lines that fail validation are reported as ``{"index": i, "error": {...}}`` in the output
    and the command exits 1; the valid ones still run.
    """
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.request import RequestOutputKind
    from loraplex.engine.sampling.params import SamplingParams

    lines = [ln for ln in Path(args.input).read_text().splitlines() if ln.strip()]
    llm = LLM(config_from_args(args, resolve_model(args.model, data_dir(args.data_dir))))
    print(f"loraplex: {llm.engine.kv_sizing.describe()}", file=sys.stderr, flush=True)
    requests, results = [], {}
    adapters: dict[str, str] = {}  # PEFT directory -> digest
    for i, line in enumerate(lines):
        try:
            obj = parse_line(line, i + 1)
            lora_digest = None
            if obj.get("adapter"):
                path = str(obj["adapter"])
                if path not in adapters:
                    adapters[path] = llm.engine.add_lora_dir(path).digest
                lora_digest = adapters[path]
            sampling = SamplingParams(
                n=obj.get("n") or 1,
                max_tokens=obj.get("max_tokens") or 16,
                temperature=1.0 if obj.get("temperature") is None else obj["temperature"],
                top_p=1.0 if obj.get("top_p") is None else obj["top_p"],
                seed=obj.get("seed"),
            )
            sampling.validate()
            req = llm.make_request(
                obj["messages"], sampling, lora_digest=lora_digest, request_id=f"line-{i}"
            )
            req.output_kind = RequestOutputKind.FINAL_ONLY
            llm.engine.add_request(req)
            requests.append((i, req))
        except (ValueError, TypeError) as exc:
            results[i] = {"index": i, "error": {"message": str(exc), "type": "invalid_request"}}
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = out
    for i, req in requests:
        out = finished[req.request_id]
        results[i] = {
            "index": i,
            "prompt_token_ids": out.prompt_token_ids,
            "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in out.outputs
            ],
            "cached_tokens": out.num_cached_tokens,
        }
    with open(args.output, "w") as f:
        for i in range(len(lines)):
            f.write(json.dumps(results[i]) + "\n")
    failed = sum(1 for r in results.values() if "error" in r)
    if failed:
        print(f"{failed} of {len(lines)} request(s) failed; see {args.output}", file=sys.stderr)
    return 1 if failed else 0
