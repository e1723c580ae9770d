"""Where loraplex keeps its files, and the built-in model's location."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DATA_DIR = ".loraplex"
TINY_MODEL_SUBDIR = "models/tiny-llava"


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory only its owner can enter (made, with parents, if missing).

    A directory made here gets exactly 0700 (``chmod``, never left to the umask); an existing
    one owned by this user loses its group and other bits.

    Raises:
        OSError: the directory cannot be made.
    """
    path = Path(path)
    existed = path.is_dir()
    path.mkdir(parents=True, exist_ok=True)
    if existed:
        _tighten(path, PRIVATE_DIR_MODE)
    else:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def private_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a file only its owner can read and write (made empty if missing).

    A file made here gets exactly 0600; an existing one owned by this user loses its group and
    other bits.

    Raises:
        OSError: the file cannot be made.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        _tighten(path, PRIVATE_FILE_MODE)
        return path
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)
    return path


def _tighten(path: Path, mode: int) -> None:
    """Drop group and other permission bits of a path this user owns."""
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
        os.chmod(path, (st.st_mode & 0o777) & mode)


def data_dir(explicit: str | None = None) -> Path:
    """The data directory: ``--data-dir``, else ``$LORAPLEX_DATA_DIR``, else ``./.loraplex``."""
    return Path(explicit or os.environ.get("LORAPLEX_DATA_DIR") or DEFAULT_DATA_DIR)


def resolve_model(model: str | None, data: Path) -> str:
    """The model to serve: ``--model`` as given, or the built-in tiny LLaVA's directory.

    ``--model`` may be a directory, a Hub id or a GGUF file; the engine resolves it to a
    directory (``engine.models.source.resolve_model_source``). The built-in model is written
    into ``DATA/models/tiny-llava`` on first use (seed 0).
    """
    if model:
        return model
    target = data / TINY_MODEL_SUBDIR
    if not (target / "config.json").exists():
        from loraplex.engine.models.tiny_model import init_tiny

        init_tiny(target, seed=0)
    return str(target)
