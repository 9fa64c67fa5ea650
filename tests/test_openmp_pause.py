"""handlers.cpu.openmp_pause: a forward that followed another worker's on shared cores ends its OpenMP threads."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

from handlers.cpu import openmp_pause
from handlers.cpu.openmp_pause import OpenMPPause
from tests.test_core_share import LONG_TEXT
from tests.test_embeddings import EAGER_ONLY, make_engine

# In a process of its own, so that no other test's threads come and go while it counts: the process's threads after
# a parallel region on two threads (its second one left spinning), after the pause, and after the next region.
COUNT_THREADS = textwrap.dedent("""
    import os, time
    import torch
    from handlers.cpu.openmp_pause import OpenMPPause

    def threads():
        return len(os.listdir("/proc/self/task"))

    def after_pause(before):  # a thread ends a moment after it is told to
        deadline = time.monotonic() + 5
        while threads() >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    torch.set_num_threads(2)
    x = torch.arange(1 << 22, dtype=torch.float32)
    total = float((x + 1).sum())
    spinning = threads()
    pause = OpenMPPause()
    paused = pause()
    ended = after_pause(spinning)
    again = float((x + 1).sum())
    print(spinning, paused, ended, threads(), total == again)
""")


def test_a_pause_ends_the_openmp_threads_and_the_next_parallel_region_starts_new_ones():
    out = subprocess.run([sys.executable, "-c", COUNT_THREADS], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    spinning, paused, ended, again, same = out
    assert paused == "True" and int(ended) == int(spinning) - 1, out  # the parallel region's second thread ended
    assert int(again) == int(spinning) and same == "True", out


def test_without_libgomp_in_the_process_the_pause_does_nothing_and_says_why(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n")
    pause = OpenMPPause(maps)
    assert not pause.available and "no libgomp" in pause.why_not and pause() is False
    unreadable = OpenMPPause(tmp_path / "missing")
    assert not unreadable.available and "cannot read" in unreadable.why_not


def test_the_restart_is_measured_and_the_pause_used_only_below_its_bound():
    pause = OpenMPPause()
    pause.measure(2, trials=4, pays_below_ms=math.inf)
    assert pause.pays and pause.restart_ms is not None and pause.why_not is None
    pause.measure(2, trials=4, pays_below_ms=-math.inf)
    assert not pause.pays and pause.available
    assert pause.why_not == (f"restarting them after a pause cost a parallel region {pause.restart_ms:g} ms at "
                             "the 90th percentile here (measured at load; the pause pays below -inf ms)")
    one_thread = OpenMPPause()
    one_thread.measure(1, pays_below_ms=-math.inf)  # nothing to restart: nothing measured, nothing refused
    assert one_thread.restart_ms is None and one_thread.pays


def test_a_worker_alone_on_its_cores_keeps_its_openmp_threads_spinning(tiny_bert_dir, monkeypatch):
    """Its YAML asks for two workers, but only this one runs: the count it reads is not the count there is."""
    monkeypatch.setattr(openmp_pause, "RESTART_PAYS_MS", math.inf)  # the pause taken to pay, whatever this machine's
    engine = make_engine(tiny_bert_dir, {**EAGER_ONLY, "minWorkers": 2}, name="alone")
    engine.load()
    assert engine.predict([{"text": LONG_TEXT}])[0]["embedding"]  # after whichever worker's came last (a test's)
    paused = engine.cpu.openmp_pauses
    for text in (f"again {LONG_TEXT}", f"and again {LONG_TEXT}"):
        assert engine.predict([{"text": text}])[0]["embedding"]
    assert engine.cpu.openmp_pauses == paused
    assert f"({paused} so far)" in engine.describe()["optimization"]["threads"]["openmp_after_forward"]
