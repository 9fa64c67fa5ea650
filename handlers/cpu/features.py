"""What this machine's CPU can do, asked at load time (never at import): its bf16 and int8 instructions, those
torch's and oneDNN's kernels may use here, its name, and whether inductor can build C++ kernels on it."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

# CPU features under which bf16 matmuls run in hardware (oneDNN uses AMX tiles or AVX512-BF16 dot products).
BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")
# CPU features that give oneDNN int8 dot products (without them its u8 x s8 products sum into a saturating int16).
INT8_CPU_FEATURES = ("amx_int8", "avx512_vnni", "avx_vnni")


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
    """What a race's times depend on besides the model (``handlers.ladder.decisions`` keys races by it, so a compile
    cache on a volume that hosts of another kind share is raced again there): the device, the CPU's name and the
    bf16/int8 features its kernels may use, torch's kernel level, the threads a worker runs."""
    if device.type == "cuda":
        return repr((torch.cuda.get_device_name(device), threads))
    usable = sorted(name for name, found in cpu_features().items() if found)
    return repr((linux_cpu_model(), usable, torch.backends.cpu.get_cpu_capability(), threads))

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
