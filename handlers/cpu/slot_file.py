"""The small lock file through which the workers on one set of cores see each other: one slot per process, each
slot a few bytes that its process locks while it holds a batch, runs a forward, serves or loads.

Byte-range locks (``fcntl.lockf``) die with their process, so a killed worker never keeps cores. POSIX locks
belong to a process, so a process has one slot per file (``handlers.cpu.core_share.for_cores``), whatever number
of engines it runs; nested holds within the process are counted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SLOTS = 16  # workers that can take part on one set of cores; a 17th runs on its own
MUTEX = 0  # held while one worker reads the others and takes its threads
CONTENDED = 8  # written: when workers last held batches at once (time.monotonic, one clock per machine), and how many
CONTENDED_FORMAT = struct.Struct("<dB")
LAST_FORWARD = 20  # written: 1 + the slot of the worker whose forward began last (0: none yet)
FIRST_SLOT = 24
SLOT_BYTES = 5  # per slot, at these offsets:
OWNED = 0  # locked for the life of the process in the slot; written CLAIMED once a process has claimed it
BATCH = 1  # locked while it holds a batch
FORWARD = 2  # locked while it runs a forward
THREADS = 3  # written: the threads of that forward
SERVING = 4  # locked for the rest of the process's life once it serves (a model READY)
LOAD = 4096  # past the slots: locked while a worker loads a model
LOADER = LOAD + 1  # written by the worker holding the load: the model it loads (for the log of one that waits)
LOADER_BYTES = 128
_STATE_BYTES = FIRST_SLOT + SLOTS * SLOT_BYTES - CONTENDED  # read at once per forward: the record, then the slots
CLAIMED = b"\x01"  # a slot never claimed reads 0: the others skip its locks (3 syscalls each, per forward)
LAYOUT = 5  # in the file's name: a worker of an earlier release, on the old layout, never reads this one


@dataclass(frozen=True)
class State:
    """The file read at once, under the mutex: the record of overlapping batches, the slot whose forward began last,
    and every slot's bytes."""

    raw: bytes

    @property
    def contended(self) -> tuple[float, int]:
        """When workers last held batches at once (``time.monotonic``), and how many."""
        return CONTENDED_FORMAT.unpack_from(self.raw, 0)

    @property
    def last_forward(self) -> int:
        return self.raw[LAST_FORWARD - CONTENDED]

    def byte(self, slot: int, part: int) -> int:
        return self.raw[FIRST_SLOT - CONTENDED + slot * SLOT_BYTES + part]


class SlotFile:
    """This process's slot (``slot``; None where all were taken) in the lock file at ``path``."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = LOADER + LOADER_BYTES
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)  # each worker writes only its own slot's byte
        self._lock = threading.Lock()
        self._depth = {BATCH: 0, FORWARD: 0}  # nested holds of this slot's bytes, within this process
        self._loads = 0  # engines of this process that hold the load turn
        self._threads_written: int | None = None  # the threads byte of this slot as last written
        self.slot = self._claim_slot()

    @contextmanager
    def mutex(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, MUTEX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, MUTEX)

    def read_state(self) -> State:
        """The record of overlapping batches and every slot's bytes, in one read. Read it under the mutex."""
        return State(os.pread(self._fd, _STATE_BYTES, CONTENDED))

    def other_slots(self, state: State) -> Iterator[int]:
        """The slots another live process owns. A slot is marked claimed before its owner takes any batch, so one
        never marked is skipped unlocked; a mark outlives its process (a killed one cannot clear it), so a marked slot
        is owned only while its byte is locked."""
        for slot in range(SLOTS):
            if slot != self.slot and state.byte(slot, OWNED) and self.is_locked(self.offset(OWNED, slot)):
                yield slot

    def holds(self, part: int, slot: int) -> bool:
        """Whether the process in ``slot`` holds ``part`` (a batch, a forward, serving)."""
        return self.is_locked(self.offset(part, slot))

    @contextmanager
    def held(self, part: int) -> Iterator[None]:
        """``part`` of this slot locked until the block ends (taken under the mutex)."""
        if self.slot is None:
            yield
            return
        with self.mutex():
            self.take(part)
        try:
            yield
        finally:
            self.give(part)

    def take(self, part: int) -> None:
        with self._lock:
            self._depth[part] += 1
            if self._depth[part] == 1:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self.offset(part))

    def give(self, part: int) -> None:
        with self._lock:
            self._depth[part] -= 1
            if self._depth[part] == 0:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self.offset(part))

    def write_threads(self, threads: int) -> None:
        """This slot's forward's threads, for the others to count (written only when it changes)."""
        if threads != self._threads_written:  # only this process writes its slot's byte
            os.pwrite(self._fd, bytes([min(threads, 255)]), self.offset(THREADS))
            self._threads_written = threads

    def write_last_forward(self, state: State) -> None:
        """This slot as the one whose forward began last (a lone worker writes it once)."""
        if self.slot is not None and state.last_forward != self.slot + 1:
            os.pwrite(self._fd, bytes([self.slot + 1]), LAST_FORWARD)

    def write_contended(self, now: float, workers: int) -> None:
        os.pwrite(self._fd, CONTENDED_FORMAT.pack(now, min(workers, 255)), CONTENDED)

    def mark_serving(self) -> None:
        """This process serves, for the rest of its life."""
        if self.slot is not None:
            with self._lock:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self.offset(SERVING))

    def take_load(self, model: str) -> bool:
        """The load turn, if no other process holds it (engines of this process share it); ``model`` written for
        the log of a worker that waits."""
        with self._lock:
            if not self._loads and not self.try_lock(LOAD):
                return False
            self._loads += 1
            if self._loads == 1:
                try:  # the name is for the log of a worker that waits: a load never fails for it
                    os.pwrite(self._fd, as_written(model).encode().ljust(LOADER_BYTES, b"\0"), LOADER)
                except OSError:
                    pass
            return True

    def give_load(self) -> None:
        with self._lock:
            self._loads -= 1
            if self._loads == 0:
                try:  # no name while no one loads: a waiter never names a load that ended
                    os.pwrite(self._fd, bytes(LOADER_BYTES), LOADER)
                except OSError:
                    pass
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, LOAD)

    def loader(self) -> str:
        """The model the worker holding the load turn loads (as it wrote it; empty while it has not)."""
        return os.pread(self._fd, LOADER_BYTES, LOADER).rstrip(b"\0").decode(errors="replace")

    def offset(self, part: int, slot: int | None = None) -> int:
        return FIRST_SLOT + (self.slot if slot is None else slot) * SLOT_BYTES + part

    def try_lock(self, offset: int) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True

    def is_locked(self, offset: int) -> bool:
        """Whether another process holds this byte (a free one is locked and let go at once)."""
        if not self.try_lock(offset):
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
        return False

    def _claim_slot(self) -> int | None:
        for slot in range(SLOTS):
            offset = self.offset(OWNED, slot)
            if self.try_lock(offset):
                try:
                    os.pwrite(self._fd, CLAIMED, offset)
                except OSError:  # unmarked, the others would not see it: run as alone instead (a full temp dir)
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
                    return None
                return slot
        return None


def as_written(model: str) -> str:
    """``model`` as the load's holder writes it: cut to fit, on a character boundary."""
    return model.encode()[:LOADER_BYTES].decode(errors="ignore")
