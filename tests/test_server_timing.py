"""handlers/serving/server_timing.py: the Server-Timing header of each answer (served for real:
tests/test_torchserve.py)."""

from __future__ import annotations

from handlers.serving import server_timing


def test_the_header_lists_the_stages_in_order_then_the_handler_and_the_batch():
    value = server_timing.header({"parse": 0.0614, "forward": 2.6049}, 3.0441, 8)
    assert value == "parse;dur=0.061, forward;dur=2.605, handler;dur=3.044, batch;desc=8"
    assert server_timing.durations(value) == {"parse": 0.061, "forward": 2.605, "handler": 3.044}


def test_a_batch_that_reached_no_model_has_the_handler_alone():
    assert server_timing.header({}, 0.25, 0) == "handler;dur=0.250"


def test_values_written_by_others_are_read_too():
    """Spaces, quoted durations, and metrics with a description but no duration (RFC-style, as proxies add them)."""
    value = 'cdn-cache;desc=HIT, edge ; dur = 1.5 , db;dur="53";desc="primary", handler;dur=3'
    assert server_timing.durations(value) == {"edge": 1.5, "db": 53.0, "handler": 3.0}
