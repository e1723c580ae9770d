"""The usage spool on disk: records read back after a crash, torn and corrupt records skipped,
live writers never adopted, segments deleted only once written, private file modes."""

import os
import zlib
from datetime import UTC, datetime

import msgspec

from loraplex.gateway.usage.records import UsageRecord
from loraplex.gateway.usage.spool import UsageSpool, decode_line, encode_record, read_segment

WHEN = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def record(i, **fields):
    return UsageRecord(
        request_id=f"chatcmpl-{i}",
        tenant_id="t" * 32,
        model="tiny",
        key_id="k" * 32,
        prompt_tokens=i,
        completion_tokens=2 * i,
        created_at=WHEN,
        client_request_id=f"client-{i}",
        **fields,
    )


def append(spool, records, first_seq):
    spool.append(b"".join(encode_record(r) for r in records), first_seq + len(records) - 1)


def crash(spool):
    """What a SIGKILL leaves: files as they are, the lock released by the kernel."""
    if spool._current is not None and spool._current.fd is not None:
        os.close(spool._current.fd)
    os.close(spool._lock_fd)


def test_records_come_back_in_order_after_a_crash(tmp_path):
    first = UsageSpool(tmp_path, segment_bytes=600)  # a few records per segment
    assert first.open() == []
    written = [record(i) for i in range(10)]
    for i in range(0, 10, 2):
        append(first, written[i : i + 2], i + 1)
    assert len(list(tmp_path.glob("*.spool"))) > 1  # rotated
    crash(first)

    second = UsageSpool(tmp_path)
    assert second.open() == written  # every field, created_at included
    assert second.torn == 0
    assert all(p.name.startswith(second.writer_id) for p in tmp_path.glob("*.spool"))


def test_a_torn_last_record_is_skipped_and_never_appended_to(tmp_path):
    first = UsageSpool(tmp_path)
    first.open()
    append(first, [record(0), record(1)], 1)
    (segment,) = tmp_path.glob("*.spool")
    torn = encode_record(record(2))[:-7]  # SIGKILL in the middle of the write
    with open(segment, "ab") as f:
        f.write(torn)
    crash(first)

    second = UsageSpool(tmp_path)
    assert [r.request_id for r in second.open()] == ["chatcmpl-0", "chatcmpl-1"]
    assert second.torn == 1
    append(second, [record(3)], 3)  # a new segment: never after the torn bytes
    crash(second)
    third = UsageSpool(tmp_path)
    assert [r.request_id for r in third.open()] == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-3"]
    assert third.torn == 1


def test_a_corrupt_record_is_skipped_and_the_others_kept(tmp_path):
    spool = UsageSpool(tmp_path)
    spool.open()
    append(spool, [record(i) for i in range(3)], 1)
    crash(spool)
    (segment,) = tmp_path.glob("*.spool")
    data = bytearray(segment.read_bytes())
    middle = data.index(b"chatcmpl-1")
    data[middle + 9] ^= 0x01  # one bit flipped: the checksum no longer matches
    segment.write_bytes(bytes(data))
    assert [r.request_id for r in read_segment(segment)[0]] == ["chatcmpl-0", "chatcmpl-2"]
    assert read_segment(segment)[1] == 1


def test_decode_refuses_what_is_not_a_whole_valid_record():
    line = encode_record(record(1))[:-1]
    assert decode_line(line) == record(1)
    payload = msgspec.json.encode({"request_id": "r"})  # a good checksum, not a record
    assert decode_line(b"%08x %s" % (zlib.crc32(payload), payload)) is None
    bad_status = msgspec.json.encode(record(1)).replace(b'"ok"', b'"weird"')
    assert decode_line(b"%08x %s" % (zlib.crc32(bad_status), bad_status)) is None
    assert decode_line(b"") is None and decode_line(b"zzzzzzzz {}") is None


def test_a_live_writers_segments_are_never_adopted(tmp_path):
    alive = UsageSpool(tmp_path)
    alive.open()
    append(alive, [record(0)], 1)
    other = UsageSpool(tmp_path)
    assert other.open() == []  # the lock is held
    append(other, [record(1)], 1)
    crash(alive)
    third = UsageSpool(tmp_path)
    assert [r.request_id for r in third.open()] == ["chatcmpl-0"]  # only the dead one's


def test_segments_go_only_once_written(tmp_path):
    spool = UsageSpool(tmp_path, segment_bytes=1)  # a segment per append
    spool.open()
    for i in range(3):
        append(spool, [record(i)], i + 1)
    assert len(list(tmp_path.glob("*.spool"))) == 3
    assert not spool.releasable(0)
    assert spool.release(1) == 1  # the current (third) segment is never released here
    assert spool.release(3) == 1
    assert len(list(tmp_path.glob("*.spool"))) == 1
    assert spool.close(2) == 1  # one record left for the next start
    assert [r.request_id for r in UsageSpool(tmp_path).open()] == ["chatcmpl-2"]


def test_close_compacts_to_the_unwritten_records(tmp_path):
    spool = UsageSpool(tmp_path, segment_bytes=600)
    spool.open()
    for i in range(0, 8, 2):
        append(spool, [record(i), record(i + 1)], i + 1)
    assert len(list(tmp_path.glob("*.spool"))) > 1
    # records 1..5 are in the database; 6..8 are not
    assert spool.close(5, [encode_record(record(i)) for i in range(5, 8)]) == 3
    (segment,) = tmp_path.glob("*.spool")
    assert [r.request_id for r in read_segment(segment)[0]] == [f"chatcmpl-{i}" for i in (5, 6, 7)]
    assert [p.name for p in tmp_path.iterdir()] == [segment.name]  # no lock, no tmp left


def test_a_retired_segment_stays_open_for_its_syncs_in_flight(tmp_path):
    """Syncs run in threads, several at once: rotating must not close an fd being synced."""
    spool = UsageSpool(tmp_path, segment_bytes=1)  # every write after the first rotates
    spool.open()
    first = spool.write(encode_record(record(0)), 1)
    second = spool.write(encode_record(record(1)), 2)  # rotates: first is retired
    third = spool.write(encode_record(record(2)), 3)
    assert first is not second and first.retired and first.fd is not None
    spool.sync(second)
    spool.sync(first)  # its fd was kept for this sync, then closed
    assert first.fd is None and second.fd is None and third.fd is not None
    spool.sync(third)
    crash(spool)
    back = UsageSpool(tmp_path).open()
    assert [r.request_id for r in back] == [f"chatcmpl-{i}" for i in range(3)]


def test_files_are_private(tmp_path):
    directory = tmp_path / "spool"
    spool = UsageSpool(directory)
    spool.open()
    append(spool, [record(0)], 1)
    assert directory.stat().st_mode & 0o777 == 0o700
    for path in directory.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert spool.close(1) == 0
    assert list(directory.iterdir()) == []
