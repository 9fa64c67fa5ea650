"""What this worker's hardware can do, asked at load time (never at import): the precisions ``auto``
resolves to, and how many threads each worker may use without oversubscribing the cores."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers import core_share as core_share_module
from handlers.config import DType
from handlers.quantize import INT8_CPU_FEATURES, Int8Weights, int8_problem

# CPU features under which bf16 matmuls run in hardware (oneDNN uses AMX tiles or AVX512-BF16 dot products).
BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Choice:
    """A resolved setting and why it was chosen (shown in describe)."""

    value: object
    reason: str


def cpu_features(environ: Mapping[str, str] = os.environ) -> dict[str, bool]:
    """Which of the bf16 and int8 CPU features this process's kernels may use: those the CPU has, less those
    torch or oneDNN are held below (``features_held_back``)."""
    held = features_held_back(torch.backends.cpu.get_cpu_capability(), environ.get(ONEDNN_ISA_VAR))
    return {name: found and name not in held for name, found in cpu_has().items()}


def cpu_has() -> dict[str, bool]:
    """Which of the bf16 and int8 features the CPU has: torch's own detection (torch >= 2.9), else the kernel's
    CPU flags (torch 2.8, the ipex profile, has no such API); none known if neither answers."""
    names = BF16_CPU_FEATURES + INT8_CPU_FEATURES
    try:
        capability = torch._C._cpu._get_cpu_capability()
    except Exception:  # noqa: BLE001 -- a torch without this private API
        flags = linux_cpu_flags()
        return {name: name in flags for name in names}
    return {name: bool(capability.get(name)) for name in names}


def kernel_isa_limits(environ: Mapping[str, str] = os.environ) -> str | None:
    """Which features the CPU has but this process's kernels may not use, and why (for describe); else None."""
    aten, onednn = torch.backends.cpu.get_cpu_capability(), environ.get(ONEDNN_ISA_VAR)
    held = sorted(name for name, found in cpu_has().items() if found and name in features_held_back(aten, onednn))
    if not held:
        return None
    return f"held back here: {'/'.join(held)} (torch dispatches at {aten}, {ONEDNN_ISA_VAR}={onednn or 'unset'})"


# torch's and oneDNN's own switches that hold their kernels below what the CPU has (a workaround, or a test that
# stands in for an older CPU): a feature they may not use is one that does not pay, whatever the CPU flags say.
ATEN_VECTOR_ISAS_BELOW_AVX512 = ("DEFAULT", "NO AVX", "AVX2")
ONEDNN_ISA_VAR = "ONEDNN_MAX_CPU_ISA"
# oneDNN's instruction set levels (ONEDNN_MAX_CPU_ISA's values), and those whose kernels use each feature: each level
# is a set of extensions, not a rung of one ladder (AVX512_CORE has no AVX-VNNI; AVX10_2_512 has it, not AMX).
ONEDNN_ISA_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                      "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
_AMX_LEVELS = ("AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2")
_BF16_LEVELS = ("AVX512_CORE_BF16", "AVX10_1_512", *_AMX_LEVELS, "AVX10_2_512")
ONEDNN_LEVELS_USING = {
    "avx_vnni": ("AVX2_VNNI", "AVX2_VNNI_2", "AVX10_2_512", "AVX10_2_512_AMX_2"),
    "avx512_vnni": ("AVX512_CORE_VNNI", *_BF16_LEVELS),
    "avx512_bf16": _BF16_LEVELS,
    "amx_bf16": _AMX_LEVELS,
    "amx_int8": _AMX_LEVELS,
}
ONEDNN_ISA_LEVELS = frozenset(("SSE41", "AVX", "AVX2", "AVX512_CORE",
                               *(level for levels in ONEDNN_LEVELS_USING.values() for level in levels)))


def features_held_back(aten_capability: str, onednn_max_isa: str | None) -> frozenset[str]:
    """The bf16/int8 features no kernel of this process may use: AVX-512 and AMX ones when torch dispatches below
    AVX-512 (``ATEN_CPU_CAPABILITY``; inductor's generated code follows it), and those the level oneDNN is capped at
    leaves out (``ONEDNN_MAX_CPU_ISA``), as oneDNN runs the bf16 and int8 matmuls. An unknown level holds nothing."""
    held = set()
    if aten_capability.upper() in ATEN_VECTOR_ISAS_BELOW_AVX512:
        held.update(name for name in ONEDNN_LEVELS_USING if name.startswith(("avx512", "amx")))
    level = ONEDNN_ISA_ALIASES.get((onednn_max_isa or "").upper(), (onednn_max_isa or "").upper())
    if level in ONEDNN_ISA_LEVELS:
        held.update(name for name, levels in ONEDNN_LEVELS_USING.items() if level not in levels)
    return frozenset(held)


def linux_cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def linux_cpu_model() -> str:
    """The ``model name`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def machine(device: torch.device, threads: int) -> str:
    """What a race's times depend on besides the model (``handlers.memory`` keys races by it, so a compile cache on
    a volume that hosts of another kind share is raced again there): the device, the CPU's name and the bf16/int8
    features its kernels may use, torch's kernel level, the threads a worker runs."""
    if device.type == "cuda":
        return repr((torch.cuda.get_device_name(device), threads))
    usable = sorted(name for name, found in cpu_features().items() if found)
    return repr((linux_cpu_model(), usable, torch.backends.cpu.get_cpu_capability(), threads))


def resolve_precisions(requested: Sequence[DType], device: torch.device,
                       features: Mapping[str, bool] | None = None) -> Choice:
    """The precisions to try, fastest first (a tuple of DType). ``auto``: bf16 then fp32 on a CPU with bf16
    instructions (``features``: the CPU's, by default asked of torch) or a GPU that has bf16 (fp16 then fp32 on
    one that has not), fp32 alone on other CPUs; never int8. A list: as configured, ``auto`` in it expanded so
    (``[int8, auto]``: int8, then what auto picks), less int8 where it cannot run (a GPU, or no torchao); the
    reason says which. On a CPU without int8 dot products int8 is tried with 7-bit weights (``int8_weights``)."""
    limits = None
    if features is None:
        features, limits = cpu_features(), kernel_isa_limits()
    auto = _auto_precisions(device, features)
    if limits is not None and device.type == "cpu":
        auto = Choice(auto.value, f"{auto.reason}; {limits}")
    if tuple(requested) == (DType.AUTO,):
        return auto
    expanded = tuple(dict.fromkeys(p for dtype in requested for p in (auto.value if dtype is DType.AUTO else (dtype,))))
    reason = "configured" + (f" ({auto.reason})" if DType.AUTO in requested else "")
    problem = int8_problem(device) if DType.INT8 in expanded else None
    if problem is None:
        return Choice(expanded, reason)
    kept = tuple(dtype for dtype in expanded if dtype is not DType.INT8)
    if not kept:
        return Choice((DType.FLOAT32,), f"configured int8 alone, but {problem}; fp32, the reference")
    return Choice(kept, f"{reason}, less int8: {problem}")


def int8_weights(features: Mapping[str, bool] | None = None) -> Int8Weights:
    """The range the int8 rung's weights take on this CPU (its usable ``features``): full where it has int8 dot
    products, 7 bits where oneDNN's int16 pair sums would saturate."""
    return Int8Weights.for_cpu(cpu_features() if features is None else features)


def _auto_precisions(device: torch.device, features: Mapping[str, bool]) -> Choice:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice((DType.BFLOAT16, DType.FLOAT32),
                          "auto: the GPU has bf16; fp32 where bf16 fails the gate or is no faster")
        return Choice((DType.FLOAT16, DType.FLOAT32),
                      "auto: the GPU has no bf16; fp16, fp32 where it fails the gate or is no faster")
    found = [name for name in BF16_CPU_FEATURES if features.get(name)]
    if found:
        return Choice((DType.BFLOAT16, DType.FLOAT32),
                      f"auto: the CPU has {'/'.join(found)}; fp32 where bf16 fails the gate or is no faster")
    return Choice((DType.FLOAT32,), f"auto: the CPU has none of {'/'.join(BF16_CPU_FEATURES)}, so bf16 would be "
                                   "emulated")


def available_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity (taskset, a CPU-manager pinning), capped by the container's
    CPU limit (a cgroup CPU quota: a Kubernetes ``limits.cpu`` of 2 on a 64-core node allows 2 cores' time, and
    64 threads would spend it all in OpenMP barriers)."""
    cores = len(_affinity())
    quota = cpu_quota(cgroup_root)
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU limit in cores from cgroup v2 ``cpu.max`` (or v1's CFS quota); None when there is none."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (cgroup_root / quota_file).read_text().split()
            if period_file is not None:
                fields.append((cgroup_root / period_file).read_text().strip())
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1"):
            return None
        try:
            return int(fields[0]) / int(fields[1])
        except ValueError:
            return None
    return None


def resolve_threads(requested: int | None, workers: int, device: torch.device,
                    environ: Mapping[str, str] = os.environ) -> Choice:
    """Intra-op threads for this worker: as configured; else OpenMP's own setting for this process
    (``OMP_NUM_THREADS``, which TorchServe's cpu launcher sets per pinned worker); else the usable cores shared
    among the model's workers, at least one."""
    if requested is not None:
        return Choice(requested, "configured")
    omp = environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return Choice(int(omp), f"auto: OMP_NUM_THREADS={omp} in this worker's environment")
    cores = available_cores()
    if device.type != "cpu":
        return Choice(min(cores, 4), "auto: a GPU worker needs few CPU threads")
    threads = max(1, cores // max(1, workers))
    return Choice(threads, f"auto: {cores} usable cores (CPU affinity and limit) / {workers} worker(s) (minWorkers)")


def core_share(requested: int | None, device: torch.device,
               environ: Mapping[str, str] = os.environ) -> core_share_module.CoreShare | None:
    """Where ``threads: auto`` shares this machine's cores with the other workers forward by forward
    (``handlers.core_share``); None where the count is fixed: configured, set per pinned worker by a launcher
    (``OMP_NUM_THREADS``), or a GPU worker's."""
    omp = environ.get("OMP_NUM_THREADS", "")
    if requested is not None or (omp.isdigit() and int(omp) > 0) or device.type != "cpu":
        return None
    share = core_share_module.for_cores(available_cores(), _affinity())
    return share if share.joined else None


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return frozenset(range(os.cpu_count() or 1))


def cpp_compiler_problem(device: torch.device) -> str | None:
    """Why inductor cannot compile for this CPU worker, or None. Inductor on CPU builds C++ kernels, so it
    needs a working compiler ($CXX, else g++); a worker image without one would otherwise trace for seconds
    before failing at code generation, for each compile rung."""
    if device.type != "cpu":
        return None
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 -- InvalidCxxCompiler, or a torch that moved the helper
        tried = os.environ.get("CXX", "g++")
        return (f"inductor on cpu needs a C++ compiler and none works here (tried {tried!r}: "
                f"{type(exc).__name__}); install g++ in the worker image, or set CXX")
    return None
