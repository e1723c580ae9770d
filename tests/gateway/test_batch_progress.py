"""A batch's progress file: every answer fsynced, whole lines from many threads, torn tails."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

from loraplex.gateway.domains.batches import progress
from loraplex.gateway.domains.batches.progress import ProgressLog, read_progress


def test_each_append_is_fsynced_and_the_new_file_s_directory_too(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(progress.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    path = tmp_path / "b.progress"
    log = ProgressLog(path)
    assert len(synced) == 1  # the directory entry of the new file
    for i in range(3):
        log.append(i, True, {"n": i})
        assert synced[-1] == log._handle.fileno() and len(synced) == 2 + i
    log.close()
    reopened = ProgressLog(path)  # an existing file: no directory fsync
    reopened.append(3, False, {"n": 3})
    reopened.close()
    assert len(synced) == 5
    assert read_progress(path) == {i: (i < 3, {"n": i}) for i in range(4)}


def test_appends_from_threads_are_whole_lines(tmp_path):
    path = tmp_path / "b.progress"
    log = ProgressLog(path, fsync=False)
    big = "x" * 70_000  # larger than a pipe buffer / one write() of the OS
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: log.append(i, i % 2 == 0, {"t": big, "i": i}), range(64)))
    log.close()
    done = read_progress(path)
    assert sorted(done) == list(range(64))
    assert all(rec["i"] == i and ok == (i % 2 == 0) for i, (ok, rec) in done.items())


def test_a_torn_last_line_is_ignored_and_ended(tmp_path):
    path = tmp_path / "b.progress"
    path.write_bytes(json.dumps({"index": 0, "ok": True, "record": {}}).encode() + b'\n{"ind')
    assert list(read_progress(path)) == [0]  # the cut request runs again
    log = ProgressLog(path)
    log.append(1, True, {})
    log.close()
    assert list(read_progress(path)) == [0, 1]


def test_bench_batch_progress_quick(tmp_path):
    from bench.batch_progress import main

    result = main(["--quick", "--dir", str(tmp_path)])
    assert result["lines"] == 200 and result["fsync"]["median_us"] > 0
    assert result["flush"]["median_us"] > 0 and not list(tmp_path.iterdir())
