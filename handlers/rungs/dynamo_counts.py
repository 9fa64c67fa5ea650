"""What dynamo did, from its own counters: graphs compiled, frames it gave up on, graph breaks.

Dynamo can stop compiling a frame without raising: past the recompile limit, or when tracing fails, it runs
the frame eagerly and logs a warning. These counts let the ladder see that at load (a rung that is not really
compiled is not accepted as compiled) and the guard count it after READY. Pure torch; imports dynamo only
when asked (never at import: the compile cache must be chosen first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DynamoCounts:
    graphs: int = 0  # graphs compiled
    frames: int = 0  # frames dynamo was asked to compile
    frames_compiled: int = 0  # of those, the ones it compiled (the rest run eagerly)
    graph_breaks: int = 0  # places a frame was split into several graphs, with eager Python between them
    given_up_why: tuple[str, ...] = ()  # the first line of each reason dynamo gave up on a frame

    @property
    def frames_given_up(self) -> int:
        return self.frames - self.frames_compiled

    def __sub__(self, before: DynamoCounts) -> DynamoCounts:
        return DynamoCounts(self.graphs - before.graphs, self.frames - before.frames,
                            self.frames_compiled - before.frames_compiled, self.graph_breaks - before.graph_breaks,
                            tuple(why for why in self.given_up_why if why not in before.given_up_why))

    def to_json(self) -> dict[str, Any]:
        return {"graphs": self.graphs, "graph_breaks": self.graph_breaks, "frames_given_up": self.frames_given_up}


def activity() -> tuple[int, int]:
    """(graphs compiled, frames dynamo was asked to compile) so far: moves whenever any count above may have, for a
    check around every live batch (twice: 3.1 us p50 against 8.4 for ``dynamo_counts``)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


def dynamo_counts() -> DynamoCounts:
    """Dynamo's counters for this process so far."""
    from torch._dynamo.utils import counters

    return DynamoCounts(
        graphs=int(counters["stats"]["unique_graphs"]),
        frames=int(counters["frames"]["total"]),
        frames_compiled=int(counters["frames"]["ok"]),
        graph_breaks=sum(int(count) for count in counters["graph_break"].values()),
        given_up_why=tuple(str(reason).strip().splitlines()[0] for reason in counters["unimplemented"]),
    )


def steady_state_problem(first_pass: DynamoCounts, second_pass: DynamoCounts, shapes: int) -> str | None:
    """Why a compiled forward is not really compiled, judged from the warmup over ``shapes`` batch shapes
    (``first_pass``) and a second, identical pass (``second_pass``); None when every frame compiled, no shape
    needed more graphs than its graph breaks explain, and the second pass compiled nothing."""
    given_up = first_pass.frames_given_up + second_pass.frames_given_up
    if given_up:
        why = "; ".join(first_pass.given_up_why + second_pass.given_up_why) or "see the worker log"
        return f"dynamo gave up on {given_up} frame(s), which run eagerly: {why}"
    if second_pass.graphs:
        return (f"the second warmup pass compiled {second_pass.graphs} new graph(s): the steady state keeps "
                "recompiling (a guard that changes every call?)")
    # One graph per shape, plus one per graph break. More means a guard changed between calls of the same shape
    # (e.g. a Python int that grows each decode step): calls past the warmup would recompile, or run eagerly.
    expected = shapes * (1 + first_pass.graph_breaks)
    if first_pass.graphs > expected:
        return (f"the warmup compiled {first_pass.graphs} graphs for {shapes} shape(s) (at most {expected} "
                "expected): a guard changes between calls, so later calls would recompile or run eagerly")
    return None
