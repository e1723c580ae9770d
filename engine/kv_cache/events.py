"""KV events: what a replica's cache and adapter slots gained and lost, for a router to mirror.

A router that knows which blocks each replica holds can send a request where its prefix is
cached, exactly instead of by guessing (llm-d's precise prefix-cache scorer and NVIDIA
Dynamo's KV router consume such events; vLLM publishes ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``). The engine records, in order:

- ``stored``: block hashes registered in the prefix cache (their KV is, or is about to be,
  written by the step that allocated them);
- ``removed``: hashes evicted (their block reused) or dropped (a failed step's blocks);
- ``cleared``: every hash forgotten (``reset_prefix_cache``; also the first event of a fresh
  engine, so a restarted replica's old view is dropped);
- ``lora_loaded`` / ``lora_unloaded``: an adapter's digest entered or left a device slot.

The hashes are the engine's own block hashes (``hashing.hash_block``: tokens, parent, adapter,
images, cache salt), identical across processes and restarts, so a router computing a
request's hashes with the same function knows exactly which leading blocks a replica holds.

The log is bounded: past ``max_pending`` undrained hashes it drops what it holds and records
one ``cleared`` (the router then under-estimates the replica: lost events cost hit rate, never
correctness, since a router only chooses where a request goes).
"""

from __future__ import annotations

import msgspec

KINDS = ("stored", "removed", "cleared", "lora_loaded", "lora_unloaded")


class KVEvent(msgspec.Struct, array_like=True, frozen=True):
    """One event.

    Attributes:
        kind: One of ``KINDS``.
        block_hashes: ``stored`` / ``removed``: the hashes, in the order they changed.
        adapter: ``lora_loaded`` / ``lora_unloaded``: the adapter's digest.
    """

    kind: str
    block_hashes: list[bytes] = []
    adapter: str | None = None


class KVEventLog:
    """The engine's pending events, drained once per step by whoever publishes them.

    Args:
        max_pending: Most undrained block hashes kept (see the module docstring).
    """

    def __init__(self, max_pending: int = 1 << 20) -> None:
        self.max_pending = max_pending
        self._events: list[KVEvent] = [KVEvent("cleared")]
        self._num_hashes = 0
        self.num_overflows = 0

    def stored(self, block_hashes: list[bytes]) -> None:
        """Hashes registered in the prefix cache."""
        self._add(KVEvent("stored", block_hashes))

    def removed(self, block_hashes: list[bytes]) -> None:
        """Hashes evicted or dropped."""
        self._add(KVEvent("removed", block_hashes))

    def cleared(self) -> None:
        """Every hash forgotten: what was pending no longer matters."""
        self._events = [e for e in self._events if e.kind.startswith("lora")]
        self._events.append(KVEvent("cleared"))
        self._num_hashes = 0

    def adapter_loaded(self, digest: str) -> None:
        """An adapter entered a device slot."""
        self._events.append(KVEvent("lora_loaded", adapter=digest))

    def adapter_unloaded(self, digest: str) -> None:
        """An adapter left its device slot."""
        self._events.append(KVEvent("lora_unloaded", adapter=digest))

    def drain(self) -> list[KVEvent]:
        """The pending events, oldest first; the log is empty afterwards."""
        events, self._events = self._events, []
        self._num_hashes = 0
        return events

    def _add(self, event: KVEvent) -> None:
        if not event.block_hashes:
            return
        self._num_hashes += len(event.block_hashes)
        if self._num_hashes > self.max_pending:
            self.num_overflows += 1
            self.cleared()
            return
        self._events.append(event)
