"""End this process's OpenMP threads after a forward, where workers on its cores take requests in turn.

After a parallel region libgomp's threads spin for about 3 ms before they sleep (``GOMP_SPINCOUNT``, read once when
the process starts). A worker alone on its cores keeps that spin: it is what makes its next forward fast. Beside
other workers that take requests in turn it is the wrong way round: the next forward is usually a sibling's (TorchServe
hands lone requests to a model's workers in turn), and the spinning thread takes a core from it: on an Intel Xeon with
AMX, ending the threads after each forward took 1.5 ms off two int8 workers' lone requests at p50 and 8.7 ms at p99
(docs/performance.md). So the engine pauses after a forward that followed another worker's on the same cores
(``handlers.cpu.core_share`` tells it), whichever way the workers came: a YAML's ``minWorkers``, the management API's
scale-up, another model's workers.

Where starting the threads again costs more than their spin, the pause does not pay: on AMD EPYC VMs the first
parallel region after a pause took 1-13 ms longer, and paused workers' lone requests had a longer tail. So at load
(``measure``) a worker times a small parallel region on its threads after a pause and after its threads were left
alone, and pauses only where the restart costs less than ``RESTART_PAYS_MS`` at the 90th percentile (the mean
wanders; docs/performance.md); describe says which, with the cost.

``omp_pause_resource_all`` (OpenMP 5.0) ends them at once; the next parallel region starts new ones. Only libgomp is
looked for: it is the OpenMP runtime of torch's Linux wheels. Where the process has none loaded, or it lacks the
call, ``pause`` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import torch

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads end, the runtime's state stays
_RUNTIME = "libgomp"
# The pause pays where restarting the threads costs the next forward less than this at the 90th percentile: the spin it
# ends cost a sibling's lone request ~1.5 ms on an Intel Xeon with AMX.
RESTART_PAYS_MS = 1.0
_TRIALS = 16  # of each, alternated: ~0.3 s at load
_GAP_S = 0.005  # between two regions: past the spin, as between a worker's forwards when workers take turns
_REGION_ELEMENTS = 1 << 20  # a region of ~0.2 ms on two threads


class OpenMPPause:
    """``omp_pause_resource_all`` of the libgomp this process has loaded, found once."""

    def __init__(self, maps: Path = Path("/proc/self/maps")):
        self._pause = None
        self.why_not: str | None = None
        self.restart_ms: float | None = None  # measured: what a pause costs the next parallel region (90th percentile)
        try:
            path = next((line.split()[-1] for line in maps.read_text().splitlines()
                         if _RUNTIME in Path(line.split()[-1]).name), None)
        except OSError as exc:
            path, self.why_not = None, f"cannot read {maps}: {exc}"
        if path is None:
            self.why_not = self.why_not or f"no {_RUNTIME} loaded in this process"
            return
        try:
            self._pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError) as exc:
            self.why_not = f"{path} has no omp_pause_resource_all: {exc}"
            return
        self._pause.argtypes = [ctypes.c_int]
        self._pause.restype = ctypes.c_int

    @property
    def available(self) -> bool:
        return self._pause is not None

    @property
    def pays(self) -> bool:
        """Whether to pause: the call is there, and restarting the threads was not measured to cost too much."""
        return self._pause is not None and self.why_not is None

    def measure(self, threads: int, trials: int = _TRIALS, pays_below_ms: float | None = None) -> None:
        """Time a small parallel region on ``threads`` threads after a pause and after the threads were left to spin
        and sleep, alternated; where a pause costs it ``pays_below_ms`` (``RESTART_PAYS_MS``) or more at the 90th
        percentile, ``pays`` turns False and ``why_not`` says what it cost."""
        if self._pause is None or threads < 2:
            return
        bound = RESTART_PAYS_MS if pays_below_ms is None else pays_below_ms
        work = torch.zeros(_REGION_ELEMENTS)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        left, restarted = [], []
        try:
            for _ in range(trials):
                for pause, seconds in ((False, left), (True, restarted)):
                    work.add_(1.0)
                    if pause:
                        self._pause(OMP_PAUSE_SOFT)
                    time.sleep(_GAP_S)
                    started = time.perf_counter()
                    work.add_(1.0)
                    seconds.append(time.perf_counter() - started)
        finally:
            torch.set_num_threads(before)
        self.restart_ms = round((_p90(restarted) - _p90(left)) * 1e3, 3)
        self.why_not = None if self.restart_ms < bound else (
            f"restarting them after a pause cost a parallel region {self.restart_ms:g} ms at the 90th percentile "
            f"here (measured at load; the pause pays below {bound:g} ms)")

    def __call__(self) -> bool:
        """End the threads of this thread's OpenMP pool; False where that cannot be done (or the runtime refused:
        called inside a parallel region)."""
        return self._pause is not None and self._pause(OMP_PAUSE_SOFT) == 0


def _p90(seconds: list[float]) -> float:
    """The 90th percentile: a restart's cost here was bimodal (most ~1 ms, some ~10), its mean unsteady."""
    return statistics.quantiles(seconds, n=10, method="inclusive")[-1]
