"""The console's server-side sessions: who is logged in, until when, and their CSRF token.

The browser holds only a random session id (256 bits, ``secrets.token_urlsafe``) in an
``HttpOnly``, ``SameSite=Strict`` cookie; the API key typed at login never leaves the server's
memory of the login request. A session ends at logout, after ``idle_seconds`` without a request,
``max_age_seconds`` after login, or when its tenant key is revoked. Sessions live in this
process's memory: a restarted gateway logs everyone out, and several gateways behind one load
balancer each keep their own (route the console to one of them; docs/console.md).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

IDLE_SECONDS = 30 * 60.0
MAX_AGE_SECONDS = 12 * 3600.0
MAX_SESSIONS = 10_000
MAX_SESSIONS_PER_TENANT = 64  # per tenant (the admin counts as one): no login flood evicts others


@dataclass
class ConsoleSession:
    """One logged-in browser.

    Attributes:
        id: The cookie's value (URL-safe base64, 43 characters).
        csrf: The synchronizer token every change must send as ``X-CSRF-Token``.
        admin: Logged in with the admin key (sees the whole deployment).
        tenant_id: The tenant of a tenant key's session (None for the admin).
        tenant_name: Its name, for display.
        key_id: The tenant key logged in with (its revocation ends the session).
        created: ``clock()`` at login, seconds.
        seen: ``clock()`` at the last request, seconds.
    """

    id: str
    csrf: str
    admin: bool
    tenant_id: str | None = None
    tenant_name: str | None = None
    key_id: str | None = None
    created: float = 0.0
    seen: float = field(default=0.0)


class ConsoleSessions:
    """The live sessions, bounded: past ``max_sessions`` the least recently used one ends.

    Past ``max_sessions_per_tenant`` sessions of one tenant (or of the admin key) that
    tenant's oldest login ends first, so one tenant logging in again and again (any live key
    can) ends only its own sessions, never the admin's or another tenant's.

    Args:
        idle_seconds: A session unused this long ends.
        max_age_seconds: A session this old ends, used or not.
        max_sessions: At most this many live sessions (memory bound against login floods).
        clock: Monotonic seconds (tests pass a fake one).
        max_sessions_per_tenant: At most this many live sessions per tenant (the admin: one).
    """

    def __init__(
        self,
        idle_seconds: float = IDLE_SECONDS,
        max_age_seconds: float = MAX_AGE_SECONDS,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
        max_sessions_per_tenant: int = MAX_SESSIONS_PER_TENANT,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.max_age_seconds = max_age_seconds
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self.clock = clock
        self._live: OrderedDict[str, ConsoleSession] = OrderedDict()
        self._owned: dict[str | None, OrderedDict[str, None]] = {}  # tenant -> ids, oldest first

    @staticmethod
    def _owner(session: ConsoleSession) -> str | None:
        return None if session.admin else session.tenant_id

    def _remove(self, session_id: str) -> None:
        session = self._live.pop(session_id, None)
        if session is None:
            return
        owner = self._owner(session)
        owned = self._owned.get(owner)
        if owned is not None:
            owned.pop(session_id, None)
            if not owned:
                del self._owned[owner]

    def __len__(self) -> int:
        return len(self._live)

    def start(
        self,
        *,
        admin: bool,
        tenant_id: str | None = None,
        tenant_name: str | None = None,
        key_id: str | None = None,
    ) -> ConsoleSession:
        """A new session with fresh id and CSRF token (the least recently used one goes if full)."""
        now = self.clock()
        session = ConsoleSession(
            id=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            admin=admin,
            tenant_id=tenant_id,
            tenant_name=tenant_name,
            key_id=key_id,
            created=now,
            seen=now,
        )
        self._live[session.id] = session
        owned = self._owned.setdefault(self._owner(session), OrderedDict())
        owned[session.id] = None
        while len(owned) > self.max_sessions_per_tenant:
            self._remove(next(iter(owned)))
        while len(self._live) > self.max_sessions:
            self._remove(next(iter(self._live)))
        return session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session of this cookie value, its idle clock restarted; None if none."""
        if not session_id:
            return None
        session = self._live.get(session_id)
        if session is None:
            return None
        now = self.clock()
        if now - session.seen > self.idle_seconds or now - session.created > self.max_age_seconds:
            self._remove(session_id)
            return None
        session.seen = now
        self._live.move_to_end(session_id)
        return session

    def end(self, session_id: str) -> None:
        """End one session (logout); nothing if it is not live."""
        self._remove(session_id)

    def end_key(self, key_id: str) -> int:
        """End every session logged in with this tenant key (it was revoked).

        Returns:
            How many ended.
        """
        doomed = [s.id for s in self._live.values() if s.key_id == key_id]
        for session_id in doomed:
            self._remove(session_id)
        return len(doomed)
