"""The cores one machine's workers share, decided afresh for each forward.

A forward's OpenMP threads wait at barriers for each other, so two workers that each run one on every core take
turns on the cores at every barrier. TorchServe's management API adds workers at run time, and each new worker sized
its threads from the model YAML's ``minWorkers`` as if it were alone: measured on 2 cores (CPU D), a second int8
worker added that way cut the model from 157 to 52 req/s at 16 clients, p99 945 ms. So before each forward a worker
asks here how many threads it may run:

* a forward runs on every core when no other worker holds a batch, on ``cores // n`` threads while n workers do (one
  each on 2 cores);
* a forward proven at some thread counts only (a compiled one: the ladder proves it at every core and half of them)
  runs at the largest of them within its share;
* either waits while the threads of the forwards already running leave too few cores, rather than oversubscribe them;
* workers that held batches at once within the last ``REMEMBER_S`` keep their shares, even for a forward that finds
  no other batch: under steady load a sibling is often between two batches, and a forward that then took every core
  made the sibling's next forward wait for it (measured on CPU D, two int8 workers at 16 clients: 156 req/s
  forward by forward, 170 with one thread each). Requests one at a time never overlap, so they still get every core
  (but a small one after idleness on a virtual CPU: ``handlers.cpu.idle_cores``).

Each forward also learns whether the one before it on these cores was another worker's: workers that take requests
in turn end their OpenMP threads after a forward (``handlers.cpu.openmp_pause``), a worker alone keeps them spinning.

Workers on these cores also take turns loading, whatever model they load (``loading``): started together (a
model's ``minWorkers: 2``, or several models at server start), each measured its rungs, races and costs while the
others compiled on the cores it needed, and none served until all were done. CPU D, cold: the int8 archive with
``minWorkers: 2``, READY after 108 and 110 s loading together, after 80 and 98 s in turn (the second loads from what
the first kept: its compile cache and measurements). CPU A (an AMD EPYC), cold: the default and the int8 archive
started together, READY after 116 and 185 s loading together, after 44 and 147 s in turn.

A worker that loads while other workers on these cores serve (a scale-up, a restart, another model registered) holds
a batch until it is READY, so the serving workers' forwards take their share of the cores, and where they are busy
it loads on its share of them. Loading on every core beside a busy worker (CPU D, the int8 archive scaled 1 -> 2
under 4 clients), the clients got 27 req/s instead of 174, p99 0.9 s, for the 47 s of the load; on its share, 101
req/s, p99 0.13 s. Beside idle workers it loads on every core (a scale-up with no clients: READY after 21 s, 38 s on
its share).

Workers find each other through byte-range locks (``fcntl.lockf``) on one small file per set of cores in the temp
directory. A lock dies with its process, so a killed worker never keeps cores. POSIX locks belong to a process, so a
process has one ``CoreShare`` per file (``for_cores``), whatever number of engines it runs.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SLOTS = 16  # workers that can take part on one set of cores; a 17th runs on its own, as before this module
_MUTEX = 0  # held while one worker reads the others and takes its threads
_CONTENDED = 8  # written: when workers last held batches at once (time.monotonic, one clock per machine), and how many
_CONTENDED_FORMAT = struct.Struct("<dB")
_LAST_FORWARD = 20  # written: 1 + the slot of the worker whose forward began last (0: none yet)
_FIRST_SLOT = 24
_SLOT_BYTES = 5  # per slot, at these offsets:
_OWNED = 0  # locked for the life of the process in the slot; written _CLAIMED once a process has claimed it
_BATCH = 1  # locked while it holds a batch
_FORWARD = 2  # locked while it runs a forward
_THREADS = 3  # written: the threads of that forward
_SERVING = 4  # locked for the rest of the process's life once it serves (a model READY)
_WAIT_SECONDS = 0.0005  # between looks while the cores are taken: a forward takes milliseconds
REMEMBER_S = 0.1  # how long workers keep their shares after batches last overlapped: a batch cycle, with room
_LOAD = 4096  # past the slots: locked while a worker loads a model
_LOADER = _LOAD + 1  # written by the worker holding the load: the model it loads (for the log of one that waits)
_LOADER_BYTES = 128
_LOAD_LOOK_SECONDS = 0.25  # between looks while a sibling loads: a load takes seconds
_BUSY_LOOK_S = 0.25  # how long a worker that loads beside serving ones looks for their batches (a busy one has
# one every few ms; a quarter second of a load of tens, paid beside idle ones only)
_BUSY_LOOK_EVERY_S = 0.005
_STATE_BYTES = _FIRST_SLOT + SLOTS * _SLOT_BYTES - _CONTENDED  # read at once per forward: the record, then the slots
_CLAIMED = b"\x01"  # a slot never claimed reads 0: the others skip its locks (3 syscalls each, per forward)
_LAYOUT = 5  # in the file's name: a worker of an earlier release, on the old layout, never reads this one


@dataclass(frozen=True)
class Turn:
    """A worker's turn to load: how long it waited for other workers' loads on these cores, whether it had them end
    (False: it gave up waiting and loads beside one), how many other workers on these cores serve (READY), the
    threads it may load on (every core, or its share of them where those had batches just now), and the models whose
    loads it waited for."""

    waited_s: float
    alone: bool
    threads: int
    serving: int = 0
    waited_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grant:
    """What one forward may run on, how long it waited for it, and whether the forward before it on these cores was
    another worker's (workers that take requests in turn: the next one is likely another's too)."""

    threads: int
    waited_ms: float
    after_another: bool = False


class CoreShare:
    """This process's place among the workers sharing ``cores`` cores through the file at ``path``."""

    def __init__(self, cores: int, path: Path, remember_s: float = REMEMBER_S):
        self.cores = cores
        self.path = path
        self.remember_s = remember_s
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = _LOADER + _LOADER_BYTES
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)  # each worker writes only its own slot's byte
        self.slot = self._claim_slot()
        self._lock = threading.Lock()
        self._depth = {_BATCH: 0, _FORWARD: 0}  # nested holds of this slot's bytes, within this process
        self._loads = 0  # engines of this process that hold the load turn
        self._threads_written: int | None = None  # the threads byte of this slot as last written

    @property
    def joined(self) -> bool:
        """Whether this process found a free slot (else it runs as it would alone)."""
        return self.slot is not None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Held from a batch's arrival to its answers: the other workers size their forwards by how many do."""
        with self._held(_BATCH):
            yield

    @contextmanager
    def forward(self, runs_at: Collection[int] | None = None) -> Iterator[Grant]:
        """The threads one forward may run, held until it ends. ``runs_at``: the only thread counts the forward was
        proven at (it gets the largest within its share, else the smallest); None for one that runs at any count."""
        if self.slot is None:
            yield Grant(max(runs_at) if runs_at else self.cores, 0.0)
            return
        started = time.perf_counter()
        while True:
            with self._mutex():
                state = self._read_state()
                holding, running = self._others(state)
                threads = _within(max(1, self.cores // self._sharing(holding + 1, state)), runs_at)
                if running == 0 or running + threads <= self.cores:
                    if threads != self._threads_written:  # only this process writes its slot's byte
                        os.pwrite(self._fd, bytes([min(threads, 255)]), self._offset(_THREADS))
                        self._threads_written = threads
                    last = state[_LAST_FORWARD - _CONTENDED]
                    if last != self.slot + 1:  # a lone worker writes it once
                        os.pwrite(self._fd, bytes([self.slot + 1]), _LAST_FORWARD)
                    self._take(_FORWARD)
                    break
            time.sleep(_WAIT_SECONDS)
        try:
            yield Grant(threads, round((time.perf_counter() - started) * 1e3, 3),
                        after_another=last not in (0, self.slot + 1))
        finally:
            self._give(_FORWARD)

    @contextmanager
    def loading(self, model: str, wait_s: float) -> Iterator[Turn]:
        """Held while this process loads ``model``: another worker that loads on these cores, of any model, loads
        after, or, past ``wait_s`` of waiting, beside it. Engines of one process never wait for each other (the locks
        are the process's). The turn says the threads to load on: a share of the cores beside busy serving
        workers."""
        started = time.monotonic()
        waited_for: list[str] = []
        held = self._take_load(model)
        while not held and time.monotonic() - started < wait_s:
            loader = self._loader()
            if loader == _as_written(model):  # cut as written: a long name is this model's still
                loader = model
            if loader and loader not in waited_for:
                waited_for.append(loader)
            time.sleep(_LOAD_LOOK_SECONDS)
            held = self._take_load(model)
        waited_s = round(time.monotonic() - started, 1)
        try:
            with self._share_while_others_serve() as (threads, serving):
                yield Turn(waited_s, held, threads, serving, tuple(waited_for))
        finally:
            if held:
                self._give_load()

    def serves(self) -> None:
        """Mark this process as serving (a model of it is READY) for the rest of its life: workers that load later
        on these cores leave its forwards the cores they do not load on."""
        if self.slot is not None:
            with self._lock:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._offset(_SERVING))

    @contextmanager
    def _share_while_others_serve(self) -> Iterator[tuple[int, int]]:
        """(threads to load on, other workers serving). Beside serving workers: a batch held for the whole load, so
        each of their forwards takes an equal share and leaves it these cores, and the load runs on its share where
        they had batches within ``_BUSY_LOOK_S`` (on every core beside idle ones: a scale-up ahead of traffic loads
        as fast as alone). Not a forward: one proven at one count only (IPEX) would wait for the cores until the
        load ends; it runs at its count beside it."""
        serving = self._serving_others()
        if not serving:
            yield self.cores, 0
            return
        with self._held(_BATCH):
            busy = self._others_hold_batches(_BUSY_LOOK_S)
            yield (max(1, self.cores // (serving + 1)) if busy else self.cores), serving

    def _others_hold_batches(self, seconds: float) -> bool:
        """Whether another worker holds a batch within ``seconds``: seen holding one, or its forward found this
        one's batch and wrote the record of overlapping batches."""
        started = time.monotonic()
        while True:
            with self._mutex():
                state = self._read_state()
                holding, _ = self._others(state)
                when, _ = _CONTENDED_FORMAT.unpack_from(state, 0)
            if holding or when >= started:
                return True
            if time.monotonic() - started >= seconds:
                return False
            time.sleep(_BUSY_LOOK_EVERY_S)

    def _serving_others(self) -> int:
        if self.slot is None:
            return 0
        return sum(self._is_locked(self._offset(_SERVING, slot)) for slot in self._other_slots(self._read_state()))

    def _take_load(self, model: str) -> bool:
        with self._lock:
            if not self._loads and not self._try_lock(_LOAD):
                return False
            self._loads += 1
            if self._loads == 1:
                try:  # the name is for the log of a worker that waits: a load never fails for it
                    os.pwrite(self._fd, _as_written(model).encode().ljust(_LOADER_BYTES, b"\0"), _LOADER)
                except OSError:
                    pass
            return True

    def _give_load(self) -> None:
        with self._lock:
            self._loads -= 1
            if self._loads == 0:
                try:  # no name while no one loads: a waiter never names a load that ended
                    os.pwrite(self._fd, bytes(_LOADER_BYTES), _LOADER)
                except OSError:
                    pass
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _LOAD)

    def _loader(self) -> str:
        """The model the worker holding the load turn loads (as it wrote it; empty while it has not)."""
        return os.pread(self._fd, _LOADER_BYTES, _LOADER).rstrip(b"\0").decode(errors="replace")

    def _sharing(self, now_holding: int, state: bytes) -> int:
        """Workers to share the cores among: those holding a batch now (this one too), or as many as held batches at
        once within ``remember_s``. Called under the mutex, which also guards the record (``state``: read under it)."""
        now = time.monotonic()
        if now_holding > 1:
            os.pwrite(self._fd, _CONTENDED_FORMAT.pack(now, min(now_holding, 255)), _CONTENDED)
            return now_holding
        when, workers = _CONTENDED_FORMAT.unpack_from(state, 0)
        return max(1, workers) if 0 <= now - when <= self.remember_s else 1

    def _others(self, state: bytes) -> tuple[int, int]:
        """Other workers holding a batch, and the threads of the others' running forwards."""
        holding = running = 0
        for slot in self._other_slots(state):
            holding += self._is_locked(self._offset(_BATCH, slot))
            if self._is_locked(self._offset(_FORWARD, slot)):
                running += state[_slot_at(slot) + _THREADS] or 1
        return holding, running

    def _read_state(self) -> bytes:
        """The record of overlapping batches and every slot's bytes, in one read: from ``_CONTENDED`` on."""
        return os.pread(self._fd, _STATE_BYTES, _CONTENDED)

    def _other_slots(self, state: bytes) -> Iterator[int]:
        """The slots another live process owns. A slot is marked claimed before its owner takes any batch, so one
        never marked is skipped unlocked; a mark outlives its process (a killed one cannot clear it), so a marked slot
        is owned only while its byte is locked."""
        for slot in range(SLOTS):
            if (slot != self.slot and state[_slot_at(slot) + _OWNED]
                    and self._is_locked(self._offset(_OWNED, slot))):
                yield slot

    def _claim_slot(self) -> int | None:
        for slot in range(SLOTS):
            offset = self._offset(_OWNED, slot)
            if self._try_lock(offset):
                try:
                    os.pwrite(self._fd, _CLAIMED, offset)
                except OSError:  # unmarked, the others would not see it: run as alone instead (a full temp dir)
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
                    return None
                return slot
        return None

    @contextmanager
    def _held(self, part: int) -> Iterator[None]:
        if self.slot is None:
            yield
            return
        with self._mutex():
            self._take(part)
        try:
            yield
        finally:
            self._give(part)

    def _take(self, part: int) -> None:
        with self._lock:
            self._depth[part] += 1
            if self._depth[part] == 1:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._offset(part))

    def _give(self, part: int) -> None:
        with self._lock:
            self._depth[part] -= 1
            if self._depth[part] == 0:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._offset(part))

    @contextmanager
    def _mutex(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _MUTEX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _MUTEX)

    def _offset(self, part: int, slot: int | None = None) -> int:
        return _FIRST_SLOT + (self.slot if slot is None else slot) * _SLOT_BYTES + part

    def _try_lock(self, offset: int) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True

    def _is_locked(self, offset: int) -> bool:
        """Whether another process holds this byte (a free one is locked and let go at once)."""
        if not self._try_lock(offset):
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
        return False


def _slot_at(slot: int) -> int:
    """Where ``slot``'s bytes start in what ``_read_state`` returns."""
    return _FIRST_SLOT - _CONTENDED + slot * _SLOT_BYTES


def _as_written(model: str) -> str:
    """``model`` as the load's holder writes it: cut to fit, on a character boundary."""
    return model.encode()[:_LOADER_BYTES].decode(errors="ignore")


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
    name = hashlib.sha256(repr((sorted(cpus), cores, _LAYOUT)).encode()).hexdigest()[:16]
    path = (directory or Path(tempfile.gettempdir())) / f"pt2-handlers-cores-{os.getuid()}-{name}"
    key = (os.getpid(), path)  # a forked child holds none of its parent's locks: it joins on its own
    with _SHARES_LOCK:
        if key not in _SHARES:
            _SHARES[key] = CoreShare(cores, path, remember_s)
        return _SHARES[key]
