"""How one worker uses the machine's cores: the threads it runs, and, where it shares the cores with the other
workers forward by forward (``threads: auto``), its turn to load, each forward's share, fewer threads for a small
forward after idle virtual cores, and OpenMP's pause after a forward that followed another worker's.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from handlers.config import Choice
from handlers.cpu import features, idle_cores, openmp_pause, threads
from handlers.cpu.core_share import CoreShare

logger = logging.getLogger(__name__)


class WorkerCores:
    """The cores of one worker: ``threads`` (the count it runs alone, and why), ``share`` (the cores it shares forward
    by forward; None where the count is fixed), ``runs_at`` (the counts its served forward was proven at, once
    loaded; None: any)."""

    def __init__(self, requested: int | None, workers: int, device: torch.device):
        self.threads: Choice = threads.resolve_threads(requested, workers, device)  # at load
        self.load_threads: int = self.threads.value  # fewer while other workers serve on shared cores
        self.share: CoreShare | None = threads.core_share(requested, device)
        self.runs_at: tuple[int, ...] | None = None
        # fewer threads for a small forward after idle virtual cores (only where cores are shared forward by forward)
        self.idle_cores = idle_cores.for_cpu(features.linux_cpu_flags()) if self.share is not None else None
        # on shared cores, a forward that followed another worker's ends its OpenMP threads (handlers.cpu.openmp_pause)
        self.openmp_pause = openmp_pause.OpenMPPause() if self.share is not None else None
        self.openmp_pauses = 0  # forwards after which it did
        self.waited_s = 0.0  # at load: waiting for other workers on these cores to load
        self.waited_for: tuple[str, ...] = ()  # the models those workers loaded
        self._forward_ended: float | None = None  # time.monotonic() when this worker's last forward ended

    @contextmanager
    def loading(self, model_name: str, wait_s: float) -> Iterator[None]:
        """Held while this worker loads. Workers on the cores it shares load one after another, whatever model they
        load (``CoreShare.loading``), each on every core: it measures on cores the others leave quiet, at the count it
        runs at alone, and the next worker of a model loads from what the first kept (docs/performance.md has the
        load times). Beside workers that already serve clients, it loads on its share of the cores and leaves them
        the rest, so their clients keep being served while it loads."""
        share = self.share
        if share is None:
            torch.set_num_threads(self.load_threads)
            yield
            return
        with share.loading(model_name, wait_s) as turn:
            self.waited_s, self.waited_for = turn.waited_s, turn.waited_for
            if turn.alone and self.threads.value != share.cores:
                self.threads = Choice(share.cores, (
                    f"auto: {share.cores} usable cores (CPU affinity and limit); workers on them load in "
                    "turn, each on all of them, and share them forward by forward once READY (per_forward)"))
            _log_turn(model_name, turn.alone, turn.waited_s, turn.waited_for)
            # Measurements and what it keeps stay under the count it serves at alone (self.threads): a sibling's
            # are found, and a race ranks its rungs alike on fewer cores.
            self.load_threads = min(turn.threads, self.threads.value)
            shared = turn.serving and self.load_threads < share.cores
            if shared:
                logger.info("load: %d other worker(s) serve on these %d cores: this one loads on %d of them (and "
                            "compiles kernels in as many processes) and leaves their forwards the rest until READY",
                            turn.serving, share.cores, self.load_threads)
            elif turn.serving:
                logger.info("load: %d other worker(s) on these %d cores are READY but idle: this one loads on "
                            "every core, and their forwards take an equal share until READY", turn.serving,
                            share.cores)
            torch.set_num_threads(self.load_threads)
            with compile_processes(self.load_threads) if shared else nullcontext():
                yield
            if self.openmp_pause is not None:  # within the turn: no sibling loads meanwhile
                self.openmp_pause.measure(share.cores)
        share.serves()

    def batch(self) -> AbstractContextManager:
        """Held from a batch's arrival to its answers: the other workers size their forwards by how many do."""
        return self.share.batch() if self.share is not None else nullcontext()

    @contextmanager
    def forward(self, tokens: int | None = None) -> Iterator[int]:
        """The intra-op threads this forward runs on, held until it ends: its share of the cores the machine's
        workers share (``handlers.cpu.core_share``), fewer for a small batch of ``tokens`` after idle virtual cores
        (``handlers.cpu.idle_cores``), else the count it loaded with."""
        if self.share is None:
            yield self.threads.value
            return
        runs_at: Collection[int] | None = self.runs_at
        if self.idle_cores is not None:
            idle = None if self._forward_ended is None else time.monotonic() - self._forward_ended
            runs_at = self.idle_cores.counts(runs_at, tokens, idle)
        count, after_another = 1, False
        try:
            with self.share.forward(runs_at) as grant:
                count, after_another = grant.threads, grant.after_another
                if torch.get_num_threads() != count:
                    torch.set_num_threads(count)
                yield count
        finally:
            self._forward_ended = time.monotonic()
            if self.openmp_pause is not None and self.openmp_pause.pays and count > 1 and after_another:
                self.openmp_pauses += self.openmp_pause()

    def thread_counts(self) -> tuple[int, ...]:
        """The thread counts a forward may be given: the count it loads with, and with shared cores every core
        (alone) and half of them (beside another worker's forward)."""
        if self.share is None:
            return (self.threads.value,)
        return tuple(sorted({self.threads.value, self.share.cores, max(1, self.share.cores // 2)}))

    def describe(self) -> dict[str, Any]:
        said: dict[str, Any] = {"intra_op": self.threads.value, "reason": self.threads.reason,
                                "at_load": self.load_threads}
        if self.share is not None:
            runs_at = "/".join(map(str, self.runs_at or ()))
            proven = f", of the counts its compiled forward was proven at ({runs_at})" if self.runs_at else ""
            said["per_forward"] = (
                f"shared with the other workers on these {self.share.cores} cores: all of them alone, an equal share "
                f"while other workers hold batches or held them at once in the last {self.share.remember_s:g}s"
                + proven + ("" if self.idle_cores is None else f"; {self.idle_cores.describe()}"))
        pause = self.openmp_pause
        if pause is not None:
            said["openmp_after_forward"] = (
                f"threads ended after a forward on more than one that followed another worker's on these cores "
                f"({self.openmp_pauses} so far): workers that take requests in turn; alone, left to spin"
                + ("" if pause.restart_ms is None else
                   f"; restarting them cost {pause.restart_ms:g} ms (90th percentile, measured at load)")
                if pause.pays else f"threads left to spin: {pause.why_not}")
        return said


def _log_turn(model_name: str, alone: bool, waited_s: float, waited_for: tuple[str, ...]) -> None:
    models = ", ".join("this model" if name == model_name else name for name in waited_for)
    if not alone:
        logger.warning("load: another worker still loads on these cores after %.0fs (half of startupTimeout; "
                       "waited for: %s); loading beside it", waited_s, models or "model unknown")
    elif waited_s > 0:  # any wait: an operator reading the log sees why this load took longer
        logger.info("load: waited %.1fs for the loads of other workers on these cores (%s): workers on them "
                    "load one at a time%s", waited_s, models or "model unknown",
                    "; this one loads from what that worker kept" if model_name in waited_for else "")


def compile_processes(count: int) -> Any:
    """Inductor compiles kernels in a pool of processes, one per core (``compile_threads``): on a share of the cores
    beside busy workers, in ``count`` (1: in this process), so the serving workers keep their cores (their p99 rose
    by a third with two processes; docs/performance.md). Not part of the compile cache's key."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(compile_threads=count)
