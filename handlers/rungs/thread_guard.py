"""One compiled graph for every thread count the core share gives a forward (``handlers.cpu.core_share``).

Dynamo guards torch's global state as one guard: grad mode, autocast, deterministic algorithms, the default dtype,
and the intra-op thread count. So a compiled forward called at another thread count compiled again: a second set of
graphs (a frozen int8 graph with a second copy of its packed weights), and per count ~2 s of load for MiniLM in fp32,
~7 s in int8. Inductor's CPU kernels built with ``cpp.dynamic_threads`` run at whatever count is set, so such
a compile leaves that guard out (``guard_filter_fn``; torch 2.8 cannot, and keeps compiling per count), and the
forward checks the rest of the global state itself: a call under a global state that differs from the first call's
in anything but the thread count raises ``GlobalStateChanged``, which the engine serves eagerly, as any failing
optimized forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_GUARD = "GLOBAL_STATE"  # the guard type dynamo gives torch's global state
_THREADS = "num_threads"  # what GlobalStateGuard.reason() names the intra-op thread count


class GlobalStateChanged(RuntimeError):
    """A compiled forward that no longer guards torch's global state was called under another one."""


def guard_can_be_left_out() -> bool:
    """Whether this torch lets a compile leave out the global-state guard (torch 2.9 on; 2.8 always adds it)."""
    from torch._dynamo.guards import GuardBuilder  # imports dynamo: only once a compile is wanted

    return hasattr(GuardBuilder, _GUARD)


def without_global_state_guard(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn`` for ``torch.compile``: every guard but the global state's."""
    return [entry.guard_type != _GUARD for entry in entries]


def checked(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (compiled without the global-state guard), refusing a call whose global state differs from its
    first call's in anything but the thread count. ~1 us per call at the first call's count, a few more at another."""
    from torch._C._dynamo.guards import GlobalStateGuard

    first: list[Any] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.append(GlobalStateGuard())
        elif not first[0].check():
            changed = sorted(set(first[0].reason().split()) - {_THREADS})
            if changed:
                raise GlobalStateChanged(f"torch's global state changed since the forward was compiled "
                                         f"({', '.join(changed)}), and its compile does not guard it")
        return forward(*args, **kwargs)

    return call
