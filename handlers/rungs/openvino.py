"""The openvino rung: the task's module exported with ``torch.export``, converted by OpenVINO and compiled for the CPU.

OpenVINO is Intel's maintained CPU inference runtime. It runs bf16 on AMX and AVX-512-BF16 CPUs by its precision hint
and keeps one compiled model for every input shape (dynamic batch and sequence axes). The module is exported with
``torch.export`` rather than traced with TorchScript: export refuses Python control flow that depends on the data,
where a trace would bake in the branch the example took.

The IR a conversion makes, and OpenVINO's compiled blobs, are kept beside the compile cache (``openvino_ir``), so a
second worker of the model reads the IR instead of exporting and converting again.

openvino is imported only when the rung is tried, and its telemetry is turned off before anything converts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

from handlers.config import DType, RungName
from handlers.cpu.openmp_pause import OpenMPPause
from handlers.rungs import openvino_ir
from handlers.rungs.exporting import example_batch, export, fixed_axes, structure
from handlers.rungs.base import Forward, Rung

logger = logging.getLogger(__name__)

OPENVINO_MODULE = "openvino"
# A single stream, its latency hint: a worker runs one batch at a time (TorchServe batches the requests), so every
# thread it is given goes to that batch; the throughput hint would split them into streams that wait for requests.
PERFORMANCE_HINT = "LATENCY"
# OpenVINO's names of the precisions the rung runs in. float32 weights are converted in both: with the bf16 hint
# OpenVINO keeps the layers bf16 would cost (normalizations, softmax) in f32 itself.
PRECISION_HINTS = {DType.BFLOAT16: "bf16", DType.FLOAT32: "f32"}


@functools.cache
def probe_openvino() -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` when openvino imports, its telemetry turned off; else ``(None, reason)``. Once per process."""
    if importlib.util.find_spec(OPENVINO_MODULE) is None:
        return None, f"{OPENVINO_MODULE} is not installed (it is in the default profile: scripts/setup.sh)"
    try:
        openvino = importlib.import_module(OPENVINO_MODULE)
        _telemetry_off()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- any failure means: no OpenVINO here
        return None, f"{OPENVINO_MODULE} failed to import: {type(exc).__name__}: {exc}"
    return openvino, None


def _telemetry_off() -> None:
    """OpenVINO's converter sends usage events unless a consent file in the home directory says no. A server must
    send nothing: point the converter at the stub OpenVINO itself uses where its telemetry package is absent."""
    stub = importlib.import_module("openvino.tools.ovc.telemetry_stub")
    for name in ("openvino.tools.ovc.convert_impl", "openvino.tools.ovc.telemetry_utils"):
        importlib.import_module(name).tm = stub


class OpenVinoRung(Rung):
    """The module converted by OpenVINO at the first warmup batch and compiled for the CPU at the rung's precision."""

    name = RungName.OPENVINO.value
    takes_float32 = True  # converted from fp32 weights; the precision is OpenVINO's hint
    races = True
    own_precision = True  # its bf16 hint keeps the precision-sensitive layers wider than eager in bf16 does

    def __init__(self, device: torch.device, cache_dir: str | None = None, skip_reason: str | None = None):
        # Where a routed forward switches to OpenVINO from a compiled one, torch's OpenMP threads still spin on the
        # cores for ~3 ms (libgomp's default) and OpenVINO's threads wait for them: they are ended first.
        pause = OpenMPPause()
        self.before_switching_in = pause if pause.available else None
        self.device = device
        self.cache_dir = Path(cache_dir) / openvino_ir.DIRECTORY if cache_dir else None
        self._skip_reason = skip_reason
        self._example: Mapping[str, torch.Tensor] | None = None
        self._fixed: dict[str, tuple[int, ...]] = {}  # per input, the axes exported at the warmup's one size
        self._keys: dict[int, tuple[torch.nn.Module, str]] = {}  # the IR's key per module (its weights hashed once)

    def identity(self) -> object:
        openvino, _ = probe_openvino()
        return ("openvino", getattr(openvino, "__version__", None), PERFORMANCE_HINT)

    def prepare(self, batches: Sequence[Any]) -> None:
        self._example = example_batch(batches)
        self._fixed = fixed_axes(batches)
        self._keys.clear()

    def unavailable_reason(self) -> str | None:
        if self._skip_reason:
            return self._skip_reason
        if self.device.type != "cpu":
            return f"the openvino rung runs on CPU only; this worker uses {self.device}"
        reason = probe_openvino()[1]
        if reason is None and self._example is None:
            return "the openvino rung converts the module on a warmup batch of named tensors; this task has none"
        return reason

    def runs_in(self, dtype: DType) -> bool:
        return dtype in PRECISION_HINTS

    def keeps_kernels_per_shape(self, dtype: DType) -> bool:
        return True  # OpenVINO's CPU plugin keeps its kernels per input shape: rounded lengths keep them few

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        openvino, reason = probe_openvino()
        if openvino is None or self._example is None:
            raise RuntimeError(reason or "no example batch to convert the module on")
        started = time.perf_counter()
        store = openvino_ir.IrStore(self.cache_dir, self._key(module, openvino.__version__))
        model = store.read(openvino)
        said = "read from the cache"
        if model is None:
            with _root_logging_kept():
                model = openvino.convert_model(export(module, self._example, self._fixed))
            store.write(openvino, model)
            said = "exported and converted"
        converted = time.perf_counter()
        compiled = openvino.Core().compile_model(model, "CPU", self.config(dtype))
        logger.info("openvino: %s in %.1fs, compiled (%s, %d thread(s), %s) in %.1fs", said, converted - started,
                    PRECISION_HINTS[dtype], torch.get_num_threads(), PERFORMANCE_HINT,
                    time.perf_counter() - converted)
        return OpenVinoForward(compiled, list(self._example), structure(module, self._example))

    def _key(self, module: torch.nn.Module, version: str) -> str:
        """The IR's key, hashed once per module: each precision converts the same fp32 module."""
        if self._keys.get(id(module), (None,))[0] is not module:
            assert self._example is not None
            self._keys[id(module)] = (module, openvino_ir.key(module, self._example, version, self._fixed))
        return self._keys[id(module)][1]

    def config(self, dtype: DType) -> dict[str, Any]:
        """OpenVINO's CPU settings for a forward in ``dtype``: its precision, the worker's threads, one stream."""
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[dtype],
                                  "INFERENCE_NUM_THREADS": torch.get_num_threads(),
                                  "PERFORMANCE_HINT": PERFORMANCE_HINT}
        if self.cache_dir is not None:
            config["CACHE_DIR"] = str(self.cache_dir / openvino_ir.BLOBS)
        return config


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    """OpenVINO's converter, when it fails, sets the root logger to ERROR and adds a handler of its own: every later
    warning of the worker would be lost. The root logger is put back as it was."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


class OpenVinoForward:
    """A compiled OpenVINO model called like the module: keyword tensors in, the module's output structure out.
    One infer request, one call at a time."""

    def __init__(self, compiled: Any, names: list[str], outputs: pytree.TreeSpec):
        self.compiled = compiled
        self.names = names  # the inputs, in the order they were exported
        self.outputs = outputs
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()

    def __call__(self, **inputs: torch.Tensor) -> Any:
        arrays = [_array(inputs[name]) for name in self.names]
        with self._lock:
            results = self._request.infer(arrays)
        flat = [torch.from_numpy(results[index]) for index in range(len(self.compiled.outputs))]
        return pytree.tree_unflatten(flat, self.outputs)


def _array(tensor: torch.Tensor) -> Any:
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()  # numpy has no bf16; the converted model takes float32
    return tensor.detach().cpu().contiguous().numpy()
