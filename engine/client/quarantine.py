"""Query-of-death defence: remember the requests in flight when an engine core dies.

Whatever native fault still reaches an engine core (a bug in a kernel, a library, a model's
code) kills the process and every request in it; the client restarts it
(``engine.client.process``). If the fault is tied to one request, a client that sends it again
kills the new core too, and a supervisor that restarts the server only lets it go on. This is
the "query of death" of large search and storage services (Google's SRE book, "Addressing
Cascading Failures"): the defence is to remember what was in flight at each death and refuse
what keeps being there.

* **Culprits.** When the core died inside native code it runs for one request (a grammar's
  mask, a matcher's token, a compile), its breadcrumb (``engine.core.breadcrumb``) names that
  request: it is certain, and refused from this first death on.
* **Suspects.** Otherwise the suspects are the requests sent to the core in its last two loops
  (a request that crashes it at admission or in its first step is always among them), else
  every request in flight. Each death is shared out between them: each distinct request (by
  the digest of its content: :func:`request_digest`) gets ``1/k`` of it, each distinct tenant
  ``1/t``. So a client's honest retry that happens to arrive beside an attacker's crash gets
  half of that death, not all of it, and a tenant with company is blamed for a share.
* **Quarantine.** A digest whose shares of the deaths not explained otherwise reach
  ``deaths_to_quarantine`` (2) within ``window_s`` (an hour) is refused from then on
  (:class:`QueryOfDeathError`, a 400), by every replica and gateway that shares the file, and
  after restarts. A death is *explained* by a culprit or by a suspect quarantined since; it
  then counts against that request's tenant only.
* **Tenants.** A tenant whose shares of the deaths within ``window_s`` reach ``tenant_deaths``
  (3) is throttled (:class:`TenantThrottledError`, a 429) for ``throttle_s`` after its last
  share, doubled for every further whole death, so varying the body does not buy endless
  deaths.
* **Restarts.** A client gives up restarting its core after repeated deaths; deaths explained
  by a quarantined request do not count (:meth:`Quarantine.explained`).

The file (``quarantine.jsonl`` in the data directory) is a log of JSON lines, each a death or
a quarantined digest, appended under an exclusive ``flock`` and read back whenever another
process grew it; it is compacted (rewritten with the quarantined digests and the latest deaths)
past :data:`COMPACT_LINES` lines. Deleting it lifts every quarantine (an operator's reset).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

COMPACT_LINES = 4096
MAX_QUARANTINED = 100_000  # digests kept (the oldest go first past it)
MAX_SUSPECTS = 256  # suspects recorded per death (the newest first): the rest share nothing


class QueryOfDeathError(ValueError):
    """The request was in flight at repeated engine-core deaths: it is refused (a 400)."""


class TenantThrottledError(RuntimeError):
    """The tenant's requests keep being in flight when engine cores die (a 429).

    Attributes:
        retry_after: Seconds until the tenant is served again.
    """

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class QuarantinePolicy:
    """When a request is quarantined and a tenant throttled (see the module docstring).

    Attributes:
        deaths_to_quarantine: Deaths (shares of them) a request must be blamed for.
        tenant_deaths: Deaths (shares of them) within ``window_s`` a tenant must be blamed for.
        window_s: Seconds both counts look back.
        throttle_s: The first throttle, doubled per further whole death, at most
            ``max_throttle_s``.
        max_throttle_s: The longest throttle.
        max_deaths: Deaths remembered.
    """

    deaths_to_quarantine: float = 2.0
    tenant_deaths: float = 3.0
    window_s: float = 3600.0
    throttle_s: float = 60.0
    max_throttle_s: float = 3600.0
    max_deaths: int = 1000


@dataclass(frozen=True)
class Suspect:
    """A request in flight at a death: its content digest and tenant."""

    digest: str
    tenant: str | None


@dataclass
class _Death:
    time: float
    suspects: tuple[Suspect, ...]
    key: str = ""  # unique across processes: who recorded it, and when
    culprits: tuple[Suspect, ...] = ()  # named by the core's breadcrumb: certain

    def to_json(self) -> dict[str, Any]:
        return {
            "death": {
                "time": self.time,
                "key": self.key,
                "suspects": [[s.digest, s.tenant] for s in self.suspects],
                "culprits": [[s.digest, s.tenant] for s in self.culprits],
            }
        }


@dataclass
class _State:
    deaths: list[_Death] = field(default_factory=list)
    quarantined: dict[str, tuple[str | None, float]] = field(default_factory=dict)
    throttled: dict[str, float] = field(default_factory=dict)  # tenant -> until (wall clock)


_ENCODER = msgspec.msgpack.Encoder()  # dicts in the order the client sent them


def request_digest(request: Any) -> str:
    """The digest a request is quarantined by: SHA-256 of what it asks the engine to do.

    Covers the prompt's token ids, the sampling parameters (the structured-output spec, the
    seed and ``max_tokens`` included), the images' keys and the adapter's digest; not the
    request id, arrival time, output kind or tenant (the same body is the same query whoever
    sends it).

    Args:
        request: An ``engine.request.EngineRequest``.
    """
    payload = _ENCODER.encode(
        (
            request.prompt_token_ids,
            request.sampling,
            [image.key for image in request.images],
            request.lora_digest,
        )
    )
    return hashlib.sha256(payload).hexdigest()


class Quarantine:
    """The deaths seen, the quarantined digests and the throttled tenants (thread-safe).

    :meth:`check` is a dictionary lookup (and one ``stat`` of the file): it runs for every
    request, on the gateway's event loop. The counting happens when a death is recorded or
    read from the file.

    Args:
        path: The JSON-lines file shared by every client of this data directory (created
            when first written); None keeps everything in memory (tests, offline use).
        policy: When to quarantine and throttle.
        clock: Wall-clock seconds (``time.time``; deaths are compared across processes).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        policy: QuarantinePolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.policy = policy if policy is not None else QuarantinePolicy()
        self.clock = clock
        self._lock = threading.Lock()
        self._state = _State()
        self._size = -1  # bytes of the file consumed so far (whole lines; -1: never read)
        self._seen = -1  # the file's size when last read (a cut last line is not re-read)
        self._lines = 0  # lines of the file read so far
        self._inode = None
        self._seq = 0
        self.refused = 0  # requests refused (digest or tenant), for metrics
        with self._lock:
            self._reload()

    # ------------------------------------------------------------------------- public
    def check(self, digest: str, tenant: str | None) -> None:
        """Refuse a quarantined request or a throttled tenant's; nothing otherwise.

        Raises:
            QueryOfDeathError: ``digest`` is quarantined.
            TenantThrottledError: ``tenant`` is throttled (``retry_after`` says how long).
        """
        with self._lock:
            self._reload()
            state = self._state
            if digest in state.quarantined:
                self.refused += 1
                raise QueryOfDeathError(
                    "this request was in flight each time an engine core died; it is refused "
                    "(request_quarantined)"
                )
            if tenant is None:
                return
            until = state.throttled.get(tenant, 0.0)
            now = self.clock()
            if until > now:
                self.refused += 1
                raise TenantThrottledError(
                    "requests of this tenant were in flight at repeated engine-core deaths; "
                    f"try again in {until - now:.0f} s",
                    retry_after=until - now,
                )

    def record_death(self, suspects: Iterable[Suspect], culprits: Iterable[Suspect] = ()) -> str:
        """Record a core's death; quarantine what it and the earlier ones single out.

        Args:
            suspects: The requests the death is shared between (at most
                :data:`MAX_SUSPECTS` are kept, the first ones).
            culprits: The requests the core's breadcrumb names (certain): quarantined now.

        Returns:
            The death's key (for :meth:`explained`).

        Raises:
            OSError: the file cannot be written (the death is still counted in memory).
        """
        with self._lock:
            self._reload()
            self._seq += 1
            death = _Death(
                self.clock(),
                tuple(suspects)[:MAX_SUSPECTS],
                key=f"{os.getpid()}-{id(self)}-{self._seq}",
                culprits=tuple(culprits),
            )
            self._add_death(death)
            lines = [death.to_json()]
            for digest, tenant in self._newly_quarantined():
                self._quarantine(digest, tenant, death.time)
                lines.append(
                    {"quarantine": {"digest": digest, "tenant": tenant, "time": death.time}}
                )
                logger.error(
                    "a request of tenant %s is blamed for engine-core deaths: quarantined "
                    "(digest %s)",
                    tenant,
                    digest[:16],
                )
            self._refresh()
            self._append(lines)
            return death.key

    def explained(self, key: str) -> bool:
        """Whether the death ``key`` had a culprit, or a suspect that is quarantined now."""
        with self._lock:
            self._reload()
            death = next((d for d in reversed(self._state.deaths) if d.key == key), None)
            return death is not None and bool(self._explained_by(death))

    def is_quarantined(self, digest: str) -> bool:
        """Whether ``digest`` is refused."""
        with self._lock:
            self._reload()
            return digest in self._state.quarantined

    def stats(self) -> dict[str, int]:
        """``quarantined_requests``, ``engine_deaths_recorded``, ``quarantine_refusals``."""
        with self._lock:
            return {
                "quarantined_requests": len(self._state.quarantined),
                "engine_deaths_recorded": len(self._state.deaths),
                "quarantine_refusals": self.refused,
            }

    # ----------------------------------------------------------------------- counting
    def _explained_by(self, death: _Death) -> list[Suspect]:
        """The requests that explain ``death``: its culprits, else its quarantined suspects."""
        if death.culprits:
            return list(death.culprits)
        q = self._state.quarantined
        return [s for s in death.suspects if s.digest in q]

    def _recent(self) -> list[_Death]:
        since = self.clock() - self.policy.window_s
        return [d for d in self._state.deaths if d.time >= since]

    def _newly_quarantined(self) -> list[tuple[str, str | None]]:
        """Digests whose shares of the unexplained recent deaths reach the threshold.

        A culprit's digest reaches it at once. Caller holds the lock.
        """
        q = self._state.quarantined
        weight: dict[str, float] = defaultdict(float)
        tenant_of: dict[str, str | None] = {}
        for death in self._recent():
            for s in death.culprits:
                weight[s.digest] += self.policy.deaths_to_quarantine
                tenant_of[s.digest] = s.tenant
            if death.culprits or any(s.digest in q for s in death.suspects):
                continue
            digests = {s.digest: s.tenant for s in death.suspects}
            for digest, tenant in digests.items():
                weight[digest] += 1.0 / len(digests)
                tenant_of[digest] = tenant
        threshold = self.policy.deaths_to_quarantine - 1e-9
        return [(d, tenant_of[d]) for d, w in weight.items() if w >= threshold and d not in q]

    def _refresh(self) -> None:
        """Recompute every tenant's throttle from the recent deaths. Caller holds the lock."""
        p = self.policy
        blame: dict[str, float] = defaultdict(float)
        last: dict[str, float] = {}
        for death in self._recent():
            culprits = self._explained_by(death)
            tenants = {s.tenant for s in (culprits or death.suspects) if s.tenant is not None}
            for tenant in tenants:
                blame[tenant] += 1.0 / len(tenants)
                last[tenant] = max(last.get(tenant, 0.0), death.time)
        throttled = {}
        for tenant, share in blame.items():
            if share >= p.tenant_deaths - 1e-9:
                extra = int(share - p.tenant_deaths + 1e-9)
                throttled[tenant] = last[tenant] + min(p.max_throttle_s, p.throttle_s * 2.0**extra)
        self._state.throttled = throttled

    # --------------------------------------------------------------------------- file
    def _add_death(self, death: _Death) -> None:
        if any(d.key == death.key for d in self._state.deaths[-64:]):
            return  # read back from the file after this process appended it
        self._state.deaths.append(death)
        del self._state.deaths[: -self.policy.max_deaths]

    def _quarantine(self, digest: str, tenant: str | None, when: float) -> None:
        q = self._state.quarantined
        q[digest] = (tenant, when)
        while len(q) > MAX_QUARANTINED:
            del q[next(iter(q))]

    def _apply(self, record: dict[str, Any]) -> None:
        if "death" in record:
            d = record["death"]
            suspects = tuple(Suspect(str(s[0]), s[1]) for s in d["suspects"])
            culprits = tuple(Suspect(str(s[0]), s[1]) for s in d.get("culprits", ()))
            death = _Death(float(d["time"]), suspects, str(d.get("key", "")), culprits)
            self._add_death(death)
        elif "quarantine" in record:
            q = record["quarantine"]
            self._quarantine(str(q["digest"]), q.get("tenant"), float(q["time"]))

    def _reload(self) -> None:
        """Read what other processes appended since the last read. Caller holds the lock.

        A file that cannot be read is logged and skipped: the quarantine never fails a check.
        """
        if self.path is None:
            return
        try:
            self._read_new()
        except OSError:
            logger.exception("could not read %s", self.path)

    def _read_new(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino == self._inode and st.st_size == self._seen:
            return  # nothing new: one stat per check
        with open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            try:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._size:
                    self._state, self._size, self._lines = _State(), 0, 0  # compacted: again
                    self._inode = st.st_ino
                self._seen = st.st_size
                f.seek(self._size)
                data = f.read()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        lines = data[:end].splitlines()
        self._lines += len(lines)
        for line in lines:
            try:
                record = json.loads(line)
                if isinstance(record, dict):
                    self._apply(record)
            except (ValueError, KeyError, TypeError, IndexError):
                logger.warning("a malformed line in %s was skipped", self.path)
        self._size += end
        if lines:
            self._refresh()

    def _append(self, records: list[dict[str, Any]]) -> None:
        """Append records to the file (and compact it when long). Caller holds the lock."""
        if self.path is None:
            return
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path) as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError:  # a full or read-only disk: counted in memory, lost at a restart
            logger.exception("could not write %s; this death is kept in memory only", self.path)
            return
        self._reload()
        live = len(self._state.deaths) + len(self._state.quarantined)
        if self._lines > COMPACT_LINES and live < COMPACT_LINES // 2:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the file with the current state (atomic rename, under the lock)."""
        records = [
            {"quarantine": {"digest": d, "tenant": t, "time": when}}
            for d, (t, when) in self._state.quarantined.items()
        ] + [d.to_json() for d in self._state.deaths]
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        with _locked(self.path):
            with open(tmp, "wb") as f:
                for r in records:
                    f.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        self._inode = None  # re-read from the new file
        self._reload()


class _locked:
    """The file at ``path`` opened for appending under an exclusive ``flock``.

    Retried when another process replaced the file (compaction) while this one waited for the
    lock, so that nothing is appended to a file that is no longer there.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: Any = None

    def __enter__(self) -> Any:
        while True:
            f = open(self.path, "ab")  # noqa: SIM115 - closed in __exit__
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.file = f
                return f
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
