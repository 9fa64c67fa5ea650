"""The per-batch gauges' window (handlers/serving/batch_gauges.py): what a worker emits, and when. The real emission
through TorchServe's metrics API is tests/test_torchserve.py's Prometheus test."""

from __future__ import annotations

import pytest

from handlers.serving.batch_gauges import GaugeWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_batch_at_once_then_the_means_of_each_window():
    clock = Clock()
    window = GaugeWindow(1.0, clock)
    assert window.add({"forward": 10.0, "requests": 1}) == {"forward": 10.0, "requests": 1.0}
    clock.now += 0.2
    assert window.add({"forward": 20.0, "requests": 2}) is None
    clock.now += 0.5
    assert window.add({"forward": 30.0, "requests": 8, "cores": 0.5}) is None
    clock.now += 0.3  # a second after the last emission: this batch closes the window
    assert window.add({"forward": 40.0, "requests": 2}) == pytest.approx({"forward": 30.0, "requests": 4.0,
                                                                          "cores": 0.5})
    clock.now += 0.9  # a new window, opened by the emission above
    assert window.add({"forward": 1.0}) is None
    clock.now += 5.0  # traffic stopped: the next batch, however late, reports the window it closes
    assert window.add({"forward": 3.0}) == {"forward": 2.0}


def test_zero_seconds_is_every_batch_its_own():
    clock = Clock()
    window = GaugeWindow(0.0, clock)
    for forward in (5.0, 7.0, 9.0):
        assert window.add({"forward": forward}) == {"forward": forward}
