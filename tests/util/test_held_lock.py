"""util/files.py held_lock: one holder at a time across processes, reentrant in the holder's thread, a line said
while waiting, and the block run unlocked where the file system refuses the lock."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from batchlab.util.files import held_lock

HOLD = """
import sys, time
from pathlib import Path
from batchlab.util.files import held_lock
with held_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_process_waits_and_says_so_and_the_holder_can_nest(tmp_path, capsys):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "1.0"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.perf_counter()
        with held_lock(path, "waiting for the other"):
            waited = time.perf_counter() - start
            with held_lock(path):  # nested in the same thread: already held, no deadlock
                pass
        assert waited > 0.3, waited  # entered only once the holder let go (it holds 1 s after "held")
        assert capsys.readouterr().err.strip() == "waiting for the other"
    finally:
        holder.kill()
        holder.wait()


def test_another_thread_waits_as_another_process_does(tmp_path):
    path, order = tmp_path / "x.lock", []

    def second():
        with held_lock(path):
            order.append("second")

    with held_lock(path):
        t = threading.Thread(target=second)
        t.start()
        t.join(timeout=0.5)
        order.append("first done")
    t.join(timeout=10)
    assert order == ["first done", "second"]


def test_a_file_system_that_refuses_the_lock_runs_the_block_unlocked(tmp_path, monkeypatch):
    import fcntl

    def refuse(*_):
        raise OSError(37, "No locks available")  # ENOLCK: some network file systems

    monkeypatch.setattr(fcntl, "flock", refuse)
    ran = []
    with held_lock(tmp_path / "x.lock"):
        ran.append(1)
    assert ran == [1]
