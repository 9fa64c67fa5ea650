"""The benchmarks' shared harness: percentiles, CSV/PNG/markdown writers, the run header and the log.

Every run prints (and saves beside its CSV) the exact command line and configuration first, so a
number can always be traced back to how it was produced.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench_results"
MIN_TICKS = 200  # /proc/stat ticks (1/100 s per core) a block must span for OtherCpu to report


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99 and mean of ``values`` (e.g. latencies in ms)."""
    mean = sum(values) / len(values) if values else math.nan
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99), "mean": mean}


def git_revision() -> str:
    """Commit plus "+dirty" when the tree has changes: uncommitted code is what was measured."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}+dirty" if dirty else rev


# What the numbers depend on: bf16 is fast only with avx512_bf16 / amx_bf16, int8 only with VNNI / amx_int8.
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_flags() -> tuple[str, dict[str, str]]:
    """The first processor's model name and flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields.get("model name", ""), fields


def cpu_model() -> str:
    return cpu_flags()[0] or "unknown"


def cpu_isa() -> list[str]:
    flags = set(cpu_flags()[1].get("flags", "").split())
    return [flag for flag in CPU_ISA_FLAGS if flag in flags]


def command_line() -> list[str]:
    """How this process was started: ``python -m benchmarks.NAME ...`` for a benchmark run as a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    started = ["-m", spec.name] if spec is not None and spec.name != "__main__" else sys.argv[:1]
    return [sys.executable, *started, *sys.argv[1:]]


def run_header(args: Any, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Print the command line, the parsed arguments and the environment; return them for saving."""
    import torch

    header = {
        "command": shlex.join(command_line()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "git": git_revision(),
        "loadavg_1m": round(os.getloadavg()[0], 2),  # other work on the box skews every number below
        **(extra or {}),
    }
    log(f"command: {header['command']}")
    for key, value in header.items():
        if key != "command":
            log(f"  {key}: {json.dumps(value, default=str)}")
    warn_if_busy()
    return header


def warn_if_busy(seconds: float = 1.0, limit: float = 0.2) -> None:
    """Say so when other work is running: on 2 cores one more busy process skews timings by 10x or more.

    Samples /proc/stat for ``seconds`` (the load average lags by minutes); silent where there is no /proc."""
    busy = cpu_busy_fraction(seconds)
    if busy is not None and busy > limit:
        log(f"WARNING: the CPU was {busy:.0%} busy with other work just before this run; the timings below "
            "are skewed (see also loadavg_1m)")


def cpu_busy_fraction(seconds: float) -> float | None:
    """Fraction of all cores busy over ``seconds`` (this process sleeps meanwhile), or None off Linux."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


class OtherCpu:
    """How busy the machine was with processes outside ours while a block ran, from /proc (Linux).

    ``roots``: our pids; they and their descendants are "ours" (e.g. this process plus the TorchServe
    frontend, whose workers are its children). ``percent`` is the rest, as a share of all cores: on a
    2-core box a few percent of other work already shows in the timings. None off Linux, or for a block
    under about a second on 2 cores (the kernel counts CPU time in 10 ms ticks).
    """

    def __init__(self, roots: set[int] | None = None):
        self.roots = roots or {os.getpid()}
        self.percent: float | None = None

    def __enter__(self) -> OtherCpu:
        self._start = _cpu_snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _cpu_snapshot()
        if self._start is None or end is None:
            return
        (busy0, total0, procs0), (busy1, total1, procs1) = self._start, end
        if total1 - total0 < MIN_TICKS:  # clock-tick accounting: too short a block to say anything
            return
        ours = _descendants(procs1, self.roots)
        our_ticks = sum(procs1[pid][1] - procs0.get(pid, (0, 0))[1] for pid in ours)
        self.percent = round(100 * max(0, busy1 - busy0 - our_ticks) / max(1, total1 - total0), 1)


def _cpu_snapshot() -> tuple[int, int, dict[int, tuple[int, int]]] | None:
    """(busy ticks, total ticks) over all cores, and pid -> (ppid, CPU ticks) per process."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()
            # utime + stime, plus cutime + cstime: reaped children (compiler runs) count for their parent.
            procs[int(stat.parent.name)] = (int(after_name[1]), sum(int(v) for v in after_name[11:15]))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return sum(fields) - fields[3] - fields[4], sum(fields), procs


def _descendants(procs: dict[int, tuple[int, int]], roots: set[int]) -> set[int]:
    found, frontier = set(roots) & set(procs), set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


def pids_with_arg(text: str) -> set[int]:
    """Processes whose command line contains ``text`` (e.g. a run directory only our server was given)."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def apply_settings(data: dict[str, Any], settings: Sequence[str]) -> dict[str, Any]:
    """``data`` (a parsed model YAML) with each ``key.sub=value`` of ``settings`` set, the value read as YAML."""
    import yaml

    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise SystemExit(f"--set {setting!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = yaml.safe_load(value)
    return data


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """One row per mapping; columns in first-seen order over all rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    log(f"wrote {path}")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_plot(path: Path, title: str, categories: Sequence[str],
               panels: Sequence[tuple[str, Mapping[str, Sequence[float]]]], kind: str = "bar") -> Path | None:
    """Grouped bars (or lines) per category, one subplot per ``(ylabel, {series: values})`` panel.

    matplotlib is imported here, not at module level, so the benchmarks run (minus the PNG) without it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log(f"no plot ({exc}); install the bench extra: pip install -e '.[bench]'")
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.2 * len(categories) + 3), 3.6 * len(panels)),
                             squeeze=False)
    for ax, (ylabel, series) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, categories, series, kind)
        ax.set_ylabel(ylabel)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote {path}")
    return path


def _draw_panel(ax: Any, categories: Sequence[str], series: Mapping[str, Sequence[float]], kind: str) -> None:
    positions = range(len(categories))
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        if kind == "line":
            ax.plot(list(positions), values, marker="o", label=name)
        else:
            offset = (index - (len(series) - 1) / 2) * width
            ax.bar([p + offset for p in positions], values, width=width, label=name)
    ax.set_xticks(list(positions))
    ax.set_xticklabels(categories, rotation=20, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncols=min(4, len(series)))


def profile_venv(profile: str, has: str) -> Path:
    """A benchmark-only profile's venv (``scripts/setup.sh --profile PROFILE``: built the first time, outside the
    clone, never in CI), found or built; its path. ``has``: a file under the venv a working one holds."""
    started = time.monotonic()
    log(f"finding or building the {profile} venv: bash scripts/setup.sh --profile {profile}")
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--profile", profile], cwd=REPO,
                          stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr as it comes
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines or not (Path(lines[-1]) / has).is_file():
        raise SystemExit(f"scripts/setup.sh --profile {profile} failed (exit {done.returncode})")
    log(f"{profile} venv {lines[-1]} ready in {time.monotonic() - started:.0f}s")
    return Path(lines[-1])
