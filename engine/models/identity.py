"""A model's identity for keys that outlive the process (the KV tiers' fingerprint).

Two checkpoints with the same architecture and shapes give KV of the same size but different
values: a disk or shared KV tier must never hand one's blocks to the other. Hashing every
weight byte costs seconds per GB at each start, so the identity hashes what differs between
checkpoints cheaply: ``config.json``, and for each weight file its name, its size and three
1 MiB samples (start, middle, end) of its bytes. Two fine-tunes that differ only outside
those samples would collide; a Hub snapshot's revision is in its path and so also counts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_identity(model: str) -> str:
    """A hex sha256 that names a checkpoint's weights.

    Args:
        model: A model directory, or a name that is not a directory (the built-in tiny model,
            whose weights its name and seed fix), hashed as a string.

    Returns:
        64 hex characters.

    Raises:
        OSError: a weight file that cannot be read.
    """
    h = hashlib.sha256()
    root = Path(model)
    if not root.is_dir():
        h.update(b"name\0" + model.encode())
        return h.hexdigest()
    config = root / "config.json"
    if config.is_file():
        h.update(b"config\0" + config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        size = path.stat().st_size
        h.update(f"file\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            middle = max(0, size // 2 - SAMPLE_BYTES // 2)
            for offset in sorted({0, middle, max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()
