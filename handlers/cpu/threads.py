"""How many threads a worker may run, asked at load time: the cores it may use (CPU affinity, a container's CPU
limit), shared among the model's workers, and whether it shares them with the other workers forward by forward
(``handlers.cpu.core_share``)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from handlers.config import Choice
from handlers.cpu import core_share as core_share_module


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
    (``handlers.cpu.core_share``); None where the count is fixed: configured, set per pinned worker by a launcher
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
