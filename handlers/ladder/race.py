"""Which proven forward is faster here: each timed on the warmup batches at load, interleaved.

The ladder races a precision that trades answers for speed (int8) against the next precision that keeps them,
on the same rung: whether int8 pays depends on the CPU (on AMX tiles bf16 matmuls can outrun int8's, whose
per-token quantization and float layers cost more than its faster matmuls save) and on the shapes served.
``KeptRaces`` keeps each race for the next load on the same machine (``handlers.ladder.decisions``).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.ladder.decisions import Decisions

logger = logging.getLogger(__name__)

# Timed calls per forward and batch. Each forward counts its fastest call: a busy machine (a neighbour compiling
# at load) only ever adds time, so the fastest call is the one least disturbed; a median of 5 was tipped by it.
ROUNDS = 5
# Calls of one forward in a row before the next forward's turn: a worker serves one forward call after call, and the
# first call after another runtime's is slowed by it (torch's OpenMP threads spin on the cores for a while after each
# call, and OpenVINO's threads then wait for them: in two loads on an Intel Xeon with AMX its lone 16-token MiniLM text
# read 5.40 ms taking turns call by call with the compiled forward, 2.29 ms two calls in a row).
IN_A_ROW = 2
# How much faster the challenger must be to serve: within noise, the precision with the better answers wins.
MIN_GAIN = 0.05
# A race during which this process's threads waited for a CPU longer than MAX_WAIT_SHARE of its time while other
# processes used more than MIN_OTHER_SHARE of the cores it may run on is run again, after a pause, for up to
# PATIENCE_S: a neighbour that keeps the cores busy throughout (another worker compiling at load) slows OpenMP
# kernels by different amounts, more for the graph with more kernels, so the fastest call no longer tells.
# On an Intel Xeon with AMX, int8 read 263 ms against bf16's 249 while the neighbours compiled, 101 against 113 for
# the same model at a quieter moment. Both signals, because each alone misleads: this process's own threads wait for
# each other (torch's OpenMP threads spin beside the main thread: 30 % of a quiet race), and on a big host other
# tenants' load rarely takes the cores this process runs on.
MAX_WAIT_SHARE = 0.05
MIN_OTHER_SHARE = 0.10
PATIENCE_S = 30.0
PAUSE_S = 2.0
# The operator's bound on that wait, in seconds (0: one try): a host that is busy by design (several workers loading
# side by side, a test suite) is never quiet, so waiting for it only delays READY.
PATIENCE_ENV = "PT2_RACE_PATIENCE_S"


def race_patience_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long a disturbed race tries again: ``PT2_RACE_PATIENCE_S`` where set to a number of seconds (0 or more),
    else ``PATIENCE_S`` (also where the value is not such a number, with a warning)."""
    said = environ.get(PATIENCE_ENV, "").strip()
    if not said:
        return PATIENCE_S
    try:
        patience = float(said)
    except ValueError:
        patience = -1.0
    if not 0 <= patience < float("inf"):  # nan fails both
        logger.warning("%s=%r is not a number of seconds (0 or more): races try again for up to %.0fs",
                       PATIENCE_ENV, said, PATIENCE_S)
        return PATIENCE_S
    return patience


@dataclass(frozen=True)
class Race:
    ms: list[float]  # per forward: the sum over the batches of its fastest call, over every try
    tries: int
    # The quietest try: the share of its time this process's threads waited for a CPU, and the share of the
    # cores it may run on that other processes used; None where the kernel does not say.
    wait_share: float | None = None
    other_share: float | None = None
    remembered: bool = False  # an earlier load's race, read back (``handlers.ladder.decisions``)
    # per forward, per batch: its fastest call's ms (what ``ms`` sums); None in a record kept before they were kept
    per_batch: list[list[float]] | None = None

    @property
    def disturbed(self) -> bool:
        return _busy(self.wait_share, self.other_share)

    def describe(self) -> str:
        """What the times were measured under, for the attempts' reasons."""
        said = f"{self.tries} {'try' if self.tries == 1 else 'tries'}"
        if self.disturbed:
            said += (f"; other processes used {self.other_share:.0%} of this worker's cores and kept it waiting for "
                     f"a CPU {self.wait_share:.0%} of the quietest try, so the times are unreliable")
        if self.remembered:
            said += "; remembered from an earlier load, which this worker follows"
        return said

    def record(self) -> dict[str, Any]:
        """What ``handlers.ladder.decisions`` keeps of this race for the next load."""
        return {"ms": self.ms, "tries": self.tries, "wait_share": self.wait_share, "other_share": self.other_share,
                "per_batch": self.per_batch}

    @classmethod
    def from_record(cls, saved: Mapping[str, Any]) -> Race:
        """A race an earlier load kept (``record``); raises KeyError, TypeError or ValueError if it is not one."""
        shares = [None if saved[name] is None else float(saved[name]) for name in ("wait_share", "other_share")]
        per_batch = saved.get("per_batch")
        per_batch = None if per_batch is None else [[float(ms) for ms in forward] for forward in per_batch]
        return cls([float(ms) for ms in saved["ms"]], int(saved["tries"]), *shares, remembered=True,
                   per_batch=per_batch)


def _busy(wait_share: float | None, other_share: float | None) -> bool:
    return (wait_share is not None and other_share is not None
            and wait_share > MAX_WAIT_SHARE and other_share > MIN_OTHER_SHARE)


def run_race(forwards: Sequence[Any], batches: Sequence[Any], run: Callable[[Any, Any], Any],
             rounds: int = ROUNDS, waited: Callable[[], float | None] | None = None,
             others: Callable[[], float | None] | None = None, patience_s: float | None = None,
             pause_s: float = PAUSE_S, sleep: Callable[[float], None] = time.sleep,
             in_a_row: int = IN_A_ROW) -> Race:
    """``forward_ms`` until a try runs on a quiet machine or ``patience_s`` is spent; each forward counts its
    fastest call of every try. A try is disturbed when this process's threads waited for a CPU more than
    ``MAX_WAIT_SHARE`` of its time while other processes used more than ``MIN_OTHER_SHARE`` of its cores.
    ``waited()``: seconds this process has waited for a CPU so far; ``others()``: CPU seconds other processes have
    used on its cores so far (defaults: the kernel's counters); ``patience_s`` defaults to ``race_patience_s()``."""
    waited, others = waited or runqueue_wait_s, others or other_cpu_s
    patience_s = race_patience_s() if patience_s is None else patience_s
    cores = _core_count()
    times: list[list[list[float]]] = [[[] for _ in batches] for _ in forwards]
    deadline = time.monotonic() + patience_s
    tries, quietest = 0, (0.0, 0.0)
    while True:
        tries += 1
        before, started = (waited(), others()), time.perf_counter()
        _timed_rounds(forwards, batches, run, rounds, times, in_a_row)
        after, seconds = (waited(), others()), max(time.perf_counter() - started, 1e-9)
        shares = tuple(None if a is None or b is None else (a - b) / seconds / scale
                       for a, b, scale in zip(after, before, (1, cores), strict=True))
        if not _busy(*shares):
            return Race(_fastest(times), tries, *shares, per_batch=_fastest_per_batch(times))
        if tries == 1 or shares[1] < quietest[1]:  # busy, so both shares are known
            quietest = shares
        if time.monotonic() + pause_s > deadline:
            return Race(_fastest(times), tries, *quietest, per_batch=_fastest_per_batch(times))
        sleep(pause_s)


def _core_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def other_cpu_s() -> float | None:
    """CPU seconds that other processes have used on the cores this process may run on: those cores' busy time
    (Linux ``/proc/stat``) less this process's own (``/proc/self/stat``); None where either is not available."""
    try:
        cores = os.sched_getaffinity(0)
        with open("/proc/stat") as stats:
            lines = stats.read().splitlines()
        with open("/proc/self/stat") as stat:
            own = stat.read().rpartition(")")[2].split()  # fields from the 3rd on: the name may hold spaces
        ticks = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None
    busy = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores and len(values) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in values[:8])
            busy += user + nice + system + irq + softirq + steal
    return (busy - int(own[11]) - int(own[12])) / ticks  # utime and stime, the 14th and 15th fields


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads (torch's OpenMP pool among them) have spent runnable but waiting for a CPU
    (Linux ``/proc/self/task/*/schedstat``, second field); None where that is not available. Unlike the host's
    load it counts only what kept this process off its own cores, on a 2-core VM and a 64-core host alike."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stats:
                total += int(stats.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def forward_ms(forwards: Sequence[Any], batches: Sequence[Any], run: Callable[[Any, Any], Any],
               rounds: int = ROUNDS) -> list[float]:
    """Per forward: the sum over ``batches`` of its fastest call's milliseconds. The forwards take turns on each
    batch, so a slow spell of the machine hits them alike."""
    times: list[list[list[float]]] = [[[] for _ in batches] for _ in forwards]
    _timed_rounds(forwards, batches, run, rounds, times)
    return _fastest(times)


def _timed_rounds(forwards: Sequence[Any], batches: Sequence[Any], run: Callable[[Any, Any], Any], rounds: int,
                  times: list[list[list[float]]], in_a_row: int = IN_A_ROW) -> None:
    with torch.inference_mode():
        for _ in range(rounds):
            for index, batch in enumerate(batches):
                for forward, per_batch in zip(forwards, times, strict=True):
                    for _ in range(in_a_row):
                        started = time.perf_counter()
                        run(forward, batch)
                        per_batch[index].append((time.perf_counter() - started) * 1000)


def _fastest(times: list[list[list[float]]]) -> list[float]:
    return [round(sum(min(calls) for calls in per_batch), 3) for per_batch in times]


def _fastest_per_batch(times: list[list[list[float]]]) -> list[list[float]]:
    return [[round(min(calls), 3) for calls in per_batch] for per_batch in times]


def pays(challenger_ms: float, rival_ms: float, min_gain: float = MIN_GAIN) -> bool:
    """Whether the challenger is at least ``min_gain`` faster than its rival."""
    return challenger_ms <= rival_ms * (1 - min_gain)


class KeptRaces:
    """Races of forwards on the warmup ``batches``, each kept for the next load of the model on this ``machine``: an
    earlier race whose times were reliable is followed without racing; a busy machine's is raced again, kept over if
    this race is reliable, followed if not (so workers loading side by side agree)."""

    def __init__(self, decisions: Decisions, batches: Sequence[Any], run: Callable[[Any, Any], Any], machine: str):
        self.decisions = decisions
        self.batches = batches
        self.run = run
        self.machine = machine

    def __call__(self, forwards: Sequence[Any], what: object, rounds: int = ROUNDS) -> Race:
        """``run_race`` of ``forwards``, or the race an earlier load on this machine kept of ``what``."""
        key = self._key(what, rounds)
        earlier = self.decisions.recall(key, Race.from_record)
        if earlier is not None and not earlier.disturbed:
            return earlier
        raced = run_race(forwards, self.batches, self.run, rounds=rounds)
        if earlier is not None and raced.disturbed:
            return earlier
        self.decisions.keep(key, raced.record())
        return raced

    def earlier(self, what: object, rounds: int = ROUNDS) -> Race | None:
        """The race of ``what`` an earlier load on this machine kept, if its times were reliable."""
        earlier = self.decisions.recall(self._key(what, rounds), Race.from_record)
        return None if earlier is None or earlier.disturbed else earlier

    def _key(self, what: object, rounds: int) -> str:
        return self.decisions.key("race", what, rounds, IN_A_ROW, self.machine, batches=self.batches)
