"""Breadcrumbs (engine/core/breadcrumb.py): what a process marked survives its SIGSEGV, slot by
slot; an empty or cleared slot names no one."""

import signal
import subprocess
import sys

from loraplex.engine.core import breadcrumb
from loraplex.engine.core.breadcrumb import COMPILE, STEP, Breadcrumb


def test_a_mark_survives_a_native_crash(tmp_path):
    path = breadcrumb.create(tmp_path / "crumb")
    script = (
        "import os, signal\n"
        "from loraplex.engine.core.breadcrumb import Breadcrumb, STEP, COMPILE\n"
        f"b = Breadcrumb({str(path)!r})\n"
        "b.set(COMPILE, 'req-compiled'); b.clear(COMPILE)\n"
        "b.set(STEP, 'req-\\u00e9-' + 'x' * 400)\n"  # cut to the slot, UTF-8
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == -signal.SIGSEGV
    (named,) = breadcrumb.read(path)
    assert named.startswith("req-\u00e9-x") and len(named.encode()) == breadcrumb.SLOT_BYTES - 4


def test_slots_are_independent_and_cleared(tmp_path):
    path = breadcrumb.create(tmp_path / "crumb")
    b = Breadcrumb(path)
    assert breadcrumb.read(path) == []
    with b.on(STEP, "a"):
        b.set(COMPILE, "b")
        assert breadcrumb.read(path) == ["a", "b"]
    assert breadcrumb.read(path) == ["b"]
    b.clear(COMPILE)
    assert breadcrumb.read(path) == []
    Breadcrumb(None).set(STEP, "nothing happens")  # in process: no file
    assert breadcrumb.read(tmp_path / "missing") == []
