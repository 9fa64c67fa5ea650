"""torch.compile backends that fail on purpose, given to the ladder as ``module:function``.

A backend runs when dynamo compiles a frame, i.e. at the first forward, not at ``torch.compile``:
exactly the lazy failure TorchServe's stock handler lets through to the first user request. The
integration test ships this file inside an archive so a real worker imports it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def raise_on_compile(graph_module, example_inputs):
    raise RuntimeError("injected failure: this backend cannot compile anything")


def wrong_numbers(graph_module, example_inputs):
    """Compiles to a graph whose outputs are off by one."""

    def run(*args):
        outputs = graph_module(*args)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(o + 1 if hasattr(o, "is_floating_point") and o.is_floating_point() else o
                                 for o in outputs)
        return outputs + 1

    return run


def negated(graph_module, example_inputs):
    """Compiles to a graph whose floating outputs are negated: every argmax (a greedy token) changes."""

    def run(*args):
        outputs = graph_module(*args)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(-o if hasattr(o, "is_floating_point") and o.is_floating_point() else o
                                 for o in outputs)
        return -outputs

    return run


BROKEN = {"now": False}  # set by a test: the graphs compiled by breaks_on_demand raise from then on
BREAK_FILE = "pt2-break-compiled-graphs"  # or, in a TorchServe worker: this file in its temp dir exists


def broken() -> bool:
    return BROKEN["now"] or Path(tempfile.gettempdir(), BREAK_FILE).exists()


def breaks_on_demand(graph_module, example_inputs):
    """Compiles to the graph itself (fast: no codegen), which raises once ``broken()``: a compiled rung that proved
    itself at load and fails on live traffic later."""

    def run(*args):
        if broken():
            raise RuntimeError("injected failure: the compiled graph broke after READY")
        return graph_module(*args)

    return run
