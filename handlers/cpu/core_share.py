"""The cores one machine's workers share, decided afresh for each forward.

A forward's OpenMP threads wait at barriers for each other, so two workers that each run one on every core take
turns on the cores at every barrier. TorchServe's management API adds workers at run time, and each new worker sized
its threads from the model YAML's ``minWorkers`` as if it were alone: a second int8 worker added that way cut the
model from 157 to 52 req/s at 16 clients on 2 cores. So before each forward a worker asks here how many threads it may
run:

* a forward runs on every core when no other worker holds a batch, on ``cores // n`` threads while n workers do (one
  each on 2 cores);
* a forward proven at some thread counts only (a compiled one: the ladder proves it at every core and half of them)
  runs at the largest of them within its share;
* either waits while the threads of the forwards already running leave too few cores, rather than oversubscribe them;
* workers that held batches at once within the last ``REMEMBER_S`` keep their shares, even for a forward that finds
  no other batch: under steady load a sibling is often between two batches, and a forward that then took every core
  made the sibling's next forward wait for it. Requests one at a time never overlap, so they still get every core
  (but a small one after idleness on a virtual CPU: ``handlers.cpu.idle_cores``).

Each forward also learns whether the one before it on these cores was another worker's: workers that take requests
in turn end their OpenMP threads after a forward (``handlers.cpu.openmp_pause``), a worker alone keeps them spinning.
Workers on these cores also take turns loading (``handlers.cpu.load_turns``). They find each other through a small
lock file per set of cores in the temp directory (``handlers.cpu.slot_file``); docs/performance.md has the numbers.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from handlers.cpu.load_turns import LoadTurns, Turn
from handlers.cpu.slot_file import BATCH, FORWARD, LAYOUT, THREADS, SlotFile, State

__all__ = ["REMEMBER_S", "CoreShare", "Grant", "Turn", "for_cores"]

_WAIT_SECONDS = 0.0005  # between looks while the cores are taken: a forward takes milliseconds
REMEMBER_S = 0.1  # how long workers keep their shares after batches last overlapped: a batch cycle, with room


@dataclass(frozen=True)
class Grant:
    """What one forward may run on, how long it waited for it, and whether the forward before it on these cores was
    another worker's (workers that take requests in turn: the next one is likely another's too)."""

    threads: int
    waited_ms: float
    after_another: bool = False


class CoreShare:
    """This process's place among the workers sharing ``cores`` cores through the file at ``path``: the threads of
    each forward (``batch``, ``forward``), and the turn to load (``loading``, ``serves``; ``handlers.cpu.load_turns``).
    """

    def __init__(self, cores: int, path: Path, remember_s: float = REMEMBER_S):
        self.cores = cores
        self.path = path
        self.remember_s = remember_s
        self.slots = SlotFile(path)
        self.turns = LoadTurns(self.slots, cores)

    @property
    def slot(self) -> int | None:
        return self.slots.slot

    @property
    def joined(self) -> bool:
        """Whether this process found a free slot (else it runs as it would alone)."""
        return self.slots.slot is not None

    def batch(self) -> AbstractContextManager:
        """Held from a batch's arrival to its answers: the other workers size their forwards by how many do."""
        return self.slots.held(BATCH)

    @contextmanager
    def forward(self, runs_at: Collection[int] | None = None) -> Iterator[Grant]:
        """The threads one forward may run, held until it ends. ``runs_at``: the only thread counts the forward was
        proven at (it gets the largest within its share, else the smallest); None for one that runs at any count."""
        slots = self.slots
        if slots.slot is None:
            yield Grant(max(runs_at) if runs_at else self.cores, 0.0)
            return
        started = time.perf_counter()
        while True:
            with slots.mutex():
                state = slots.read_state()
                holding, running = self._others(state)
                threads = _within(max(1, self.cores // self._sharing(holding + 1, state)), runs_at)
                if running == 0 or running + threads <= self.cores:
                    slots.write_threads(threads)
                    slots.write_last_forward(state)
                    slots.take(FORWARD)
                    break
            time.sleep(_WAIT_SECONDS)
        try:
            yield Grant(threads, round((time.perf_counter() - started) * 1e3, 3),
                        after_another=state.last_forward not in (0, slots.slot + 1))
        finally:
            slots.give(FORWARD)

    def loading(self, model: str, wait_s: float) -> AbstractContextManager[Turn]:
        """Held while this process loads ``model`` (``LoadTurns.loading``)."""
        return self.turns.loading(model, wait_s)

    def serves(self) -> None:
        """Mark this process as serving (a model of it is READY) for the rest of its life: workers that load later
        on these cores leave its forwards the cores they do not load on."""
        self.slots.mark_serving()

    def _sharing(self, now_holding: int, state: State) -> int:
        """Workers to share the cores among: those holding a batch now (this one too), or as many as held batches at
        once within ``remember_s``. Called under the mutex, which also guards the record (``state``: read under it)."""
        now = time.monotonic()
        if now_holding > 1:
            self.slots.write_contended(now, now_holding)
            return now_holding
        when, workers = state.contended
        return max(1, workers) if 0 <= now - when <= self.remember_s else 1

    def _others(self, state: State) -> tuple[int, int]:
        """Other workers holding a batch, and the threads of the others' running forwards."""
        holding = running = 0
        for slot in self.slots.other_slots(state):
            holding += self.slots.holds(BATCH, slot)
            if self.slots.holds(FORWARD, slot):
                running += state.byte(slot, THREADS) or 1
        return holding, running


def _within(share: int, runs_at: Collection[int] | None) -> int:
    if not runs_at:
        return share
    fitting = [count for count in runs_at if count <= share]
    return max(fitting) if fitting else min(runs_at)


_SHARES: dict[tuple[int, Path], CoreShare] = {}
_SHARES_LOCK = threading.Lock()


def for_cores(cores: int, cpus: frozenset[int], directory: Path | None = None,
              remember_s: float = REMEMBER_S) -> CoreShare:
    """This process's share of the cores ``cpus`` (its CPU affinity), ``cores`` of them usable (the affinity capped
    by a CPU limit). Workers pinned to other cores use another file and never wait for each other."""
    name = hashlib.sha256(repr((sorted(cpus), cores, LAYOUT)).encode()).hexdigest()[:16]
    path = (directory or Path(tempfile.gettempdir())) / f"pt2-handlers-cores-{os.getuid()}-{name}"
    key = (os.getpid(), path)  # a forked child holds none of its parent's locks: it joins on its own
    with _SHARES_LOCK:
        if key not in _SHARES:
            _SHARES[key] = CoreShare(cores, path, remember_s)
        return _SHARES[key]
