"""The local-disk tier: one framed record per block, LRU bounded in bytes, kept across restarts."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from loraplex.engine.kv_cache.tiers import codec
from loraplex.engine.kv_cache.tiers.base import KVTier
from loraplex.engine.kv_cache.tiers.layout import KVLayout

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0
_LIVE_TOKENS: set[str] = set()  # the temp-file tokens of this process's open DiskTiers


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(KVTier):
    """Blocks as files under ``root/<fingerprint>/<2 hex>/<key hex>.kv`` (codec records).

    Writes go to a temp file renamed into place (``os.replace``), so a reader sees a whole record
    or none; no fsync: a record torn by a power loss fails its checksum and is dropped. Recency is
    each file's mtime (set on every hit), so the LRU order and the index survive a restart: a new
    DiskTier on the same root scans its fingerprint's directory and sees the old records, evicting
    the oldest if they exceed the capacity. ``layout.json`` beside them says what they are.
    Directories of other fingerprints are never read or evicted. One DiskTier (one process) per
    root and layout: two would each bound only what they know of.

    Args:
        root: The cache directory (created if absent).
        capacity_bytes: Bound on the bytes of the records (files) held.
        layout: The layout of the blocks; its fingerprint names the directory.
        name: The tier's name in stats.

    Raises:
        OSError: the directory cannot be created or scanned.
    """

    def __init__(
        self, root: str | os.PathLike, capacity_bytes: int, layout: KVLayout, *, name: str = "disk"
    ) -> None:
        super().__init__(name, capacity_bytes)
        self.layout = layout
        self.directory = Path(root) / layout.fingerprint()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _LIVE_TOKENS.add(self._token)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        self._write_layout()
        self._scan()
        with self._lock:
            self._evict_locked()

    # -- opening ----------------------------------------------------------------------------

    def _write_layout(self) -> None:
        text = json.dumps(self.layout.to_dict(), indent=2, sort_keys=True) + "\n"
        target = self.directory / "layout.json"
        try:
            if target.read_text() == text:
                return
        except OSError:
            pass
        tmp = self.directory / f"layout.json.{self._token}{_TMP_SUFFIX}"
        tmp.write_text(text)
        os.replace(tmp, target)

    def _stale_tmp(self, name: str, mtime: float) -> bool:
        token = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        pid_text = token.split("-", 1)[0]
        if time.time() - mtime > _STALE_TMP_S or not pid_text.isdigit():
            return True
        pid = int(pid_text)
        if pid == os.getpid():
            return token not in _LIVE_TOKENS
        return not _pid_alive(pid)

    def _scan(self) -> None:
        found: list[tuple[int, str, bytes, int]] = []
        for sub in os.scandir(self.directory):
            if sub.name.endswith(_TMP_SUFFIX) and sub.is_file(follow_symlinks=False):
                if self._stale_tmp(sub.name, sub.stat().st_mtime):
                    _unlink(sub.path)
                continue
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat()
                if entry.name.endswith(_TMP_SUFFIX):
                    if self._stale_tmp(entry.name, st.st_mtime):
                        _unlink(entry.path)
                    continue
                stem = entry.name[: -len(_SUFFIX)]
                if not entry.name.endswith(_SUFFIX) or not stem.startswith(sub.name):
                    continue
                try:
                    key = bytes.fromhex(stem)
                except ValueError:
                    continue
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        found.sort()
        for _, _, key, size in found:
            self._index[key] = size
            self._used += size

    # -- the tier ---------------------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        """The file of ``key``'s record."""
        name = key.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    @property
    def used_bytes(self) -> int:
        """Bytes of the record files held now."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Records held now."""
        with self._lock:
            return len(self._index)

    def contains(self, key: bytes) -> bool:
        """Whether ``key``'s record is in the index (no I/O)."""
        with self._lock:
            return key in self._index

    def get(self, key: bytes) -> torch.Tensor | None:
        """``key``'s payload read from its file and verified; None on a miss or a bad record.

        A corrupt or truncated file (see ``codec.decode``) is deleted and counted in
        ``stats.corrupt``; an I/O error is counted in ``stats.errors``.
        """
        start = time.perf_counter()
        with self._lock:
            if key not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
        path = self.path(key)
        expected = codec.frame_nbytes(len(key), self.layout)
        try:
            try:  # never block on a FIFO, never follow a link planted in the directory
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise codec.CorruptBlock("a symbolic link, not a record") from None
                raise
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise codec.CorruptBlock("not a regular file")
                size = st.st_size
                if size != expected:
                    raise codec.CorruptBlock(f"file of {size} bytes, expected {expected}")
                buf = torch.empty(expected, dtype=torch.uint8)  # not zero-filled, unlike bytearray
                if f.readinto(codec.payload_view(buf)) != expected:
                    raise codec.CorruptBlock("short read")
            payload = codec.decode(codec.payload_view(buf), key, self.layout)
        except codec.CorruptBlock as exc:
            log.warning("dropping corrupt KV record %s: %s", path, exc)
            self._drop(key, path, corrupt=True)
            return None
        except FileNotFoundError:
            self._drop(key, path, corrupt=False)
            return None
        except OSError as exc:
            log.warning("KV disk tier read of %s failed: %s", path, exc)
            self._count(errors=1, misses=1)
            return None
        try:
            os.utime(path)  # the file's mtime is its last access: the LRU order after a restart
        except OSError:
            pass  # evicted meanwhile: the payload read is still whole and verified
        self._count(hits=1, bytes_read=payload.numel(), read_seconds=time.perf_counter() - start)
        return payload

    def _drop(self, key: bytes, path: Path, *, corrupt: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            if corrupt:
                _unlink(path)
                self.stats.corrupt += 1
            self.stats.misses += 1

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Write ``key``'s record (temp file, then rename), evicting the oldest files to fit.

        Returns:
            False when the record alone exceeds ``capacity_bytes`` or the write failed.

        Raises:
            ValueError: a malformed key or payload (wrong length for the layout).
        """
        head = codec.header(key, payload, self.layout)
        size = len(head) + payload.numel()
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self.capacity_bytes:
                self.stats.rejected += 1
                return False
        start = time.perf_counter()
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{self._token}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(codec.payload_view(payload))
            with self._lock:
                os.replace(tmp, path)
                if key not in self._index:
                    self._index[key] = size
                    self._used += size
                self._evict_locked()
                self.stats.stores += 1
                self.stats.bytes_written += size
                self.stats.write_seconds += time.perf_counter() - start
            return True
        except OSError as exc:
            log.warning("KV disk tier write of %s failed: %s", path, exc)
            _unlink(tmp)
            self._count(errors=1)
            return False

    def _evict_locked(self) -> None:
        while self._used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            _unlink(self.path(key))
            self.stats.evictions += 1

    def close(self) -> None:
        """Forget the index (the files stay for the next open)."""
        with self._lock:
            self._index.clear()
            self._used = 0
        _LIVE_TOKENS.discard(self._token)


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
