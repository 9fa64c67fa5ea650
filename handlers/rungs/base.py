"""What every rung provides (``Rung``), and the eager rung, which always works.

A rung is one way to run the model: it says whether it can run here (``unavailable_reason``) and wraps a module at
a precision (``apply``). ``apply`` may be lazy (``torch.compile`` is), so the ladder proves every rung by running it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from handlers.config import DType, RungName
from handlers.rungs import module_guards

Forward = Callable[..., Any]


class Rung(ABC):
    """One way to run the model. ``apply`` may be lazy; the ladder proves it with warmup + the quality gate."""

    name: str
    # Whether ``apply`` compiles with dynamo, lazily: the ladder checks that its warmup compiled everything (a second
    # pass compiles nothing new, no frame given up) and resets dynamo when it fails.
    compiles = False
    # Whether the walk hands ``apply`` the fp32 model whatever the precision (the rung converts it itself).
    takes_float32 = False
    # Whether, once accepted, it races the next racing rung of the ladder (compile against openvino): the faster
    # serves (``handlers.ladder.plan``).
    races = False
    # Whether its half precision is its own rather than eager's (OpenVINO's hint keeps sensitive layers wider): then
    # eager's screen of that precision does not rule it out (``handlers.ladder.plan``, rule 8).
    own_precision = False
    # Run before this rung's forward where a routed forward switches to it from another rung's (None: nothing).
    before_switching_in: Callable[[], Any] | None = None

    def unavailable_reason(self) -> str | None:
        """Why this rung cannot be tried here, or None when it can."""
        return None

    def prepare(self, batches: Sequence[Any]) -> None:
        """Told the warmup batches before any attempt (a rung that converts the module takes an example from them)."""
        return None

    def identity(self) -> object:
        """What the forwards this rung builds depend on besides the model (its options, e.g. a compile's ``spec``):
        part of a kept race's key."""
        return repr(getattr(self, "spec", None))

    def runs_in(self, dtype: DType) -> bool:
        """Whether this rung takes a model in ``dtype`` at all. int8 is for compile rungs alone: inductor fuses
        the activations' quantization and rescaling around each int8 matmul; run eagerly or by IPEX, int8 is
        slower than the float precisions."""
        return dtype is not DType.INT8

    @abstractmethod
    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        """``module`` (already in ``dtype``) run this way."""

    def follows_threads(self) -> bool:
        """Whether what ``apply`` builds runs at any intra-op thread count as it was proven (handlers.cpu.core_share);
        else at the count it was built at, unless the ladder proves it at others too."""
        return False

    def keeps_kernels_per_shape(self, dtype: DType) -> bool:
        """Whether what ``apply`` builds in ``dtype`` runs its matmuls through oneDNN, which keeps a primitive per
        input shape (handlers.config.shapes: the lengths it sees are then rounded). Half precisions and int8 do; float32
        goes through MKL, which keeps nothing per shape."""
        return dtype is not DType.FLOAT32

    def notes(self, device: torch.device) -> list[str]:
        """Things the configured rung cannot do on this device, for describe."""
        return []

    def warmup_context(self, batches: int) -> contextlib.AbstractContextManager:
        """Settings the warmup of ``batches`` batches runs under (for compile rungs: while graphs are traced)."""
        return contextlib.nullcontext()

    def without_module_guards(self) -> Rung:
        """This rung, leaving out dynamo's guards on the model's attributes where it compiles
        (``handlers.rungs.module_guards``); a rung that does not compile is itself."""
        return self

    def module_guard_filter(self, dtype: DType) -> module_guards.GuardFilter | None:
        """What left the module guards out of the graphs compiled in ``dtype``; None where nothing did."""
        return None


class EagerRung(Rung):
    name = RungName.EAGER.value

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        return module

    def follows_threads(self) -> bool:
        return True
