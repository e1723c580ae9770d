"""A batch's input lines: reading them, and checking each as OpenAI does at batch creation.

Each non-blank line of the input file is one request (OpenAI's batch input format, also what
vLLM's ``run-batch`` reads)::

    {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Checked while the batch is ``validating``: the line is a JSON object, ``custom_id`` a string
unique in the file, ``method`` ``POST``, ``url`` the batch's ``endpoint``, ``body`` an object,
and no other key. Any fault fails the whole batch; its ``errors`` list the faults (code,
message, ``param``, 1-based ``line``), the first :data:`MAX_ERRORS` of them. The body itself
is checked by the endpoint's own parser when the line runs (a bad body is that line's 400 in
the error file, as OpenAI reports it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

MAX_ERRORS = 100
"""Most errors a failed batch lists (the count of all of them is in the last one's message)."""
LINE_KEYS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    """One request of a batch.

    Attributes:
        index: Its 0-based position among the file's requests (blank lines skipped).
        number: Its 1-based line number in the file.
        custom_id: The client's id for it.
        body: The request body as JSON bytes (what the endpoint parses).
    """

    index: int
    number: int
    custom_id: str
    body: bytes


def iter_raw(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, bytes)`` of each non-blank line of the file (blocking)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield number, raw


def parse_line(raw: bytes, number: int, index: int, endpoint: str) -> tuple[Line | None, dict]:
    """Check one line; returns the line or, when it is faulty, None and its error."""

    def fault(code: str, message: str, param: str | None = None) -> tuple[None, dict]:
        return None, {"code": code, "message": message, "param": param, "line": number}

    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return fault("invalid_json_line", f"line {number} is not valid JSON")
    if not isinstance(data, dict):
        return fault("invalid_request", f"line {number} is not a JSON object")
    for key in data:
        if key not in LINE_KEYS:
            return fault("invalid_request", f"unknown key {key[:64]!r} on line {number}", key[:64])
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return fault(
            "invalid_custom_id",
            f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters",
            "custom_id",
        )
    if data.get("method") != "POST":
        return fault("invalid_method", "'method' must be 'POST'", "method")
    if data.get("url") != endpoint:
        return fault("invalid_url", f"'url' must be the batch's endpoint {endpoint!r}", "url")
    body = data.get("body")
    if not isinstance(body, dict):
        return fault("invalid_body", "'body' must be a JSON object", "body")
    return Line(index, number, custom_id, msgspec.json.encode(body)), {}


def validate(path: Path, endpoint: str) -> tuple[int, list[dict[str, Any]]]:
    """Check every line of the input file (blocking: run it in a thread).

    Returns:
        ``(requests, errors)``: the number of requests, and OpenAI's batch errors (empty when
        the file is valid), at most :data:`MAX_ERRORS`.
    """
    seen: set[str] = set()
    errors: list[dict[str, Any]] = []
    count = 0
    total_errors = 0
    for index, (number, raw) in enumerate(iter_raw(path)):
        count = index + 1
        line, error = parse_line(raw, number, index, endpoint)
        if line is not None and line.custom_id in seen:
            error = {
                "code": "duplicate_custom_id",
                "message": f"'custom_id' {line.custom_id[:64]!r} is used twice",
                "param": "custom_id",
                "line": number,
            }
        elif line is not None:
            seen.add(line.custom_id)
        if error:
            total_errors += 1
            if len(errors) < MAX_ERRORS:
                errors.append(error)
    if total_errors > len(errors):
        errors[-1] = {**errors[-1], "message": f"{errors[-1]['message']} ({total_errors} errors)"}
    return count, errors


def read_lines(path: Path, endpoint: str, skip: set[int]) -> Iterator[Line]:
    """The file's requests not in ``skip`` (indices already answered), in order (blocking)."""
    for index, (number, raw) in enumerate(iter_raw(path)):
        if index in skip:
            continue
        line, _ = parse_line(raw, number, index, endpoint)
        if line is not None:  # validated when the batch was created
            yield line
