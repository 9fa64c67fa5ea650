"""handlers.cpu.core_share: workers on one machine share its cores forward by forward. The other workers are real
processes (each holds its own POSIX locks), driven line by line over stdin/stdout."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from handlers.cpu import core_share, idle_cores, load_turns, openmp_pause, slot_file
from tests.test_embeddings import make_engine

CPUS = frozenset({0, 1})
# A forward of more tokens than a small one: where the cores are virtual, a small one after idleness runs on one
# thread (handlers.cpu.idle_cores, tests/test_idle_cores.py), whatever its share.
LONG_TEXT = " ".join(["alone"] * (idle_cores.SMALL_TOKENS + 1))

SIBLING = textwrap.dedent("""
    import sys
    from contextlib import ExitStack
    from pathlib import Path
    from handlers.cpu import core_share
    share = core_share.CoreShare(int(sys.argv[1]), Path(sys.argv[2]))
    batches, forwards, loads = ExitStack(), ExitStack(), ExitStack()
    print("joined", share.slot, flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "batch":
            batches.enter_context(share.batch())
        elif command == "forward":
            grant = forwards.enter_context(share.forward({int(args[0])} if args else None))
            print("granted", grant.threads, flush=True)
            continue
        elif command == "load":  # a model's load, held until "loaded"
            turn = loads.enter_context(share.loading(args[0], 0))
            print("turn", turn.alone, "threads", turn.threads, flush=True)
            continue
        elif command == "serves":
            share.serves()
        elif command == "loaded":
            loads.close()
        elif command == "end":  # the forwards, not the batch
            forwards.close()
        elif command == "release":
            forwards.close()
            batches.close()
        print("ok", flush=True)
""")


class Sibling:
    """Another worker: a process of its own in the same share."""

    def __init__(self, cores: int, path: Path):
        self.process = subprocess.Popen([sys.executable, "-c", SIBLING, str(cores), str(path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=Path(__file__).resolve().parents[1])
        assert self.read().startswith("joined ")

    def read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, f"the sibling exited ({self.process.wait()})"
        return line

    def send(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def later(self, seconds: float, *commands: str) -> threading.Thread:
        """Send these commands after a while, from another thread (their answers are left to read)."""
        def send() -> None:
            time.sleep(seconds)
            assert self.process.stdin is not None
            self.process.stdin.write("".join(command + "\n" for command in commands))
            self.process.stdin.flush()
        thread = threading.Thread(target=send)
        thread.start()
        return thread

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def siblings(tmp_path):
    started: list[Sibling] = []

    def start(cores: int = 2, path: Path | None = None) -> Sibling:
        started.append(Sibling(cores, path or share(tmp_path, cores).path))
        return started[-1]

    yield start
    for sibling in started:
        sibling.close()


def share(tmp_path: Path, cores: int = 2, remember_s: float = core_share.REMEMBER_S) -> core_share.CoreShare:
    return core_share.for_cores(cores, CPUS, tmp_path, remember_s)


def test_a_forward_alone_runs_on_every_core(tmp_path):
    mine = share(tmp_path, 4)
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 4


def test_while_another_worker_holds_a_batch_each_forward_takes_an_equal_share(tmp_path, siblings):
    mine, other = share(tmp_path, 4, remember_s=0.0), siblings(4)  # the overlap forgotten at once (next test)
    assert other.send("batch") == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 2
    third = siblings(4)
    assert third.send("batch") == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 1  # 4 // 3
    assert other.send("release") == third.send("release") == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 4


def test_workers_whose_batches_overlapped_keep_their_shares_for_a_while(tmp_path, siblings):
    """Under steady load a sibling is often between two batches: a forward that then took every core would make the
    sibling's next forward wait for it. Workers one at a time never overlap, and keep every core."""
    mine, other = share(tmp_path, remember_s=1.0), siblings()
    assert other.send("batch") == "ok" and other.send("forward") == "granted 2" and other.send("release") == "ok"
    with mine.batch(), mine.forward() as grant:  # one after the other: no overlap
        assert grant.threads == 2
    assert other.send("batch") == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 1
    assert other.send("release") == "ok"
    with mine.batch(), mine.forward() as grant:  # the sibling between two batches
        assert grant.threads == 1
    assert other.send("forward") == "granted 1"  # and the sibling remembers it too, with no batch held now
    assert other.send("release") == "ok"
    time.sleep(1.1)
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 2


def test_the_other_worker_sees_this_ones_batch_and_forward(tmp_path, siblings):
    mine, other = share(tmp_path), siblings()
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 2
    with mine.batch():
        assert other.send("forward") == "granted 1"


def test_a_forward_knows_whether_the_one_before_it_on_these_cores_was_another_workers(tmp_path, siblings):
    mine, other = share(tmp_path), siblings()
    for _ in range(2):  # the first on these cores, then after its own
        with mine.batch(), mine.forward() as grant:
            assert not grant.after_another
    assert other.send("forward") == "granted 2" and other.send("end") == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.after_another
    with mine.batch(), mine.forward() as grant:
        assert not grant.after_another


def test_a_forward_waits_for_the_cores_a_running_forward_holds(tmp_path, siblings):
    """A sibling's forward on both cores (it was alone when it began): this one waits for it rather than put a third
    thread on two cores, then takes its share while the sibling still holds its batch."""
    mine, other = share(tmp_path), siblings()
    assert other.send("batch") == "ok" and other.send("forward") == "granted 2"
    later = other.later(0.3, "end")
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 1 and grant.waited_ms >= 250, grant
    later.join()
    assert other.read() == "ok"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 1 and grant.waited_ms < 250, grant


def test_a_forward_built_for_its_thread_count_runs_at_it_once_the_cores_are_free(tmp_path, siblings):
    """int8's oneDNN weights are packed for the threads that packed them: such a forward never takes a share; it
    waits until its count fits beside the forwards already running."""
    mine, other = share(tmp_path), siblings()
    assert other.send("batch") == "ok" and other.send("forward 1") == "granted 1"
    later = other.later(0.3, "release")
    with mine.batch(), mine.forward(runs_at={2}) as grant:
        assert grant.threads == 2 and grant.waited_ms >= 250, grant
    later.join()
    assert other.read() == "ok"
    assert other.send("batch") == "ok" and other.send("forward 1") == "granted 1"
    with mine.forward(runs_at={1}) as grant, mine.forward(runs_at={1}) as nested:  # 1 + 1 fits: no wait
        assert grant.threads == nested.threads == 1 and grant.waited_ms < 250, grant


def test_a_forward_built_for_several_counts_takes_the_largest_within_its_share(tmp_path, siblings):
    mine, other = share(tmp_path, 8), siblings(8)
    with mine.batch(), mine.forward(runs_at={8, 4, 1}) as grant:
        assert grant.threads == 8
    assert other.send("batch") == "ok"
    with mine.batch(), mine.forward(runs_at={8, 4, 1}) as grant:
        assert grant.threads == 4
    third = siblings(8)
    assert third.send("batch") == "ok"
    with mine.batch(), mine.forward(runs_at={8, 4, 1}) as grant:  # a share of 2: the largest count within it
        assert grant.threads == 1
    with mine.batch(), mine.forward(runs_at={8, 4}) as grant:  # none within it: the smallest
        assert grant.threads == 4


def test_a_killed_worker_keeps_no_cores(tmp_path, siblings):
    mine, other = share(tmp_path), siblings()
    assert other.send("batch") == "ok" and other.send("forward 2") == "granted 2"
    other.close()
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 2 and grant.waited_ms < 100, grant


def test_a_forward_asks_only_about_the_slots_workers_have_claimed(tmp_path, siblings, monkeypatch):
    """Each byte asked about is a lock and an unlock, twice per forward: a worker alone asked about 15 empty slots
    (0.12 ms of a lone request on a Zen 4 EPYC). It asks about the slots ever claimed: the live sibling's three bytes,
    the killed one's owner byte, whose mark outlives it."""
    mine, killed, live = share(tmp_path), siblings(), siblings()
    killed.close()
    asked: list[int] = []
    is_locked = slot_file.SlotFile.is_locked
    monkeypatch.setattr(slot_file.SlotFile, "is_locked", lambda self, offset: asked.append(offset) or
                        is_locked(self, offset))
    assert live.send("batch") == "ok" and live.send("forward 1") == "granted 1"
    with mine.batch(), mine.forward() as grant:
        assert grant.threads == 1
    slots = {(offset - slot_file.FIRST_SLOT) // slot_file.SLOT_BYTES for offset in asked}
    assert slots == {1, 2} and len(asked) == 4, asked  # killed: slot 1, owner only; live: slot 2, owner, batch, forward


def test_workers_on_these_cores_load_in_turn_whatever_their_model(tmp_path, siblings):
    """Another worker loading, this model or another: this one waits for its load to end, or gives up waiting at the
    bound and loads beside it, and names the models it waited for. Another engine of this process never holds it
    up."""
    mine, other = share(tmp_path), siblings()
    assert other.send("load minilm") == "turn True threads 2"
    with mine.loading("minilm-int8", 0.5) as turn:
        assert not turn.alone and 0.5 <= turn.waited_s < 2 and turn.waited_for == ("minilm",), turn
    releases = other.later(1.0, "loaded")
    with mine.loading("minilm-int8", 60) as turn:
        assert turn.alone and 0.7 <= turn.waited_s < 10 and turn.waited_for == ("minilm",), turn
        releases.join()
        assert other.read() == "ok"
        with mine.loading("minilm", 0) as nested:  # a second engine of this process
            assert nested == core_share.Turn(0.0, True, 2)
        assert other.send("load minilm") == "turn False threads 2"  # still this process's turn after the nested load
        assert other.send("loaded") == "ok"
    assert other.send("load minilm") == "turn True threads 2"
    other.close()  # a killed worker keeps no turn
    with mine.loading("minilm", 60) as turn:
        assert turn == core_share.Turn(0.0, True, 2)


def test_a_load_names_its_model_only_while_it_holds_the_turn(tmp_path, siblings):
    """The name a waiting worker reports: the holder's, cut to fit (a long name still reads as this model's), and
    none once its load ends or its process dies."""
    mine, other = share(tmp_path), siblings()
    long_name = "m" * 200
    assert other.send(f"load {long_name}") == "turn True threads 2"
    with mine.loading(long_name, 0.3) as turn:
        assert not turn.alone and turn.waited_for == (long_name,), turn
    assert other.send("loaded") == "ok" and mine.turns.loader() == ""
    assert other.send("load minilm") == "turn True threads 2"
    assert mine.turns.loader() == "minilm"
    other.close()
    with mine.loading("minilm-int8", 0) as turn:
        assert turn == core_share.Turn(0.0, True, 2)
        assert mine.turns.loader() == "minilm-int8"
    assert mine.turns.loader() == ""


def test_a_worker_loading_beside_serving_workers_leaves_their_forwards_the_rest_of_the_cores(tmp_path, siblings):
    """A scale-up or a restart beside a worker that serves: the load holds a batch, so the serving worker's forwards
    take their share, and loads on its own share where that worker is busy (on every core beside an idle one). A
    sibling that only waits to load serves nothing."""
    mine, other = share(tmp_path), siblings()
    with mine.loading("minilm", 0) as turn:  # the other is there but serves nothing yet
        assert turn == core_share.Turn(0.0, True, 2)
        assert other.send("batch") == "ok" and other.send("forward") == "granted 2"  # the load holds no batch
        assert other.send("release") == "ok"
    assert other.send("serves") == "ok"
    started = time.monotonic()
    with mine.loading("minilm", 0) as turn:  # beside an idle one: every core, after looking for its batches
        assert turn == core_share.Turn(0.0, True, 2, serving=1)
        assert load_turns.BUSY_LOOK_S <= time.monotonic() - started < 5
        assert other.send("batch") == "ok" and other.send("forward") == "granted 1"  # its share, beside the load
        assert other.send("release") == "ok"
    assert other.send("batch") == "ok"
    with mine.loading("minilm", 0) as turn:  # beside a busy one: a share
        assert turn == core_share.Turn(0.0, True, 1, serving=1)
        assert other.send("forward") == "granted 1"
        assert other.send("release") == "ok"
        assert other.send("forward 2") == "granted 2"  # proven at 2 only: runs at it, never waits for the load
        assert other.send("end") == "ok"
    time.sleep(mine.remember_s)
    assert other.send("batch") == "ok" and other.send("forward") == "granted 2"  # READY: the cores are the other's
    assert other.send("release") == "ok"
    mine.serves()
    assert other.send("load minilm") == "turn True threads 2"  # this one serves now, idle
    assert other.send("loaded") == "ok"


def test_an_engine_loads_after_another_worker_on_its_cores(tiny_bert_dir, siblings):
    engine = make_engine(tiny_bert_dir, name="turns")
    assert engine.cpu.share is not None
    other = siblings(engine.cpu.share.cores, engine.cpu.share.path)
    assert other.send("load other-model").startswith("turn True threads ")  # fewer if an engine of this process served
    releases = other.later(1.0, "loaded")
    engine.load()
    releases.join()
    assert other.read() == "ok"
    described = engine.describe()
    assert 0.7 <= described["load_waited_s"] <= engine.load_seconds, (described, engine.load_seconds)
    assert described["load_waited_for"] == ["other-model"]


def test_an_engine_loads_on_its_share_beside_a_serving_worker_and_then_serves(tiny_bert_dir, siblings):
    engine = make_engine(tiny_bert_dir, name="beside")
    cores = engine.cpu.share
    assert cores is not None and cores.joined
    other = siblings(cores.cores, cores.path)
    assert other.send("serves") == "ok" and other.send("batch") == "ok"  # a worker busy serving
    from torch._inductor import config as inductor_config
    compile_processes = inductor_config.compile_threads
    engine.load()
    assert inductor_config.compile_threads == compile_processes  # in as many processes as threads, while it loaded
    threads = engine.describe()["optimization"]["threads"]
    assert threads["intra_op"] == cores.cores and threads["at_load"] == max(1, cores.cores // 2), threads
    assert other.send("release") == "ok"
    time.sleep(cores.remember_s)
    assert engine.predict([{"text": f"READY: the load's share is given back {LONG_TEXT}"}])[0]["embedding"]
    assert engine.last_batch.threads == cores.cores
    assert other.send("batch") == "ok"  # and this process serves now
    assert other.send("load beside") == f"turn True threads {cores.cores}"  # ... with no batch of its own


def test_one_share_per_process_and_file(tmp_path):
    assert share(tmp_path) is share(tmp_path)
    assert core_share.for_cores(2, frozenset({2, 3}), tmp_path).path != share(tmp_path).path


def test_an_engine_takes_its_share_of_the_cores_while_another_worker_holds_a_batch(tiny_bert_dir, siblings):
    engine = make_engine(tiny_bert_dir)  # threads: auto
    engine.load()
    cores = engine.cpu.share
    assert cores is not None and cores.joined
    assert engine.predict([{"text": LONG_TEXT}])[0]["embedding"]
    assert engine.last_batch.threads == cores.cores
    other = siblings(cores.cores, cores.path)
    assert other.send("batch") == "ok"
    assert engine.predict([{"text": f"beside another worker's batch {LONG_TEXT}"}])[0]["embedding"]
    assert engine.last_batch.threads == max(1, cores.cores // 2)
    assert "cores" in engine.last_batch.milliseconds
    threads = engine.describe()["optimization"]["threads"]
    assert threads["per_forward"].startswith(f"shared with the other workers on these {cores.cores} cores"), threads


def test_a_forward_that_followed_another_workers_ends_its_openmp_threads(tiny_bert_dir, siblings, monkeypatch):
    """handlers.cpu.openmp_pause, whichever way the other worker came (minWorkers, a scale-up, another model): this
    engine's YAML has one worker. The restart's cost measured at load is taken to pay, whatever this machine's."""
    monkeypatch.setattr(openmp_pause, "RESTART_PAYS_MS", math.inf)
    engine = make_engine(tiny_bert_dir, name="in-turn")  # threads: auto
    engine.load()
    assert engine.cpu.openmp_pause is not None and engine.cpu.openmp_pause.restart_ms is not None
    cores = engine.cpu.share
    assert cores is not None and engine.cpu.openmp_pause is not None and engine.cpu.openmp_pause.available
    assert engine.predict([{"text": LONG_TEXT}])[0]["embedding"]  # after whichever worker's came last (a test's)
    paused = engine.cpu.openmp_pauses
    assert engine.predict([{"text": f"after its own forward {LONG_TEXT}"}])[0]["embedding"]
    assert engine.cpu.openmp_pauses == paused  # alone, its threads spin
    other = siblings(cores.cores, cores.path)
    assert other.send("batch") == "ok" and other.send("forward").startswith("granted ")
    assert other.send("release") == "ok"
    time.sleep(cores.remember_s)  # not overlapping: this forward runs on every core
    assert engine.predict([{"text": f"after the sibling's forward {LONG_TEXT}"}])[0]["embedding"]
    assert engine.last_batch.threads == cores.cores > 1
    assert engine.cpu.openmp_pauses == paused + 1
    assert engine.predict([{"text": f"after its own forward again {LONG_TEXT}"}])[0]["embedding"]
    assert engine.cpu.openmp_pauses == paused + 1
    said = engine.describe()["optimization"]["threads"]["openmp_after_forward"]
    assert said.startswith("threads ended after a forward on more than one that followed another worker's"), said
    assert f"({paused + 1} so far)" in said


def test_where_restarting_openmps_threads_costs_too_much_they_are_left_to_spin(tiny_bert_dir, siblings, monkeypatch):
    monkeypatch.setattr(openmp_pause, "RESTART_PAYS_MS", -math.inf)  # whatever this machine measures: too much
    engine = make_engine(tiny_bert_dir, name="spins")
    engine.load()
    cores = engine.cpu.share
    assert cores is not None and engine.cpu.openmp_pause is not None and not engine.cpu.openmp_pause.pays
    other = siblings(cores.cores, cores.path)
    assert other.send("forward").startswith("granted ") and other.send("end") == "ok"
    time.sleep(cores.remember_s)
    assert engine.predict([{"text": f"after the sibling's forward {LONG_TEXT}"}])[0]["embedding"]
    assert engine.last_batch.threads == cores.cores and engine.cpu.openmp_pauses == 0
    said = engine.describe()["optimization"]["threads"]["openmp_after_forward"]
    assert said.startswith("threads left to spin: restarting them after a pause cost a parallel region "), said
    assert said.endswith("(measured at load; the pause pays below -inf ms)"), said


def test_threads_configured_are_the_threads_every_forward_runs(tiny_bert_dir):
    before = torch.get_num_threads()
    try:
        engine = make_engine(tiny_bert_dir, {"pt2_handlers": {"ladder": ["eager"], "dtype": "float32", "threads": 1}})
        engine.load()
        assert engine.cpu.share is None and "per_forward" not in engine.describe()["optimization"]["threads"]
        engine.predict([{"text": "one thread"}])
        assert engine.last_batch.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
