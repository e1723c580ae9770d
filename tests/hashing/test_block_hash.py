import hashlib
import subprocess
import sys

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.hashing.block_hash import encode_block, hash_block, pack_token_ids, seed_hash
from loraplex.hashing.extra_keys import MMPlaceholder, block_extra_keys, validate_placeholders
from loraplex.hashing.request_hasher import RequestBlockHasher


def test_seed_is_a_fixed_constant():
    assert seed_hash("sha256") == hashlib.sha256(b"loraplex/block-hash/v1").digest()
    assert seed_hash("xxhash") == xxhash.xxh3_128_digest(b"loraplex/block-hash/v1")
    assert len(seed_hash("sha256")) == 32 and len(seed_hash("xxhash")) == 16


def test_encoding_is_canonical_msgpack():
    parent = bytes(range(32))
    data = encode_block(parent, [1, 2, 70000], (("lora", "abc"), ("mm", "img", -3)))
    decoded = msgpack.unpackb(data)
    assert decoded == [
        parent,
        (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (70000).to_bytes(4, "little"),
        [["lora", "abc"], ["mm", "img", -3]],
    ]
    assert hash_block(parent, [1, 2, 70000], (("lora", "abc"), ("mm", "img", -3))) == (
        hashlib.sha256(data).digest()
    )


def test_golden_hash_pins_the_format():
    # Changing the serialization silently would make every cached block unreachable after an
    # upgrade and, worse, make two versions disagree: this value must only change on purpose.
    h = hash_block(None, list(range(16)), (("salt", "tenant-1"),))
    assert h.hex() == GOLDEN_SHA256
    hx = hash_block(None, list(range(16)), (("salt", "tenant-1"),), algorithm="xxhash")
    assert hx.hex() == GOLDEN_XXHASH


GOLDEN_SHA256 = "e78956c6f4ba95e32d51960a89837c10f12253594b13e7961031add4f2fc0b8c"
GOLDEN_XXHASH = "49c5da799b8eb402c49489f43a3e5f6f"


def test_hashes_agree_across_processes():
    code = (
        "from hashing.block_hash import hash_block;"
        "print(hash_block(None, list(range(16)), (('lora', 'd'),)).hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hash_block(None, list(range(16)), (("lora", "d"),)).hex()


def test_every_input_changes_the_hash():
    base = hash_block(None, [1] * 16)
    assert hash_block(seed_hash(), [1] * 16) == base  # None means the seed
    assert hash_block(b"\x00" * 32, [1] * 16) != base
    assert hash_block(None, [1] * 15 + [2]) != base
    assert hash_block(None, [1] * 16, (("lora", "a"),)) != base
    lora_a = hash_block(None, [1] * 16, (("lora", "a"),))
    assert lora_a != hash_block(None, [1] * 16, (("lora", "b"),))
    assert hash_block(None, [1] * 16, algorithm="xxhash") != base


def test_tagged_keys_from_different_sources_never_collide():
    same_value = "x"
    keys = {hash_block(None, [0] * 4, ((tag, same_value),)) for tag in ("lora", "salt", "mm")}
    assert len(keys) == 3


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(ValueError, match="token ids"):
        hash_block(None, bad)
    hasher = RequestBlockHasher(4)
    with pytest.raises(ValueError):
        hasher.extend([1, 2] + bad)
    assert hasher.num_tokens == 0 and hasher.block_hashes == []


def test_unknown_algorithm_and_bad_extra_keys():
    with pytest.raises(ValueError, match="unknown prefix hash algorithm"):
        hash_block(None, [1], algorithm="md5")
    with pytest.raises(ValueError, match="extra keys"):
        hash_block(None, [1], (("lora", object()),))
    with pytest.raises(ValueError, match="block_size"):
        RequestBlockHasher(0)


def test_pack_token_ids_is_little_endian_uint32():
    assert pack_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


# ------------------------------------------------------------------------------ extra keys
def test_extra_keys_per_block():
    ph = validate_placeholders([MMPlaceholder("imgB", 20, 4), MMPlaceholder("imgA", 6, 12)])
    assert [p.image_key for p in ph] == ["imgA", "imgB"]
    kw = dict(lora_digest="D", cache_salt="S", placeholders=ph)
    # block 0 = [0, 8): imgA starts at 6 -> offset 6; salt only here
    assert block_extra_keys(0, 8, **kw) == (("lora", "D"), ("mm", "imgA", 6), ("salt", "S"))
    # block 1 = [8, 16): imgA continues (started 2 positions before the block)
    assert block_extra_keys(1, 8, **kw) == (("lora", "D"), ("mm", "imgA", -2))
    # block 2 = [16, 24): imgA ends at 18, imgB at 20
    assert block_extra_keys(2, 8, **kw) == (("lora", "D"), ("mm", "imgA", -10), ("mm", "imgB", 4))
    assert block_extra_keys(3, 8, **kw) == (("lora", "D"),)
    assert block_extra_keys(3, 8) == ()


def test_same_image_at_another_offset_gives_other_keys():
    a = RequestBlockHasher(8, placeholders=[MMPlaceholder("img", 2, 4)])
    b = RequestBlockHasher(8, placeholders=[MMPlaceholder("img", 3, 4)])
    tokens = [7] * 16
    a.extend(tokens)
    b.extend(tokens)
    assert a.block_hashes[0] != b.block_hashes[0]
    # The chain carries the difference into every later block.
    assert a.block_hashes[1] != b.block_hashes[1]


def test_placeholder_validation():
    with pytest.raises(ValueError, match="overlap"):
        validate_placeholders([MMPlaceholder("a", 0, 5), MMPlaceholder("b", 4, 2)])
    with pytest.raises(ValueError):
        MMPlaceholder("a", -1, 3)
    with pytest.raises(ValueError):
        MMPlaceholder("a", 0, 0)


# ------------------------------------------------------------------------ request hasher
def reference_hashes(tokens, block_size, algorithm="sha256", **kw):
    hasher = RequestBlockHasher(block_size, algorithm=algorithm, **kw)
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(
            parent, tokens[i * block_size : (i + 1) * block_size], hasher.extra_keys(i), algorithm
        )
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    cuts=st.lists(st.integers(1, 9), max_size=20),
    block_size=st.sampled_from([1, 3, 4, 16]),
    algorithm=st.sampled_from(["sha256", "xxhash"]),
    lora=st.sampled_from([None, "d1", "100%"]),
    salt=st.sampled_from([None, "tenant-a"]),
    image=st.sampled_from([None, (0, 5), (7, 20)]),
)
def test_incremental_equals_one_shot(tokens, cuts, block_size, algorithm, lora, salt, image):
    kw = dict(
        lora_digest=lora,
        cache_salt=salt,
        placeholders=[MMPlaceholder("img", *image)] if image else [],
    )
    hasher = RequestBlockHasher(block_size, algorithm=algorithm, **kw)
    pos, returned = 0, []
    for cut in cuts:
        returned += hasher.extend(tokens[pos : pos + cut])
        pos += cut
    returned += hasher.extend(tokens[pos:])
    expected = reference_hashes(tokens, block_size, algorithm, **kw)
    assert hasher.block_hashes == expected == returned
    assert hasher.num_tokens == len(tokens)


def test_only_full_blocks_are_hashed_and_fork_diverges():
    hasher = RequestBlockHasher(4, cache_salt="t")
    assert hasher.extend([1, 2, 3]) == []
    (h0,) = hasher.extend([4])
    child = hasher.fork()
    hasher.extend([5, 6, 7, 8])
    child.extend([5, 6, 7, 9])
    assert hasher.block_hashes[0] == child.block_hashes[0] == h0
    assert hasher.block_hashes[1] != child.block_hashes[1]


def test_stat_sources():
    h = RequestBlockHasher(
        4, lora_digest="d", cache_salt="s", placeholders=[MMPlaceholder("i", 0, 2)]
    )
    assert h.stat_sources() == (("lora", "d"), ("salt", "s"), ("mm", True))
    assert RequestBlockHasher(4).stat_sources() == ()
