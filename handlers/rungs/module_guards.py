"""Fewer guards for a model whose Python state stays put: dynamo's guards on its modules' attributes left out.

A compiled forward checks, on every call, every Python value its graph was traced from: each layer norm's ``eps``,
each dropout's ``p``, the config's flags, each module's type and hooks. For MiniLM that is 937 guard managers, 115
of them Python lambdas, ~0.6 ms of a lone short forward on an AVX2 EPYC (docs/performance.md). They only matter
if those values change after the compile, which a served model's never do unless its own forward changes them (a
call counter, a position kept on ``self``). So the ladder looks: ``run_watching_state`` compares the model's
Python state after its first and its last eager reference forward (the gate's answers, run anyway). A model that
kept it is compiled with ``guard_filter_fn=without_module_guards``; one that changed any value keeps every guard,
and describe names what changed. Guards on the inputs, on torch's global state and on globals all stay.

Two compiled copies of one class (a small batches' graph, int8 and its rival) share the frame's cache, and only
guards on the module tell their graphs apart: a frozen copy would run the other's weights, a model of another
structure would run a graph that is not its own. So the root module's type and the identity of its first weight
stay guarded; a compile without both (its weights are graph inputs, guarded by dtype and shape only, where inductor
does not freeze them) keeps every guard.
Pure torch; no TorchServe import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

# Checked with torch 2.13. torch 2.8 (the ipex profile) reads every guard's value to hand it to the filter, and the
# guard that an attribute is absent (BERT's config has no is_causal) raises there: the compile fails.
FIRST_TORCH = (2, 13)
# How deep the state follows plain objects hanging off a module (its config, a config's sub-config).
DEPTH = 4
_PLAIN = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)


def unsupported_reason() -> str | None:
    """Why this torch keeps every guard (None: the module guards can be left out here)."""
    if torch.torch_version.TorchVersion(torch.__version__) >= FIRST_TORCH:
        return None
    return (f"torch {torch.__version__} fails a compile whose guards are filtered where an attribute is absent "
            f"(needs torch >= {'.'.join(map(str, FIRST_TORCH))})")


def state_of(module: torch.nn.Module) -> dict[str, Any]:
    """The Python values of every submodule, by path: plain values as themselves, tensors and submodules by
    identity, containers and plain objects (a config) followed ``DEPTH`` levels; anything else by identity."""
    state: dict[str, Any] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        for key, value in vars(submodule).items():
            _record(f"{name}.{key}" if name else key, value, state, DEPTH, set())
    return state


def _record(path: str, value: Any, state: dict[str, Any], depth: int, seen: set[int]) -> None:
    if isinstance(value, float):
        state[path] = value.hex()  # a NaN equals itself this way
    elif isinstance(value, _PLAIN):
        state[path] = value
    elif isinstance(value, (torch.Tensor, torch.nn.Module)) or depth == 0 or id(value) in seen:
        state[path] = ("id", id(value))
    elif isinstance(value, Mapping):
        state[path] = (type(value), len(value))
        for key, item in value.items():
            _record(f"{path}[{key!r}]", item, state, depth - 1, seen | {id(value)})
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        state[path] = (type(value), len(value))
        for index, item in enumerate(items):
            _record(f"{path}[{index}]", item, state, depth - 1, seen | {id(value)})
    elif hasattr(value, "__dict__") and not callable(value):
        state[path] = (type(value), id(value))
        for key, item in vars(value).items():
            _record(f"{path}.{key}", item, state, depth - 1, seen | {id(value)})
    else:
        state[path] = ("id", id(value))


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The paths whose values differ, or that one state has and the other not (sorted)."""
    return sorted(path for path in before.keys() | after.keys()
                  if path not in before or path not in after or before[path] != after[path])


def run_watching_state(module: torch.nn.Module, batches: Sequence[Any], run: Callable[[Any, Any], Any],
                       ) -> tuple[list[Any], list[str]]:
    """``run(module, batch)`` for each batch, and the paths of the module's state that differ between after the
    first call and after the last. The first call may set things up once (a cached table, a warning's flag): only
    what changes again counts. With one batch it is run a second time, to have something to compare."""
    results = [run(module, batches[0])]
    after_first = state_of(module)
    results.extend(run(module, batch) for batch in batches[1:])
    if len(batches) == 1:
        run(module, batches[0])
    return results, changes(after_first, state_of(module))


class GuardFilter:
    """``without_module_guards`` as a ``guard_filter_fn`` that counts the compiled graphs it left the module guards
    out of and those it kept every guard of (describe)."""

    def __init__(self) -> None:
        self.left_out = 0
        self.kept = 0

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        keep = without_module_guards(entries)
        if all(keep):
            self.kept += 1
        else:
            self.left_out += 1
        return keep


def without_module_guards(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn``: every guard but those on the compiled module's attributes, except those that tell two
    compiled copies of one class apart: ``self``'s type, and the identity of the first weight it reads (each copy
    has its own; when a weight is freed, dynamo drops every graph that guarded it by identity, so a later model
    whose weight comes at the same address cannot run a dead one's graph). Every guard where either is missing: a
    compiled function, weights that are the graph's inputs (guarded by dtype and shape, which a model of another
    structure can share)."""
    on_module = [entry.orig_guard.source.is_unspecialized_nn_module() for entry in entries]
    own_type = next((index for index, entry in enumerate(entries)
                     if on_module[index] and entry.guard_type == "TYPE_MATCH" and entry.name == "self"), None)
    own_weight = next((index for index, entry in enumerate(entries)
                       if on_module[index] and entry.guard_type == "ID_MATCH" and entry.name.startswith("self.")
                       and "._parameters[" in entry.name), None)
    if own_type is None or own_weight is None:
        return [True] * len(entries)
    return [not module or index in (own_type, own_weight) for index, module in enumerate(on_module)]
