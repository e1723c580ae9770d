"""Property tests of the KV cache manager: random operation sequences against a model.

A hypothesis ``RuleBasedStateMachine`` drives one :class:`KVCacheManager` (small pool, block size
2-4, prefix caching on or off) through admissions (with prefix hits and chunked prefill),
decode steps, forks with copy-on-write, frees, preemptions and resumptions, evicting
admissions, stale prefix matches and cache resets, and keeps a model beside it:

- a mirror :class:`BlockTable` per live sequence, built only from the returned
  ``SlotAllocation`` objects, which must equal ``manager.get_block_ids``;
- a *KV oracle*: the content of every physical slot, written the way the model runner would
  write it (copies first, then the step's tokens through the block table). A slot's content is
  ``(lora, salt, prefix id)``, the prefix id naming the exact token prefix that ends at that
  position. Every live sequence must read back exactly its own prefix through its table, and
  every cached block must hold exactly what its hash means; so a wrong prefix hit, a missing
  copy-on-write or a write into a block another sequence still reads all fail here.

Invariants are checked after every step (see ``model_invariants``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from loraplex.engine.client.replica_view import ReplicaView
from loraplex.engine.kv_cache import (
    BlockCopy,
    BlockTable,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    PrefixMatch,
)
from loraplex.engine.kv_cache.events import KVEventLog
from loraplex.hashing.request_hasher import RequestBlockHasher

# A tiny vocabulary and a few shared prefixes, so prompts share blocks often.
PREFIXES: tuple[tuple[int, ...], ...] = (
    (),
    (1, 1, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 2, 2, 2, 2, 2, 2),
    (3, 0, 3, 0, 3, 0),
)
TAIL_TOKENS = st.integers(0, 3)
LORAS = st.sampled_from([None, None, None, "lora-a", "lora-b"])
SALTS = st.sampled_from([None, None, None, "tenant-1"])
PICK = st.integers(0, 1 << 16)  # index into the live / waiting sequences, taken modulo


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Seq:
    """The model of one sequence (a request or a forked child)."""

    rid: str
    family: int  # fork lineage: a partial block may only be shared inside one family
    lora: str | None
    salt: str | None
    hasher: RequestBlockHasher
    table: BlockTable
    tokens: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # pids[p]: id of the prefix tokens[: p + 1]
    computed: int = 0  # tokens whose KV the sequence's blocks hold

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    def slot_key(self, p: int) -> tuple:
        """What physical slot of position ``p`` must hold for this sequence."""
        return (self.lora, self.salt, self.pids[p])


class KVCacheMachine(RuleBasedStateMachine):
    """Random operations on one KVCacheManager, checked against a model after every step."""

    # ------------------------------------------------------------------------------- setup
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.integers(2, 4),
        caching=st.sampled_from([True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.events = KVEventLog()
        self.mgr = KVCacheManager(
            num_blocks, block_size, enable_caching=caching, events=self.events
        )
        self.pool = self.mgr.pool
        self.router_view = ReplicaView("replica")  # a router's mirror, from the events only
        self.bs = block_size
        self.num_blocks = num_blocks
        self.caching = caching
        self.live: dict[str, Seq] = {}
        self.waiting: dict[str, Seq] = {}  # preempted: hold no blocks, keep their tokens
        self.all_ids: list[str] = []
        self.next_id = 0
        self.next_family = 0
        self.unique_token = 1000  # tokens of evicting requests never repeat: no hits
        # The KV oracle: content[block_id][offset] is the (lora, salt, prefix id) written there.
        self.content: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.trie: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id
        self.meaning: dict[bytes, tuple] = {}  # block hash -> the slot keys of its block
        self.expected_stats = {"requests": 0, "queried": 0, "hit": 0}
        self.expected_sources: dict[tuple, list[int]] = {}
        self.num_hits = 0
        self.history: list[tuple[list[int], str | None, str | None]] = []  # prompts seen
        self.num_steps = 0

    # ------------------------------------------------------------------------------ model
    def _new_id(self) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.all_ids.append(rid)
        return rid

    def _push_tokens(self, seq: Seq, tokens: list[int]) -> None:
        """Append tokens to a sequence and its hasher; record what each new hash means."""
        for t in tokens:
            parent = seq.pids[-1] if seq.pids else 0
            pid = self.trie.setdefault((parent, t), len(self.trie) + 1)
            seq.pids.append(pid)
        seq.tokens.extend(tokens)
        first = len(seq.hasher.block_hashes)
        new = seq.hasher.extend(tokens)
        assert seq.hasher.block_hashes[first:] == new
        assert len(seq.hasher.block_hashes) == len(seq.tokens) // self.bs
        bs = self.bs
        for j in range(first, len(seq.hasher.block_hashes)):
            h = seq.hasher.block_hashes[j]
            keys = tuple(seq.slot_key(p) for p in range(j * bs, (j + 1) * bs))
            # Equal hashes must mean equal content (tokens, adapter and salt all hashed).
            assert self.meaning.setdefault(h, keys) == keys, f"hash collision on block {j}"

    def _new_seq(self, tokens: list[int], lora: str | None, salt: str | None) -> Seq:
        seq = Seq(
            rid=self._new_id(),
            family=self.next_family,
            lora=lora,
            salt=salt,
            hasher=RequestBlockHasher(self.bs, lora_digest=lora, cache_salt=salt),
            table=BlockTable(self.bs),
        )
        self.next_family += 1
        self._push_tokens(seq, tokens)
        self.history.append((list(tokens), lora, salt))
        return seq

    def _pick(self, pool: dict[str, Seq], i: int) -> Seq:
        return list(pool.values())[i % len(pool)]

    def _holders(self) -> dict[int, int]:
        """block id -> number of live block tables (per the mirrors) that hold it."""
        counts: dict[int, int] = {}
        for seq in self.live.values():
            for b in seq.table.block_ids:
                counts[b] = counts.get(b, 0) + 1
        return counts

    def _queue_ids(self) -> list[int]:
        return [b.block_id for b in self.pool.free_queue]

    def _snapshot(self) -> tuple:
        """Everything an all-or-nothing failure or a refused reset must leave unchanged."""
        pool = self.pool
        stats = self.mgr.stats
        return (
            pool.num_free,
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached.items()},
            self._queue_ids(),
            pool.epoch,
            pool.num_evictions,
            {rid: (rid in self.mgr, self.mgr.get_block_ids(rid)) for rid in self.all_ids},
            (stats.total.requests, stats.total.queried_tokens, stats.total.hit_tokens),
            sorted(
                (src, c.requests, c.queried_tokens, c.hit_tokens)
                for src, c in stats.by_source.items()
            ),
        )

    def _write(self, seq: Seq, start: int, end: int) -> None:
        """The model runner's KV writes of positions [start, end) through the mirror table."""
        for p, slot in zip(range(start, end), seq.table.slot_mapping(start, end), strict=True):
            block, offset = divmod(slot, self.bs)
            self.content[block][offset] = seq.slot_key(p)

    def _expected_hit(self, hashes: list[bytes], num_tokens: int) -> list[KVCacheBlock]:
        if not self.caching or num_tokens <= 0:
            return []
        cap = min(len(hashes), (num_tokens - 1) // self.bs)
        hit = []
        for h in hashes[:cap]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    # -------------------------------------------------------------------------- admission
    def _lookup(self, seq: Seq) -> PrefixMatch:
        n = len(seq.tokens)
        match = self.mgr.get_computed_blocks(seq.hasher.block_hashes, n)
        expected = self._expected_hit(seq.hasher.block_hashes, n)
        assert list(match.blocks) == expected  # the longest cached run, capped at n - 1 tokens
        assert match.num_cached_tokens == len(match.blocks) * self.bs <= max(n - 1, 0)
        assert match.num_queried_tokens == n
        for i, block in enumerate(match.blocks):  # a hit holds exactly the hashes asked for
            assert block.block_hash == seq.hasher.block_hashes[i]
        if not self.caching:
            assert match.blocks == ()
        return match

    def _admit(self, seq: Seq, chunk: int | None, match: PrefixMatch | None = None) -> bool:
        """Look up and allocate a sequence that holds no blocks; True when it now runs."""
        bs = self.bs
        n = len(seq.tokens)
        assert seq.rid not in self.mgr and seq.computed == 0 and not seq.table.block_ids
        if match is None:
            match = self._lookup(seq)
        hit_blocks = list(match.blocks)
        hit_tokens = len(hit_blocks) * bs
        rest = n - hit_tokens
        assert rest >= 1
        k = rest if chunk is None else min(chunk, rest)
        revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        num_fresh = max(0, _cdiv(hit_tokens + k, bs) - len(hit_blocks))
        fits = num_fresh <= self.pool.num_free - revived
        before = self._snapshot()
        hit_ids = {b.block_id for b in hit_blocks}
        queue_before = [b for b in self._queue_ids() if b not in hit_ids]

        alloc = self.mgr.allocate_slots(
            seq.rid,
            k,
            prefix=match,
            block_hashes=seq.hasher.block_hashes,
            stat_sources=seq.hasher.stat_sources(),
        )
        if hit_blocks:
            event("admission with a prefix hit")
            self.num_hits += 1
        if not fits:
            event("admission refused")
            assert alloc is None, "allocation succeeded without enough free blocks"
            assert self._snapshot() == before, "a refused allocation changed the pool"
            assert seq.rid not in self.mgr
            return False
        assert alloc is not None, "allocation refused although the blocks were free"
        assert alloc.copies == []
        fresh = alloc.new_block_ids[len(hit_blocks) :]
        assert alloc.new_block_ids[: len(hit_blocks)] == [b.block_id for b in hit_blocks]
        assert len(fresh) == num_fresh
        # Eviction order: fresh blocks come off the front of the free queue (LRU first), and a
        # hit's revived blocks leave the queue from wherever they were.
        assert fresh == queue_before[:num_fresh]
        assert self._queue_ids() == queue_before[num_fresh:]
        seq.table.apply(alloc)
        self._write(seq, hit_tokens, hit_tokens + k)
        seq.computed = hit_tokens + k
        self.live[seq.rid] = seq
        if self.caching:
            self.expected_stats["requests"] += 1
            self.expected_stats["queried"] += n
            self.expected_stats["hit"] += hit_tokens
            for src in seq.hasher.stat_sources():
                c = self.expected_sources.setdefault(src, [0, 0, 0])
                c[0] += 1
                c[1] += n
                c[2] += hit_tokens
        return True

    def _grow(self, seq: Seq, k: int) -> bool:
        """Allocate k more (already known) tokens of a running sequence; True on success."""
        bs = self.bs
        assert 1 <= k <= seq.pending
        holders = self._holders()
        idx = seq.computed // bs
        cow = seq.computed % bs != 0 and holders.get(seq.table.block_ids[idx], 0) > 1
        num_fresh = max(0, _cdiv(seq.computed + k, bs) - len(seq.table))
        fits = num_fresh + cow <= self.pool.num_free
        before = self._snapshot()
        queue_before = self._queue_ids()
        others_before = {r: list(s.table.block_ids) for r, s in self.live.items() if r != seq.rid}

        alloc = self.mgr.allocate_slots(
            seq.rid,
            k,
            num_computed_tokens=seq.computed,
            block_hashes=seq.hasher.block_hashes,
        )
        if not fits:
            event("step refused")
            assert alloc is None, "allocation succeeded without enough free blocks"
            assert self._snapshot() == before, "a refused allocation changed the pool"
            return False
        assert alloc is not None, "allocation refused although the blocks were free"
        taken = [c.dst for c in alloc.copies] + alloc.new_block_ids
        assert taken == queue_before[: num_fresh + cow]
        assert self._queue_ids() == queue_before[num_fresh + cow :]
        assert len(alloc.new_block_ids) == num_fresh
        if cow:
            event("copy-on-write")
            src = seq.table.block_ids[idx]
            assert alloc.copies == [BlockCopy(idx, src, alloc.copies[0].dst)], (
                "a write into a shared partial block must be copied first"
            )
        else:
            assert alloc.copies == []
        seq.table.apply(alloc)
        for copy in alloc.copies:  # the runner copies before the step's writes
            self.content[copy.dst] = list(self.content[copy.src])
        self._write(seq, seq.computed, seq.computed + k)
        seq.computed += k
        # The writer's copy-on-write never changes another sequence's table.
        for r, ids in others_before.items():
            assert self.mgr.get_block_ids(r) == ids == self.live[r].table.block_ids
        return True

    def _release(self, seq: Seq) -> None:
        """Free a live sequence, checking the free-queue order it leaves."""
        holders = self._holders()
        released = [self.pool.blocks[b] for b in reversed(seq.table.block_ids) if holders[b] == 1]
        queue_before = self._queue_ids()
        assert self.mgr.free(seq.rid) == len(seq.table)
        del self.live[seq.rid]
        assert seq.rid not in self.mgr and self.mgr.get_block_ids(seq.rid) == []
        # Tail first: cached blocks go to the back (the block ending the longest prefix is
        # evicted first among them); uncached ones go to the front (evicting them costs no hit).
        uncached = [b.block_id for b in released if b.block_hash is None]
        cached = [b.block_id for b in released if b.block_hash is not None]
        assert self._queue_ids() == uncached + queue_before + cached
        assert self.mgr.free(seq.rid) == 0  # a second free does nothing

    # ------------------------------------------------------------------------------ rules
    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(TAIL_TOKENS, max_size=8),
        lora=LORAS,
        salt=SALTS,
        chunk=st.none() | st.integers(1, 6),
    )
    def add_request(self, prefix, tail, lora, salt, chunk) -> None:
        tokens = list(prefix) + tail
        if not tokens:
            tokens = [0]
        seq = self._new_seq(tokens, lora, salt)
        if not self._admit(seq, chunk):
            self.waiting[seq.rid] = seq

    @precondition(lambda self: self.history)
    @rule(
        i=PICK,
        keep=st.integers(1, 40),
        tail=st.lists(TAIL_TOKENS, max_size=4),
        same_keys=st.sampled_from([True, True, True, False]),
        lora=LORAS,
        salt=SALTS,
        chunk=st.none() | st.integers(1, 6),
    )
    def add_similar_request(self, i, keep, tail, same_keys, lora, salt, chunk) -> None:
        """A prompt that starts like an earlier one: a likely prefix hit (or, with other extra
        keys, a likely wrong hit if the keys were not hashed)."""
        tokens, old_lora, old_salt = self.history[i % len(self.history)]
        if same_keys:
            lora, salt = old_lora, old_salt
        tokens = tokens[:keep] + tail
        seq = self._new_seq(tokens or [0], lora, salt)
        if not self._admit(seq, chunk):
            self.waiting[seq.rid] = seq

    @rule(data=st.data())
    def add_evicting_request(self, data) -> None:
        """A long prompt of never-seen tokens: no hit, and it takes cached free blocks."""
        n = data.draw(st.integers(self.bs, self.num_blocks * self.bs), label="num_tokens")
        tokens = list(range(self.unique_token, self.unique_token + n))
        self.unique_token += n
        seq = self._new_seq(tokens, None, None)
        evictable = sum(1 for b in self.pool.free_queue if b.block_hash is not None)
        evictions = self.pool.num_evictions
        if self._admit(seq, None):
            fresh = _cdiv(n, self.bs)
            # Uncached free blocks sit at the front; only past them do hashes get evicted.
            uncached_free = self.pool.num_free + fresh - evictable
            expected = max(0, fresh - uncached_free)
            if expected:
                event("evicted cached blocks")
            assert self.pool.num_evictions - evictions == expected
        else:
            self.waiting[seq.rid] = seq

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(1, 5), new=st.lists(TAIL_TOKENS, min_size=5, max_size=5))
    def step(self, i, k, new) -> None:
        """One scheduler step of a running sequence: a prefill chunk or k decoded tokens."""
        seq = self._pick(self.live, i)
        if seq.pending == 0:
            self._push_tokens(seq, new[:k])  # sampled tokens; they stay pending on failure
        self._grow(seq, min(k, seq.pending))

    @precondition(lambda self: self.live)
    @rule(
        i=PICK,
        k=st.integers(1, 6),
        accepted=st.integers(0, 6),
        new=st.lists(TAIL_TOKENS, min_size=8, max_size=8),
    )
    def speculate(self, i, k, accepted, new) -> None:
        """A decode step that verifies k proposal tokens in lookahead slots, then the rollback:
        ``accepted`` of them (at most k) and the target's next token join the sequence; the
        blocks holding only rejected ones go back; nothing rejected is ever hashed."""
        seq = self._pick(self.live, i)
        if seq.pending == 0:
            self._push_tokens(seq, new[:1])  # the token the last step sampled
        if seq.pending != 1:
            return  # a prefill still running: no speculation
        bs = self.bs
        accepted = min(accepted, k)
        holders = self._holders()
        idx = seq.computed // bs
        cow = seq.computed % bs != 0 and holders.get(seq.table.block_ids[idx], 0) > 1
        num_fresh = max(0, _cdiv(seq.computed + 1 + k, bs) - len(seq.table))
        fits = num_fresh + cow <= self.pool.num_free
        before = self._snapshot()
        alloc = self.mgr.allocate_slots(
            seq.rid,
            1,
            num_computed_tokens=seq.computed,
            block_hashes=seq.hasher.block_hashes,
            num_lookahead_tokens=k,
        )
        if not fits:
            event("speculation refused")
            assert alloc is None and self._snapshot() == before
            return
        assert alloc is not None and len(alloc.new_block_ids) == num_fresh
        assert len(alloc.copies) == cow
        seq.table.apply(alloc)
        for copy in alloc.copies:
            self.content[copy.dst] = list(self.content[copy.src])
        start = seq.computed
        # The step writes the last token and the k proposals; the accepted ones become tokens.
        self._write(seq, start, start + 1)
        self._push_tokens(seq, new[1 : 1 + accepted])
        self._write(seq, start + 1, start + 1 + accepted)
        slots = seq.table.slot_mapping(start + 1 + accepted, start + 1 + k)
        for slot in slots:  # rejected proposals: KV that no sequence may ever read
            block, offset = divmod(slot, bs)
            self.content[block][offset] = ("rejected", self.next_id, slot)
        for block_id in seq.table.block_ids[_cdiv(start + 1, bs) :]:  # none hashed yet
            assert self.pool.blocks[block_id].block_hash is None
        seq.computed = start + 1 + accepted
        self._push_tokens(seq, new[1 + accepted : 2 + accepted])  # the target's bonus token
        keep = _cdiv(seq.computed, bs)
        tail = seq.table.block_ids[keep:]
        queue_before = self._queue_ids()
        holders = self._holders()
        assert self.mgr.trim(seq.rid, seq.computed) == tail
        if tail:
            event("rejected lookahead blocks given back")
        seq.table = BlockTable(bs, seq.table.block_ids[:keep])
        released = [b for b in reversed(tail) if holders[b] == 1]
        assert self._queue_ids() == released + queue_before  # uncached: front of the queue
        assert self.mgr.trim(seq.rid, seq.computed) == []  # nothing more to give back
        if accepted == k:
            event("every proposal accepted")

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def fork(self, i) -> None:
        parent = self._pick(self.live, i)
        child = Seq(
            rid=self._new_id(),
            family=parent.family,
            lora=parent.lora,
            salt=parent.salt,
            hasher=parent.hasher.fork(),
            table=BlockTable(self.bs, parent.table.block_ids),
            tokens=list(parent.tokens),
            pids=list(parent.pids),
            computed=parent.computed,
        )
        free_before = self.pool.num_free
        self.mgr.fork(parent.rid, child.rid)
        assert self.pool.num_free == free_before  # sharing takes no block
        assert child.hasher.block_hashes == parent.hasher.block_hashes
        assert child.hasher.block_hashes is not parent.hasher.block_hashes
        self.live[child.rid] = child
        with pytest.raises(ValueError):
            self.mgr.fork(parent.rid, child.rid)  # the child already holds blocks

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(1, 3), new=st.lists(TAIL_TOKENS, min_size=3, max_size=3))
    def fork_and_write(self, i, k, new) -> None:
        """Fork, then the child decodes at once: copy-on-write if the last block is partial."""
        self.fork(i)
        child = list(self.live.values())[-1]
        parent_ids = {r: list(s.table.block_ids) for r, s in self.live.items()}
        if child.pending == 0:
            self._push_tokens(child, new[:k])
        self._grow(child, min(k, child.pending))
        for r, ids in parent_ids.items():
            if r != child.rid:
                assert self.mgr.get_block_ids(r) == ids

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def finish(self, i) -> None:
        self._release(self._pick(self.live, i))

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def preempt(self, i) -> None:
        """Free a running sequence's blocks (they stay cached) and re-queue it to recompute."""
        seq = self._pick(self.live, i)
        self._release(seq)
        seq.computed = 0
        seq.table = BlockTable(self.bs)
        seq.family = self.next_family  # a recomputed sequence shares no partial block
        self.next_family += 1
        self.waiting[seq.rid] = seq

    @precondition(lambda self: self.waiting)
    @rule(i=PICK, chunk=st.none() | st.integers(1, 6))
    def resume(self, i, chunk) -> None:
        seq = self._pick(self.waiting, i)
        if self._admit(seq, chunk):
            del self.waiting[seq.rid]

    @precondition(lambda self: self.waiting)
    @rule(i=PICK, data=st.data())
    def stale_match(self, i, data) -> None:
        """Look a sequence up, let an evicting admission run, then allocate with the old match."""
        seq = self._pick(self.waiting, i)
        match = self._lookup(seq)
        self.add_evicting_request(data)
        stale = match.pool_epoch != self.pool.epoch and any(
            b.block_hash != seq.hasher.block_hashes[j] for j, b in enumerate(match.blocks)
        )
        if stale:
            event("stale match refused")
            before = self._snapshot()
            with pytest.raises(ValueError, match="stale"):
                self.mgr.allocate_slots(
                    seq.rid, 1, prefix=match, block_hashes=seq.hasher.block_hashes
                )
            assert self._snapshot() == before
            assert seq.rid not in self.mgr
        elif self._admit(seq, None, match=match):
            del self.waiting[seq.rid]

    @precondition(lambda self: self.history)
    @rule()
    def reset_prefix_cache(self) -> None:
        before = self._snapshot()
        in_use = self.pool.num_used
        ok = self.mgr.reset_prefix_cache()
        if in_use:
            assert ok is False
            assert self._snapshot() == before, "a refused reset changed the pool"
        else:
            event("reset accepted")
            assert ok is True
            assert self.pool.cached == {}
            assert all(b.block_hash is None for b in self.pool.blocks)
            assert self.pool.num_free == self.num_blocks
            for seq in self.waiting.values():  # nothing can hit any more
                assert self.mgr.get_computed_blocks(seq.hasher.block_hashes, 10**6).blocks == ()

    @precondition(lambda self: self.live)
    @rule(reset=st.booleans())
    def drain(self, reset) -> None:
        """Free everything: no block may leak, and a reset must then be accepted."""
        for seq in list(self.live.values()):
            self._release(seq)
        self._check_no_leak()
        if reset:
            self.reset_prefix_cache()

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def misuse_changes_nothing(self, i) -> None:
        seq = self._pick(self.live, i)
        before = self._snapshot()
        held = len(seq.table) * self.bs
        with pytest.raises(ValueError):
            self.mgr.allocate_slots(seq.rid, 1, num_computed_tokens=held + 1)
        with pytest.raises(ValueError):
            self.mgr.allocate_slots(seq.rid, -1, num_computed_tokens=seq.computed)
        with pytest.raises(ValueError):
            self.mgr.allocate_slots(
                seq.rid, 1, num_computed_tokens=seq.computed, num_lookahead_tokens=-1
            )
        with pytest.raises(ValueError):
            self.mgr.trim(seq.rid, -1)
        with pytest.raises(KeyError):
            self.mgr.fork("no-such-request", "no-such-child")
        if self.pool.cached:
            block = next(iter(self.pool.cached.values()))
            bogus = PrefixMatch((block,), self.bs, self.bs + 1, self.pool.epoch)
            with pytest.raises(ValueError):
                self.mgr.allocate_slots(seq.rid, 1, num_computed_tokens=seq.computed, prefix=bogus)
        assert self._snapshot() == before

    # ------------------------------------------------------------------------- invariants
    def _check_no_leak(self) -> None:
        assert self.pool.num_free == self.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert sorted(self._queue_ids()) == list(range(self.num_blocks))

    @invariant()
    def model_invariants(self) -> None:
        pool, mgr, bs = self.pool, self.mgr, self.bs
        self.num_steps += 1
        # KV events (issue 18): a router applying them knows exactly the cached hashes.
        self.router_view.apply(self.events.drain())
        assert self.router_view.hashes == set(pool.cached)
        # Mirrors equal the manager's tables; waiting and freed sequences hold nothing.
        for rid, seq in self.live.items():
            assert rid in mgr
            assert mgr.get_block_ids(rid) == seq.table.block_ids
            assert mgr.num_blocks_of(rid) == len(seq.table) == _cdiv(seq.computed, bs)
        for rid in self.all_ids:
            if rid not in self.live:
                assert rid not in mgr and mgr.get_block_ids(rid) == []

        # Ref counts: never negative, equal to the number of live tables holding the block.
        holders = self._holders()
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders.get(block.block_id, 0), block

        # The free queue holds exactly the ref-count-0 blocks, each once, linked both ways.
        queue = list(pool.free_queue)
        assert len(queue) == pool.num_free == len(pool.free_queue)
        assert len({b.block_id for b in queue}) == len(queue)
        assert all(b.ref_cnt == 0 for b in queue)
        assert {b.block_id for b in queue} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        node = pool.free_queue.head
        for block in queue:
            assert node.next_free is block and block.prev_free is node
            node = block
        assert node.next_free is pool.free_queue.tail and pool.free_queue.tail.prev_free is node
        assert pool.num_free + sum(1 for b in pool.blocks if b.ref_cnt > 0) == self.num_blocks
        # Uncached free blocks all come before cached ones: eviction costs a hit only when no
        # uncached block is left.
        hashed = [b.block_hash is not None for b in queue]
        assert hashed == sorted(hashed)
        assert pool.num_used == self.num_blocks - pool.num_free

        # The cache map and the blocks' hashes agree, and a cached block holds what its hash
        # means (the KV oracle), whether it is in use or free.
        if not self.caching:
            assert pool.cached == {}
        for h, block in pool.cached.items():
            assert block.block_hash == h
            assert list(self.meaning[h]) == self.content[block.block_id], (
                f"cached block {block.block_id} does not hold the content of its hash"
            )
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached.get(block.block_hash) is block

        # Every live sequence reads back exactly its own prefix through its table; a cached
        # block in its table holds the hash the sequence computes for that logical block.
        for seq in self.live.values():
            ids = seq.table.block_ids
            assert len(set(ids)) == len(ids)
            for p in range(seq.computed):
                assert self.content[ids[p // bs]][p % bs] == seq.slot_key(p), (
                    f"{seq.rid} reads wrong KV at position {p}"
                )
            for j, b in enumerate(ids):
                h = pool.blocks[b].block_hash
                if h is not None:
                    assert (j + 1) * bs <= seq.computed
                    assert h == seq.hasher.block_hashes[j]

        # Sharing: a physical block sits at one logical index in every table holding it; a full
        # shared block means equal prefixes and extra keys; a partial one is legal only inside
        # one fork family that has not written to it since the fork.
        where: dict[int, list[tuple[Seq, int]]] = {}
        for seq in self.live.values():
            for j, b in enumerate(seq.table.block_ids):
                where.setdefault(b, []).append((seq, j))
        for b, users in where.items():
            (a, j), rest = users[0], users[1:]
            end = (j + 1) * bs
            for other, j2 in rest:
                assert j2 == j, f"block {b} at logical {j} and {j2}"
                assert (a.lora, a.salt) == (other.lora, other.salt)
                if a.computed >= end and other.computed >= end:
                    assert a.pids[end - 1] == other.pids[end - 1]
                else:
                    assert a.family == other.family, f"partial block {b} shared across families"
                    assert a.computed == other.computed
                    assert a.pids[a.computed - 1] == other.pids[other.computed - 1]

        # Hit-rate statistics count every admission's lookup (and only successful ones).
        total = mgr.stats.total
        assert (total.requests, total.queried_tokens, total.hit_tokens) == (
            self.expected_stats["requests"],
            self.expected_stats["queried"],
            self.expected_stats["hit"],
        )
        for src, counts in self.expected_sources.items():
            got = mgr.stats.by_source[src]
            assert [got.requests, got.queried_tokens, got.hit_tokens] == counts

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        event(f"prefix hits in run: {min(self.num_hits, 5)}{'+' if self.num_hits >= 5 else ''}")
        event(f"steps in run: {self.num_steps // 10 * 10}+")
        for seq in list(self.live.values()):
            self._release(seq)
        self.model_invariants()
        self._check_no_leak()
        assert self.mgr.reset_prefix_cache() is True


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
KVCacheMachine.TestCase.pytestmark = [pytest.mark.slow]  # 200 runs of 50 steps: ~3 s
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase


# ------------------------------------------------------------------- single-shot properties
@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 12),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["popleft", "remove", "append", "appendleft"]), st.integers(0, 20)
        ),
        max_size=40,
    ),
)
def test_free_block_queue_matches_a_list(n, ops):
    blocks = [KVCacheBlock(i) for i in range(n)]
    queue = FreeBlockQueue(blocks)
    model = list(range(n))
    for op, x in ops:
        outside = [b for b in blocks if b.block_id not in model]
        if op == "popleft":
            if x > len(model):
                with pytest.raises(ValueError):
                    queue.popleft_n(x)
            else:
                got = queue.popleft_n(x)
                for b in got:
                    b.prev_free = None  # the pool's job (see popleft_n)
                assert [b.block_id for b in got] == model[:x]
                del model[:x]
        elif op == "remove":
            if model and x % 2 == 0:
                bid = model[x % len(model)]
                queue.remove(blocks[bid])
                model.remove(bid)
            elif outside:
                with pytest.raises(ValueError):
                    queue.remove(outside[x % len(outside)])
        else:
            chosen = outside[: x % (len(outside) + 1)]
            if op == "append":
                queue.append_n(chosen)
                model.extend(b.block_id for b in chosen)
            else:
                queue.appendleft_n(chosen)
                model[:0] = [b.block_id for b in chosen]
        assert [b.block_id for b in queue] == model
        assert len(queue) == queue.num_free == len(model)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 5),
    tokens=st.lists(TAIL_TOKENS, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=5),
    fork_at=st.integers(0, 30),
    child_tail=st.lists(TAIL_TOKENS, max_size=10),
    lora=LORAS,
    salt=SALTS,
)
def test_hasher_is_chunking_invariant_and_forks_independently(
    block_size, tokens, cuts, fork_at, child_tail, lora, salt
):
    def fresh(toks):
        h = RequestBlockHasher(block_size, lora_digest=lora, cache_salt=salt)
        h.extend(toks)
        return h.block_hashes

    hasher = RequestBlockHasher(block_size, lora_digest=lora, cache_salt=salt)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    fork_at = min(fork_at, len(tokens))
    child = None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if child is None and lo <= fork_at < hi:
            hasher.extend(tokens[lo:fork_at])
            child = hasher.fork()
            hasher.extend(tokens[fork_at:hi])
        else:
            hasher.extend(tokens[lo:hi])
    if child is None:
        child = hasher.fork()
        child_base = tokens
    else:
        child_base = tokens[:fork_at]
    assert hasher.block_hashes == fresh(tokens)
    child.extend(child_tail)
    assert child.block_hashes == fresh(child_base + child_tail)
    assert hasher.block_hashes == fresh(tokens)  # the child's tokens never reach the parent
    assert child.num_tokens == len(child_base) + len(child_tail)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 4),
    prompt=st.lists(TAIL_TOKENS, min_size=1, max_size=20),
    lora=LORAS,
    salt=SALTS,
    other=st.sampled_from(["same", "lora", "salt"]),
)
def test_finished_prompt_is_hit_again_except_its_last_token(block_size, prompt, lora, salt, other):
    mgr = KVCacheManager(num_blocks=_cdiv(40, block_size) + 2, block_size=block_size)
    hasher = RequestBlockHasher(block_size, lora_digest=lora, cache_salt=salt)
    hasher.extend(prompt)
    n = len(prompt)
    match = mgr.get_computed_blocks(hasher.block_hashes, n)
    assert match.blocks == ()
    alloc = mgr.allocate_slots("a", n, prefix=match, block_hashes=hasher.block_hashes)
    assert alloc is not None and len(alloc.new_block_ids) == _cdiv(n, block_size)
    first_ids = alloc.new_block_ids
    assert mgr.free("a") == len(first_ids)

    if other == "same":
        again = RequestBlockHasher(block_size, lora_digest=lora, cache_salt=salt)
    elif other == "lora":
        again = RequestBlockHasher(block_size, lora_digest="other-lora", cache_salt=salt)
    else:
        again = RequestBlockHasher(block_size, lora_digest=lora, cache_salt="other-tenant")
    again.extend(prompt)
    match = mgr.get_computed_blocks(again.block_hashes, n)
    if other == "same":
        expected = (n - 1) // block_size  # the last prompt token is always computed
        assert match.block_ids == first_ids[:expected]
        assert match.num_cached_tokens == expected * block_size
    else:  # another adapter or tenant never shares a block
        assert match.blocks == ()
    alloc = mgr.allocate_slots(
        "b", n - match.num_cached_tokens, prefix=match, block_hashes=again.block_hashes
    )
    assert alloc is not None
    assert alloc.new_block_ids[: len(match.blocks)] == match.block_ids
    mgr.free("b")
    assert mgr.num_free_blocks == mgr.pool.num_blocks
