"""Where the weights come from: ``--model`` as a local directory, a Hub id or a GGUF file.

Every model the engine runs is, by the time anything reads it, a local Hugging Face directory
(``config.json``, ``*.safetensors``, tokenizer files). :func:`resolve_model_source` makes it one,
once, at the top (the CLI, ``LLM``, ``start_engine``; the front and the core call it too, and on
a config it already resolved it does nothing):

- an existing directory is used as it is;
- ``path/to/model.gguf`` is dequantized once by transformers into a cached safetensors
  directory keyed by the file's digest (``engine.models.gguf_convert``);
- anything else that is a valid Hub id (``org/name``) is fetched with huggingface_hub's
  ``snapshot_download`` into the standard HF cache, at ``revision`` (``engine.models.hub``:
  ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` honoured).

The resolved config carries the directory in ``model`` and what was asked for in
``model_source``, so an engine core process or a Ray replica handed it never downloads or
converts again. A string that names nothing loadable, or a fetch that fails, is one
:class:`ModelSourceError` line, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loraplex.engine.config import EngineConfig

Progress = Callable[[str], None]


class ModelSourceError(ValueError):
    """``--model`` (or ``--speculative-model``) names nothing the engine can load.

    The message is one line: what was tried and what to do. A ``ValueError``, so the CLI prints
    it as its one error line (``gateway/cli.py``).
    """


@dataclass(frozen=True)
class ResolvedModel:
    """A model source made a local directory.

    Attributes:
        directory: The Hugging Face directory to load.
        name: Its default served name: the Hub id, the GGUF file's name without ``.gguf``, or
            the directory's name.
        kind: ``directory``, ``hub`` or ``gguf``.
    """

    directory: Path
    name: str
    kind: Literal["directory", "hub", "gguf"]


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is a Hub model id, ``name`` or ``org/name`` (huggingface_hub's rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_model(
    model: str,
    *,
    revision: str | None = None,
    label: str = "model",
    progress: Progress | None = None,
) -> ResolvedModel:
    """Make one model source a local directory (see the module docstring for the rules).

    A local path wins over a Hub id of the same spelling (as in transformers and vLLM).

    Args:
        model: A directory, a ``.gguf`` file or a Hub id.
        revision: The Hub revision (branch, tag or commit); only for a Hub id.
        label: What the model is in messages (``model``, ``speculative model``).
        progress: Told one line before a download or a conversion starts.

    Raises:
        ModelSourceError: a revision for a local path, a missing ``.gguf`` file or one
            transformers cannot load, a file that is neither, a string that is not a Hub id,
            or a failed fetch (``engine.models.hub.download_snapshot``).
    """
    path = Path(model).expanduser()
    local = path.exists() or path.suffix.lower() == ".gguf"
    if local and revision is not None:
        raise ModelSourceError(
            f"--revision {revision!r} is a revision of a Hub model, and {label} {model!r} is a "
            "local path: drop --revision, or give a Hub id"
        )
    if path.is_dir():
        return ResolvedModel(path, path.name or path.resolve().name, "directory")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"{label} {model!r}: no such GGUF file")
        from loraplex.engine.models.gguf_convert import convert_gguf

        directory = convert_gguf(path, label=label, progress=progress)
        return ResolvedModel(directory, path.stem, "gguf")
    if path.exists():
        raise ModelSourceError(
            f"{label} {model!r} is a file, not a model directory or a .gguf file"
        )
    if not is_hub_id(model):
        raise ModelSourceError(
            f"{label} {model!r}: no such directory or .gguf file, and not a Hugging Face Hub id "
            "(org/name): pass a model directory, a .gguf file or a Hub id"
        )
    from loraplex.engine.models.hub import download_snapshot

    directory = download_snapshot(model, revision, label=label, progress=progress)
    return ResolvedModel(directory, model, "hub")


def resolve_model_source(config: EngineConfig, progress: Progress | None = None) -> EngineConfig:
    """``config`` with ``model`` (and ``speculative_model``) resolved to local directories.

    Sets ``model_source`` to what ``model`` was, and ``served_model_name``, when none is given,
    to the resolved model's name (a Hub id is served under its id, as vLLM does). A config
    resolved already (``model_source`` set) is returned as it is: no download, no conversion.

    Raises:
        ModelSourceError: see :func:`resolve_model`.
    """
    if config.model_source is not None:
        return config
    main = resolve_model(config.model, revision=config.revision, progress=progress)
    draft = config.speculative_model
    if draft is not None:
        resolved = resolve_model(draft, label="speculative model", progress=progress)
        draft = str(resolved.directory)
    return config.replace(
        model=str(main.directory),
        model_source=config.model,
        served_model_name=config.served_model_name or main.name,
        speculative_model=draft,
    )
