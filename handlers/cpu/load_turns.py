"""Workers on one set of cores take turns loading, whatever model they load.

Started together (a model's ``minWorkers: 2``, or several models at server start), each worker measured its rungs,
races and costs while the others compiled on the cores it needed, and none served until all were done; in turn, the
first is READY sooner and the next loads from what it kept (its compile cache and measurements; docs/performance.md
has the load times). A worker that loads while others on these cores serve (a scale-up, a restart, another model
registered) holds a batch until it is READY, so the serving workers' forwards take their share of the cores, and
where they are busy it loads on its share of them (beside idle ones, on every core).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from handlers.cpu.slot_file import BATCH, SERVING, SlotFile, as_written

_LOAD_LOOK_SECONDS = 0.25  # between looks while a sibling loads: a load takes seconds
# How long a worker that loads beside serving ones looks for their batches (a busy one has one every few ms; a quarter
# second of a load of tens, paid beside idle ones only).
BUSY_LOOK_S = 0.25
_BUSY_LOOK_EVERY_S = 0.005


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


class LoadTurns:
    """The load turns of the ``cores`` cores whose workers share ``slots``."""

    def __init__(self, slots: SlotFile, cores: int):
        self.slots = slots
        self.cores = cores

    @contextmanager
    def loading(self, model: str, wait_s: float) -> Iterator[Turn]:
        """Held while this process loads ``model``: another worker that loads on these cores, of any model, loads
        after, or, past ``wait_s`` of waiting, beside it. Engines of one process never wait for each other (the locks
        are the process's). The turn says the threads to load on: a share of the cores beside busy serving
        workers."""
        started = time.monotonic()
        waited_for: list[str] = []
        held = self.slots.take_load(model)
        while not held and time.monotonic() - started < wait_s:
            loader = self.slots.loader()
            if loader == as_written(model):  # cut as written: a long name is this model's still
                loader = model
            if loader and loader not in waited_for:
                waited_for.append(loader)
            time.sleep(_LOAD_LOOK_SECONDS)
            held = self.slots.take_load(model)
        waited_s = round(time.monotonic() - started, 1)
        try:
            with self._share_while_others_serve() as (threads, serving):
                yield Turn(waited_s, held, threads, serving, tuple(waited_for))
        finally:
            if held:
                self.slots.give_load()

    def loader(self) -> str:
        """The model the worker holding the load turn loads (empty while none does)."""
        return self.slots.loader()

    @contextmanager
    def _share_while_others_serve(self) -> Iterator[tuple[int, int]]:
        """(threads to load on, other workers serving). Beside serving workers: a batch held for the whole load, so
        each of their forwards takes an equal share and leaves it these cores, and the load runs on its share where
        they had batches within ``BUSY_LOOK_S`` (on every core beside idle ones: a scale-up ahead of traffic loads
        as fast as alone). Not a forward: one proven at one count only (IPEX) would wait for the cores until the
        load ends; it runs at its count beside it."""
        serving = self._serving_others()
        if not serving:
            yield self.cores, 0
            return
        with self.slots.held(BATCH):
            busy = self._others_hold_batches(BUSY_LOOK_S)
            yield (max(1, self.cores // (serving + 1)) if busy else self.cores), serving

    def _others_hold_batches(self, seconds: float) -> bool:
        """Whether another worker holds a batch within ``seconds``: seen holding one, or its forward found this
        one's batch and wrote the record of overlapping batches."""
        started = time.monotonic()
        while True:
            with self.slots.mutex():
                state = self.slots.read_state()
                holding = any(self.slots.holds(BATCH, slot) for slot in self.slots.other_slots(state))
                when, _ = state.contended
            if holding or when >= started:
                return True
            if time.monotonic() - started >= seconds:
                return False
            time.sleep(_BUSY_LOOK_EVERY_S)

    def _serving_others(self) -> int:
        if self.slots.slot is None:
            return 0
        state = self.slots.read_state()
        return sum(self.slots.holds(SERVING, slot) for slot in self.slots.other_slots(state))
