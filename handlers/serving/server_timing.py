"""Each answer's own timing, in the standard ``Server-Timing`` response header (W3C Server Timing).

Why: a client, a proxy or a browser's developer tools see what the worker spent on a request, and where, without the
server's logs or metrics. A lone request's latency then splits into the model's forward, the handler's own stages
and what lies outside the handler (TorchServe's frontend, its batching window, the network), request by request.
A request waits for its whole batch, so the stages are its batch's; ``batch`` says how many requests it held.

    Server-Timing: parse;dur=0.061, preprocess;dur=0.142, cores;dur=0.004, forward;dur=2.605, postprocess;dur=0.071,
                   handler;dur=3.044, batch;desc=1

``handler`` is the worker's whole call for the batch, the stages included. Durations are milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping

NAME = "Server-Timing"
HANDLER = "handler"  # the worker's whole handle() call for the batch
BATCH = "batch"  # desc: the requests in the batch


def header(stages: Mapping[str, float], handler_ms: float, requests: int) -> str:
    """The header's value: each stage's milliseconds in the order run, the whole handler's, and the batch's size
    (left out where no request of the batch reached the model)."""
    metrics = [f"{name};dur={ms:.3f}" for name, ms in stages.items()]
    metrics.append(f"{HANDLER};dur={handler_ms:.3f}")
    if requests:
        metrics.append(f"{BATCH};desc={requests}")
    return ", ".join(metrics)


def durations(value: str) -> dict[str, float]:
    """A Server-Timing value read back: metric name -> its ``dur`` (metrics without one are left out)."""
    found = {}
    for metric in value.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, number = param.partition("=")
            if key.strip() == "dur":
                found[name] = float(number.strip().strip('"'))
    return found
