"""The content-addressed adapter store in object storage (S3, GCS, Azure ...), through fsspec.

::

    URL/<digest>/adapter_model.safetensors    # written first
    URL/<digest>/adapter_config.json          # written last: an adapter is there once it is
    URL/.trash-<random>/<digest>/...          # stashed by the orphan collector

The same contract as :class:`adapters.store.AdapterStore`, for gateways and engine replicas on
different machines that share no file system: every one of them opens the same URL
(``serve --adapter-store s3://bucket/loraplex/adapters``) and reads adapters by digest. The
filesystem is fsspec's for the URL's scheme (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``,
``adlfs`` for ``az://``; installed separately); credentials and endpoints come from the usual
places (the environment, instance roles; ``AWS_ENDPOINT_URL`` for MinIO or another
S3-compatible store). An engine keeps up to
``max_cpu_loras`` adapters in host memory; engine cores (``engine.core.process``) also keep what
they download in a local cache directory (``cache_dir``: an :class:`~adapters.store.AdapterStore`
bounded by ``cache_bytes``, least recently used first out), which is safe to share between the
cores of a machine because entries are keyed by digest and every load checks it.

Object stores have no rename, so nothing here is atomic the way the directory store's renames
are; content addressing makes up for it. An adapter counts as stored once its config (written
after the weights) exists; a reader of a half-written or half-removed adapter gets ``KeyError``
or, from :meth:`load`, the digest check's ``AdapterError``, never another adapter's weights; and
two gateways storing the same digest write the same bytes. Stash, unstash and purge (the orphan
collector's protocol, :mod:`gateway.domains.adapters.orphans`) are moves under a ``.trash-``
prefix. Access control is the bucket's: grant the gateways read and write, the replicas read.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from loraplex.adapters.base_model import BaseModelInfo
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.store import DIGEST_RE, AdapterStore, DigestStore, validate_stored
from loraplex.adapters.validation import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    LoraAdapter,
)

_TRASH_PREFIX = ".trash-"
DEFAULT_CACHE_BYTES = 2 * 1024**3
logger = logging.getLogger(__name__)


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is an fsspec URL (``s3://...``, ``simplecache::gs://...``)."""
    return isinstance(location, str) and "://" in location


def open_store(
    location: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> AdapterStore | ObjectAdapterStore:
    """The adapter store at ``location``: a directory path, or an fsspec URL.

    ``cache_dir``: for a URL, where downloaded adapters are kept (see
    :class:`ObjectAdapterStore`); a directory store reads its own disk and takes none.

    Raises:
        ValueError: a URL whose scheme has no fsspec filesystem installed (the message names
            the package), a malformed URL, or a ``cache_dir`` for a directory store.
    """
    if is_url(location):
        return ObjectAdapterStore(str(location), cache_dir=cache_dir)
    if cache_dir is not None:
        raise ValueError("a directory adapter store takes no download cache")
    return AdapterStore(location)


def _private_cache(directory: str | os.PathLike[str]) -> AdapterStore | None:
    """The download cache at ``directory``, or None (logged) if it is not this user's own.

    Tenants' weights are never written where another local user can read them.
    """
    try:
        cache = AdapterStore(directory)
        info = cache.root.stat()
    except OSError as exc:
        logger.warning("adapter cache %s unusable (%s); downloading every time", directory, exc)
        return None
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        logger.warning(
            "adapter cache %s belongs to another user or others may enter it; not used",
            directory,
        )
        return None
    return cache


class ObjectAdapterStore(DigestStore):
    """Validated adapters in object storage, keyed by digest (see the module doc).

    Args:
        url: The store's root, an fsspec URL (``s3://bucket/prefix``).
        cache_dir: A local directory that keeps downloaded adapters (None: no cache).
        cache_bytes: The cache's bound in bytes (least recently used adapters go first).
        **storage_options: Passed to the filesystem (``endpoint_url``, ``anon`` ...).

    Raises:
        ValueError: no filesystem for the URL's scheme, or a malformed URL.
    """

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        **storage_options: Any,
    ) -> None:
        import fsspec

        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as exc:
            raise ValueError(f"the adapter store {url!r} needs a package: {exc}") from None
        except (ValueError, KeyError) as exc:
            raise ValueError(f"the adapter store {url!r} is not a usable URL: {exc}") from None
        self.url = url
        self.root = root.rstrip("/")
        self.cache = None if cache_dir is None else _private_cache(cache_dir)
        self.cache_bytes = cache_bytes
        self.downloads = 0  # adapters fetched from the object store by load()

    # ------------------------------------------------------------------- writing
    def write_files(self, digest: str, config_bytes: bytes, weights_bytes: bytes) -> None:
        """Upload validated files as the adapter ``digest``; one already stored is kept.

        The weights go first, then the config: from then on it counts as stored.

        Raises:
            KeyError: ``digest`` is not a lowercase hex SHA-256.
            OSError: the upload failed (a half-written adapter does not count as stored).
        """
        directory = self._path(digest)
        if directory is None:
            raise KeyError(digest)
        if not self.has(digest):
            self.fs.pipe_file(f"{directory}/{WEIGHTS_NAME}", weights_bytes)
            self.fs.pipe_file(f"{directory}/{CONFIG_NAME}", config_bytes)
            self.fs.invalidate_cache(directory)

    # ------------------------------------------------------------------- reading
    def read_files(self, digest: str) -> tuple[bytes, bytes]:
        """Download ``(config, weights)`` of the adapter ``digest`` (no cache).

        Raises:
            KeyError: no adapter with this digest.
        """
        directory = self._path(digest)
        if directory is None:
            raise KeyError(digest)
        try:
            config_bytes = self.fs.cat_file(f"{directory}/{CONFIG_NAME}")
            weights_bytes = self.fs.cat_file(f"{directory}/{WEIGHTS_NAME}")
        except FileNotFoundError:
            raise KeyError(digest) from None
        return config_bytes, weights_bytes

    def load(
        self,
        digest: str,
        *,
        limits: AdapterLimits,
        info: BaseModelInfo | None = None,
    ) -> LoraAdapter:
        """Re-validate a stored adapter: from the local cache if there, else downloaded.

        A download is then cached (if there is a cache).

        Raises:
            KeyError: no adapter with this digest.
            AdapterError: the stored files no longer validate or no longer hash to ``digest``.
        """
        if self.cache is not None and self._path(digest) is not None:
            try:
                adapter = self.cache.load(digest, limits=limits, info=info)
                self.cache.touch(digest)
                return adapter
            except (KeyError, AdapterError, OSError):  # not cached, evicted meanwhile, or bad
                self.cache.delete(digest)
        config_bytes, weights_bytes = self.read_files(digest)
        self.downloads += 1
        adapter = validate_stored(digest, config_bytes, weights_bytes, limits=limits, info=info)
        if self.cache is not None:
            try:
                self.cache.write_files(digest, config_bytes, weights_bytes)
                self.cache.trim(self.cache_bytes)
            except OSError as exc:  # a full or broken cache disk costs downloads, not requests
                logger.warning("could not cache adapter %s locally: %s", digest, exc)
        return adapter

    def has(self, digest: str) -> bool:
        """Whether an adapter with this digest is stored (asked of the store, not a cache)."""
        directory = self._path(digest)
        if directory is None:
            return False
        self.fs.invalidate_cache(directory)
        return bool(self.fs.exists(f"{directory}/{CONFIG_NAME}"))

    def size(self, digest: str) -> int | None:
        """Bytes of a stored adapter's files, asked of the store; None if it is not stored."""
        directory = self._path(digest)
        if directory is None or not self.has(digest):
            return None
        return int(self.fs.du(directory, total=True))

    def digests(self) -> list[str]:
        """Every stored digest (its config is there), sorted; one listing of the store."""
        self.fs.invalidate_cache(self.root)
        found = set()
        for path in self.fs.find(self.root):
            parts = path[len(self.root) :].strip("/").split("/")
            if len(parts) == 2 and parts[1] == CONFIG_NAME and DIGEST_RE.fullmatch(parts[0]):
                found.add(parts[0])
        return sorted(found)

    # ------------------------------------------------------------------- removal
    def stash(self, digest: str) -> str | None:
        """Move an adapter out of sight (readers no longer find it); None if there was none.

        The config goes first, so the adapter stops counting as stored before anything else
        moves.

        Returns:
            Where it went, for :meth:`unstash` or :meth:`purge`.
        """
        if not self.has(digest):
            return None
        source = f"{self.root}/{digest}"
        doomed = f"{self.root}/{_TRASH_PREFIX}{uuid.uuid4().hex}/{digest}"
        try:
            self.fs.mv(f"{source}/{CONFIG_NAME}", f"{doomed}/{CONFIG_NAME}")
        except FileNotFoundError:  # removed concurrently
            return None
        try:
            self.fs.mv(f"{source}/{WEIGHTS_NAME}", f"{doomed}/{WEIGHTS_NAME}")
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(source)
        return doomed

    def unstash(self, stashed: str) -> None:
        """Put a stashed adapter back (weights, then config); drop the stash if stored again."""
        digest = stashed.rstrip("/").rsplit("/", 1)[-1]
        if not self.has(digest):
            target = f"{self.root}/{digest}"
            self.fs.mv(f"{stashed}/{WEIGHTS_NAME}", f"{target}/{WEIGHTS_NAME}")
            self.fs.mv(f"{stashed}/{CONFIG_NAME}", f"{target}/{CONFIG_NAME}")
            self.fs.invalidate_cache(target)
        self.purge(stashed)

    def purge(self, stashed: str) -> None:
        """Delete a stashed adapter for good."""
        parent = stashed.rstrip("/").rsplit("/", 1)[0]
        try:
            self.fs.rm(parent, recursive=True)
        except FileNotFoundError:
            pass

    def _path(self, digest: str) -> str | None:
        """``root/<digest>``, or None for anything that is not a lowercase hex SHA-256."""
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            return None
        return f"{self.root}/{digest}"
