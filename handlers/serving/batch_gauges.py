"""Per-batch gauges, averaged over a window instead of emitted batch by batch.

Why: the adapter reports eight gauges per batch (each stage's milliseconds, requests, threads, padding). Emitting
them through TorchServe's metrics API (a log line each, which the frontend parses) cost a lone short request 0.5-1.3
ms of the worker's time on a 2-core AVX2 EPYC, about as much as the rest of the handler around the model
(docs/performance.md). A Prometheus scrape reads only the latest value of a gauge,
so a mean over the batches of the last second says more than the last batch did, at a fraction of the cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping


class GaugeWindow:
    """Means of per-batch values, handed out at most once every ``every_s`` seconds.

    ``add`` takes one batch's values and answers the means of every batch since the last answer (this one included)
    when at least ``every_s`` seconds have passed since then, else None. The first batch is answered at once; with
    ``every_s`` 0, every batch is. Nothing runs between batches: the last window's values wait for the next batch.
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._sums: dict[Hashable, float] = {}
        self._counts: dict[Hashable, int] = {}
        self._due = -math.inf

    def add(self, values: Mapping[Hashable, float]) -> dict[Hashable, float] | None:
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1
        now = self._clock()
        if now < self._due:
            return None
        means = {key: total / self._counts[key] for key, total in self._sums.items()}
        self._sums.clear()
        self._counts.clear()
        self._due = now + self.every_s
        return means
