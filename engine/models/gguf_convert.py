"""A GGUF file as a safetensors model directory: dequantized once by transformers, then cached.

transformers loads a GGUF file itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf``
package): it maps llama.cpp's tensor names and metadata to its own config, undoes the Q/K row
permutation llama.cpp applies, rebuilds the tokenizer (and its chat template) from the file's
vocabulary, and dequantizes every tensor to float32. Here that model and tokenizer are saved
once with ``save_pretrained`` into ``CACHE/gguf/<sha256 of the file>/``, so every model
implementation, the tokenizer loader and an engine core process read an ordinary directory, and
a second start (or a second replica) only hashes the file.

The weights are saved in float32, the values transformers' own GGUF loader gives (nothing is
rounded twice). The config's ``dtype`` is the file's own float type (llama.cpp's
``general.file_type``): ``float16`` for an ``F16`` file, ``bfloat16`` for ``BF16``, ``float32``
for ``F32`` and for quantized files, whose dequantized values only float32 holds exactly; that is
what ``--dtype auto`` takes.

The cache is ``$LORAPLEX_CACHE_DIR``, else ``$XDG_CACHE_HOME/loraplex``, else
``~/.cache/loraplex``. A directory appears there whole (written aside, then renamed), so two
processes converting the same file at once both end with the same complete copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from loraplex.engine.models.source import ModelSourceError

#: llama.cpp's ``general.file_type`` (``gguf.LlamaFileType``) -> the float type of its tensors.
FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def cache_root() -> Path:
    """Where converted files are kept: ``$LORAPLEX_CACHE_DIR`` or the XDG cache's ``loraplex``."""
    explicit = os.environ.get("LORAPLEX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "loraplex"


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex (about 1.4 GB/s on one core here)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_dtype(path: Path) -> str:
    """The float type of a GGUF file's tensors (see the module docstring): its ``dtype``.

    Raises:
        ModelSourceError: the ``gguf`` package is missing, or the file is not a GGUF file.
    """
    reader_cls = _gguf_reader()
    try:
        field = reader_cls(str(path)).get_field("general.file_type")
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelSourceError(f"{path} is not a readable GGUF file: {exc}") from None
    if field is None:
        return "float32"
    return FILE_TYPE_DTYPES.get(int(field.parts[field.data[0]][0]), "float32")


def _gguf_reader():
    """``gguf.GGUFReader``, or a clear error without the package."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelSourceError(
            "loading a GGUF file needs the gguf package: pip install 'loraplex[gguf]'"
        ) from None
    return GGUFReader


def convert_gguf(
    path: Path,
    *,
    root: Path | None = None,
    label: str = "model",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The cached safetensors directory of a GGUF file, converted now if it is not there yet.

    Args:
        path: The ``.gguf`` file (one file; split ``-0000x-of-0000y`` files are not read).
        root: The cache (default :func:`cache_root`); the directory is ``root/gguf/<sha256>``.
        label: What the model is in messages.
        progress: Told one line before a conversion starts.

    Returns:
        A Hugging Face directory: ``config.json``, ``model.safetensors``,
        ``generation_config.json`` and the tokenizer's files.

    Raises:
        ModelSourceError: no ``gguf`` package, a file transformers cannot load (not GGUF, or an
            architecture its GGUF support lacks), or a cache that cannot be written.
    """
    dtype = gguf_dtype(path)
    digest = file_sha256(path)
    base = (root if root is not None else cache_root()) / "gguf"
    target = base / digest
    if (target / "config.json").is_file():
        return target
    if progress is not None:
        progress(f"converting {label} {path} (GGUF) to safetensors in {target}, once")
    work = base / f".{digest}.{os.getpid()}.partial"
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        _save_dequantized(path, work, dtype, label)
        try:
            work.rename(target)
        except OSError:  # another process finished first: its copy is the same
            if not (target / "config.json").is_file():
                raise
    except OSError as exc:
        raise ModelSourceError(f"{label} {path}: cannot write its conversion: {exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _save_dequantized(path: Path, out: Path, dtype: str, label: str) -> None:
    """Load ``path`` with transformers (float32) and save it, with its tokenizer, into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(path.parent), path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except ImportError as exc:
        raise ModelSourceError(
            f"{label} {path}: transformers needs more to load GGUF files ({exc}): "
            "pip install 'loraplex[gguf]'"
        ) from None
    except Exception as exc:  # transformers raises many types for a file it cannot read
        message = " ".join(str(exc).split())[:300]
        raise ModelSourceError(f"{label} {path}: transformers cannot load it: {message}") from None
    # transformers marks a model loaded from GGUF as quantized (its GGUF quantizer), and
    # save_pretrained refuses quantized models; the weights are plain dense tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config = AutoConfig.from_pretrained(str(out))
    config.dtype = dtype  # what --dtype auto takes; the weights stay float32 on disk
    config.save_pretrained(str(out))
