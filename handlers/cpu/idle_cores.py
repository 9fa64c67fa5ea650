"""A small forward that follows idle cores runs on one thread, where the cores are virtual.

A forward's OpenMP threads sleep once their spin after the last forward ends, and the next forward's first parallel
region waits for all of them. Under a hypervisor an idle virtual CPU is given up, and getting it back took ~10 ms
on a 2-core KVM guest: after 100 ms of idleness a lone short request ran about 3x as fast on one thread as on two,
while back to back two threads stay the faster (docs/performance.md), so only a forward after idleness changes.

What counts: the worker's own idleness (no forward of its own for ``idle_s``) and the batch's tokens (rows x length
as it arrives, at most ``small_tokens``: a few short texts, where one thread costs little even with every core
awake). Where the CPU does not say it runs under a hypervisor the rule is off: waking a thread on bare metal costs
microseconds. The forward runs at the fewest threads the served forward was proven at (a compiled rung is proven at
one thread too: ``handlers.cpu.core_share``), so no new graph is ever traced for it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# OpenMP's threads spin for a few ms after a forward; past that they sleep (measured on a Zen 4 EPYC: after 4 ms two
# threads were still the faster, after 20 ms one thread matched them at the median and beat them at p90).
IDLE_S = 0.02
# One short text is 10-30 tokens; at 1 x 128 after idleness one thread still won for int8 (12.8 against 18.5 ms)
# but would lose back to back by more (11.3 against 6.7): the rule keeps to what costs little on any machine.
SMALL_TOKENS = 64
HYPERVISOR_FLAG = "hypervisor"  # /proc/cpuinfo's flag on a virtual CPU (KVM, Xen, Hyper-V, VMware)


@dataclass(frozen=True)
class IdleCores:
    """When a forward runs on fewer threads than its share: after ``idle_s`` without one, for ``small_tokens`` or
    fewer."""

    idle_s: float = IDLE_S
    small_tokens: int = SMALL_TOKENS

    def counts(self, runs_at: Collection[int] | None, tokens: int | None,
               idle_s: float | None) -> Collection[int] | None:
        """The thread counts this forward may be given: ``runs_at`` (the counts it was proven at, None for any), or
        only the fewest of them (one where any count works) for a small batch after idleness. ``tokens`` None: not
        known (the task does not run one forward per batch); ``idle_s`` None: no forward yet since the load."""
        if tokens is None or tokens > self.small_tokens or (idle_s is not None and idle_s < self.idle_s):
            return runs_at
        return (min(runs_at),) if runs_at else (1,)

    def describe(self) -> str:
        return (f"a batch of at most {self.small_tokens} tokens after {self.idle_s * 1000:g} ms without a forward runs "
                "on the fewest threads its forward was proven at: the cores are virtual, and waking an idle one for "
                "a second thread costs more than that forward")


def for_cpu(flags: Collection[str]) -> IdleCores | None:
    """The rule where the CPU's ``flags`` (``features.linux_cpu_flags``) say it is virtual, else None."""
    return IdleCores() if HYPERVISOR_FLAG in flags else None
