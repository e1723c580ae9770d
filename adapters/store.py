"""The content-addressed adapter store on disk.

::

    root/
      <digest>/adapter_config.json          # the bytes as uploaded
      <digest>/adapter_model.safetensors
      .tmp-<random>/                        # a put in progress (renamed into place when done)

An adapter is validated before anything is written; it is written into a fresh temporary
directory and renamed to ``root/<digest>`` in one step, so a reader sees a complete adapter or
none, and a failed validation or write leaves the store as it was. The digest is over what the
adapter computes (:func:`adapters.validation.adapter_digest`), so re-uploading the same adapter
reuses the existing entry. Names belong to tenants and are kept by the gateway, not here.

Uploaded weights are private: the root and every adapter directory are 0700, the files 0600,
set explicitly (never left to the umask); an existing root others could enter is tightened.
Removal is two-step for callers that must re-check a condition in between (the gateway's
collector, :mod:`gateway.domains.adapters.orphans`): :meth:`AdapterStore.stash` renames an
adapter out of sight, then :meth:`AdapterStore.unstash` puts it back or
:meth:`AdapterStore.purge` deletes it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.adapters.base_model import BaseModelInfo
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.validation import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    LoraAdapter,
    load_adapter_files,
    read_adapter_dir,
)

DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0
DIR_MODE = 0o700
FILE_MODE = 0o600


def _private_root(root: Path) -> None:
    """Make ``root`` (0700 if new; group and other bits dropped if it is ours already)."""
    existed = root.is_dir()
    root.mkdir(parents=True, exist_ok=True)
    mode = root.stat().st_mode & 0o777
    if not existed:
        os.chmod(root, DIR_MODE)
    elif mode & ~DIR_MODE and root.stat().st_uid == os.geteuid():
        os.chmod(root, mode & DIR_MODE)


def validate_stored(
    digest: str,
    config_bytes: bytes,
    weights_bytes: bytes,
    *,
    limits: AdapterLimits,
    info: BaseModelInfo | None = None,
) -> LoraAdapter:
    """A stored adapter's files, validated again and checked against the digest it is kept under.

    Args:
        digest: The key it was stored under.
        config_bytes: ``adapter_config.json``.
        weights_bytes: ``adapter_model.safetensors``.
        limits: What the adapter must fit.
        info: Optional facts about the served model (see
            :func:`adapters.validation.load_adapter_files`).

    Raises:
        AdapterError: the files no longer validate or no longer hash to ``digest``.
    """
    adapter = load_adapter_files(config_bytes, weights_bytes, limits=limits, info=info)
    if adapter.digest != digest:
        raise AdapterError(f"stored adapter {digest} is corrupt: its content hashes differently")
    return adapter


class DigestStore:
    """What every adapter store does the same way, on top of its own primitives.

    :class:`AdapterStore` (a directory) and ``adapters.object_store.ObjectAdapterStore``
    implement ``write_files``, ``read_files``, ``stash`` and ``purge``; validation on the way in
    and out, ``put_dir`` and ``delete`` are built here.
    """

    def write_files(self, digest: str, config_bytes: bytes, weights_bytes: bytes) -> None:
        """Store validated files as the adapter ``digest`` (the subclass's)."""
        raise NotImplementedError

    def read_files(self, digest: str) -> tuple[bytes, bytes]:
        """``(config, weights)`` stored under ``digest``; KeyError if none (the subclass's)."""
        raise NotImplementedError

    def stash(self, digest: str) -> Any:
        """Move an adapter out of sight; where it went, or None (the subclass's)."""
        raise NotImplementedError

    def purge(self, stashed: Any) -> None:
        """Delete a stashed adapter for good (the subclass's)."""
        raise NotImplementedError

    def put_files(
        self,
        config_bytes: bytes,
        weights_bytes: bytes,
        *,
        limits: AdapterLimits,
        info: BaseModelInfo | None = None,
    ) -> LoraAdapter:
        """Validate an adapter and store it (an existing digest is reused).

        Args:
            config_bytes: ``adapter_config.json``.
            weights_bytes: ``adapter_model.safetensors``.
            limits: What the adapter must fit (:class:`adapters.limits.AdapterLimits`).
            info: Optional facts about the served model.

        Returns:
            The validated adapter.

        Raises:
            AdapterError: the adapter is invalid; nothing was written.
            OSError: the write failed; nothing that counts as stored was left behind.
        """
        adapter = load_adapter_files(config_bytes, weights_bytes, limits=limits, info=info)
        self.write_files(adapter.digest, config_bytes, weights_bytes)
        return adapter

    def put_dir(
        self,
        path: str | os.PathLike[str],
        *,
        limits: AdapterLimits,
        info: BaseModelInfo | None = None,
    ) -> LoraAdapter:
        """Validate a PEFT adapter directory and store it (arguments: see :meth:`put_files`).

        Raises:
            AdapterError: missing or pickle files, or an invalid adapter; nothing was written.
        """
        return self.put_files(*read_adapter_dir(path), limits=limits, info=info)

    def load(
        self,
        digest: str,
        *,
        limits: AdapterLimits,
        info: BaseModelInfo | None = None,
    ) -> LoraAdapter:
        """Read and re-validate a stored adapter (arguments as :meth:`put_files`).

        Raises:
            KeyError: no adapter with this digest.
            AdapterError: the stored files no longer validate or no longer hash to ``digest``.
        """
        config_bytes, weights_bytes = self.read_files(digest)
        return validate_stored(digest, config_bytes, weights_bytes, limits=limits, info=info)

    def delete(self, digest: str) -> bool:
        """Remove a stored adapter; False if there was none.

        It is stashed out of sight first, so readers never see half of it.
        """
        stashed = self.stash(digest)
        if stashed is None:
            return False
        self.purge(stashed)
        return True


class AdapterStore(DigestStore):
    """Validated adapters on disk, keyed by digest.

    Args:
        root: The store's directory (created if missing). Temporary directories older than an
            hour, left by a crash, are removed.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        _private_root(self.root)
        now = time.time()
        for path in self.root.glob(_TMP_PREFIX + "*"):
            try:
                if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass

    def write_files(self, digest: str, config_bytes: bytes, weights_bytes: bytes) -> None:
        """Store files the caller has validated, as the adapter ``digest``.

        Atomic; an existing entry is kept. Loads check the digest again.

        Raises:
            KeyError: ``digest`` is not a lowercase hex SHA-256.
            OSError: the disk write failed; nothing was left behind.
        """
        final = self._path(digest)
        if final is None:
            raise KeyError(digest)
        if final.is_dir():
            return
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))
        os.chmod(tmp, DIR_MODE)
        try:
            for name, payload in ((CONFIG_NAME, config_bytes), (WEIGHTS_NAME, weights_bytes)):
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                os.fchmod(fd, FILE_MODE)
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # not a concurrent put of the same adapter
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def read_files(self, digest: str) -> tuple[bytes, bytes]:
        """``(config, weights)`` as stored under ``digest``.

        Raises:
            KeyError: no adapter with this digest.
            AdapterError: a file is missing or unreadable.
        """
        directory = self._path(digest)
        if directory is None or not directory.is_dir():
            raise KeyError(digest)
        return read_adapter_dir(directory)

    def has(self, digest: str) -> bool:
        """Whether an adapter with this digest is stored."""
        directory = self._path(digest)
        return directory is not None and directory.is_dir()

    def size(self, digest: str) -> int | None:
        """Bytes of a stored adapter's files (config and weights); None if it is not stored."""
        directory = self._path(digest)
        if directory is None:
            return None
        try:
            return sum(f.stat().st_size for f in directory.iterdir())
        except FileNotFoundError:
            return None

    def stash(self, digest: str) -> Path | None:
        """Rename an adapter out of sight (readers no longer find it); None if there was none.

        Returns:
            Where it went, for :meth:`unstash` or :meth:`purge`.
        """
        directory = self._path(digest)
        if directory is None or not directory.is_dir():
            return None
        doomed = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root)) / digest
        try:
            os.rename(directory, doomed)
        except FileNotFoundError:  # removed concurrently
            shutil.rmtree(doomed.parent, ignore_errors=True)
            return None
        return doomed

    def unstash(self, stashed: Path) -> None:
        """Put a stashed adapter back (if it was stored again meanwhile, drop the stash)."""
        try:
            os.rename(stashed, self.root / stashed.name)
        except OSError:
            if not (self.root / stashed.name).is_dir():
                raise
        shutil.rmtree(stashed.parent, ignore_errors=True)

    def purge(self, stashed: Path) -> None:
        """Delete a stashed adapter for good."""
        shutil.rmtree(stashed.parent, ignore_errors=True)

    def touch(self, digest: str) -> None:
        """Mark a stored adapter as just used (for :meth:`trim`)."""
        directory = self._path(digest)
        if directory is not None:
            try:
                os.utime(directory)
            except FileNotFoundError:
                pass

    def trim(self, max_bytes: int) -> list[str]:
        """Delete the least recently used adapters until at most ``max_bytes`` are left.

        Recency is the last :meth:`touch` or the store time: a cache's bound.

        Returns:
            The digests deleted.
        """
        entries = []
        for digest in self.digests():
            directory = self.root / digest
            try:
                size = sum(f.stat().st_size for f in directory.iterdir())
                entries.append((directory.stat().st_mtime, digest, size))
            except FileNotFoundError:  # deleted meanwhile
                continue
        total = sum(size for _, _, size in entries)
        removed = []
        for _, digest, size in sorted(entries):
            if total <= max_bytes:
                break
            if self.delete(digest):
                removed.append(digest)
            total -= size
        return removed

    def digests(self) -> list[str]:
        """Every stored digest, sorted."""
        return sorted(
            p.name for p in self.root.iterdir() if DIGEST_RE.fullmatch(p.name) and p.is_dir()
        )

    def _path(self, digest: str) -> Path | None:
        """``root/<digest>``, or None for anything that is not a lowercase hex SHA-256."""
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            return None
        return self.root / digest
