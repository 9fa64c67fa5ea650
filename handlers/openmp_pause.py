"""End this process's OpenMP threads after a forward, where workers on its cores take requests in turn.

After a parallel region libgomp's threads spin for about 3 ms before they sleep (``GOMP_SPINCOUNT``, read once when
the process starts). A worker alone on its cores keeps that spin: it is what makes its next forward fast. Beside
other workers that take requests in turn it is the wrong way round: the next forward is usually a sibling's (TorchServe
hands lone requests to a model's workers in turn), and the spinning thread takes a core from it. Measured on CPU C (two
int8 workers, lone short requests; docs/performance.md: OpenMP's pause): the worker's forward ran 2.65 ms over the
model alone, against 1.06 ms with one worker; ending the threads after each forward took 1.5 ms off the client's p50
and 8.7 ms off its p99. So the engine pauses after a forward that followed another worker's on the same cores
(``handlers.core_share`` tells it), whichever way the workers came: a YAML's ``minWorkers``, the management API's
scale-up, another model's workers. On CPU E (a Zen 5 EPYC, stop 71) the same two workers with and without it were
level under load, and with lone requests it traded a lower p50 for a longer p90 (20-30 ms, likely the wake of a vCPU
that went idle once the threads ended): kept, a gain on one hypervisor and no loss under load on the other.

``omp_pause_resource_all`` (OpenMP 5.0) ends them at once; the next parallel region starts new ones. Only libgomp is
looked for: it is the OpenMP runtime of torch's Linux wheels. Where the process has none loaded, or it lacks the
call, ``pause`` does nothing and says so.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads end, the runtime's state stays
_RUNTIME = "libgomp"


class OpenMPPause:
    """``omp_pause_resource_all`` of the libgomp this process has loaded, found once."""

    def __init__(self, maps: Path = Path("/proc/self/maps")):
        self._pause = None
        self.why_not: str | None = None
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

    def __call__(self) -> bool:
        """End the threads of this thread's OpenMP pool; False where that cannot be done (or the runtime refused:
        called inside a parallel region)."""
        return self._pause is not None and self._pause(OMP_PAUSE_SOFT) == 0
