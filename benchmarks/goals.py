"""The speed goals, checked in one command: their benchmarks run on this machine, each goal met or missed.

Why: the goals are read off three benchmarks (the model alone, end to end through TorchServe beside the stock-style
baseline and the Infinity embedding server, a lone request's parts), each with its own command and table. This runs
them as docs/performance.md quotes them, one after the other, then says for every goal what this run measured, the
bound, and whether it was met, with the CPU's flags:

    .venv/bin/python -m benchmarks.goals [--out bench_results/goals] [--no-peers] [--from DIR]

    benchmarks.model     eager fp32, the float rung (bf16 frozen where the CPU has bf16, else fp32 frozen), the int8
                         rung's form, ONNX Runtime fp32 and int8, the openvino rung's form, and what each shipped
                         archive serves here (the ladder's race of openvino and compile decides): 40 timed calls x 5
                         rounds at 1 and 8 texts of 16 and 128 tokens
    benchmarks.e2e       the default and the int8 archive, the baseline and (unless --no-peers) Infinity's torch and
                         ONNX Runtime engines: short texts, ~120 tokens and mixed lengths, 1 and 16 clients
    benchmarks.overhead  a lone short request back to back, for each archive: client, TorchServe, handle(), forward

Each runs as ``python -m benchmarks.NAME`` from the repository's root, as docs/performance.md quotes it.

Which goals apply depends on the CPU. The speed-ups, p99 below the baseline's and the model-alone bounds are goals
where it has bf16 and int8 dot products (avx512_bf16 with VNNI, or AMX), the CPUs they are set for; elsewhere they are
reported against no goal. The rest (the peers, a lone request, the answers within the gate) are goals everywhere.
``--from DIR`` reads an earlier run's outputs (model.json, e2e.json, overhead-default.csv, overhead-int8.csv) instead
of running anything.

Writes goals.md, goals.csv and goals.png (each goal's margin: 1 or more is met) under --out, beside the runs' own
outputs. The verdicts are this run's: these VMs' speed moves by about 10 % between runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import CPU_ISA_FLAGS, DEFAULT_OUT, REPO, cpu_isa, log, markdown_table, write_csv, write_plot

DEFAULT_CONFIG = REPO / "model_configs" / "minilm-embeddings.yaml"
INT8_CONFIG = REPO / "model_configs" / "minilm-embeddings-int8.yaml"
OURS = "minilm"  # benchmarks.e2e's name for the default archive; the int8 archive is served as INT8
INT8 = "int8"
BASELINE = "baseline"
PEERS = ("infinity-torch", "infinity-optimum")


@dataclass(frozen=True)
class Goal:
    """One goal: ``measured`` against ``bound``, met when at most it (``at_most``) or at least it."""

    name: str
    measured: float | None
    bound: float
    at_most: bool
    applies: bool  # a goal on this CPU; else reported against no goal
    detail: str = ""
    label: str = ""  # a few words for the plot

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "not measured"
        if not self.applies:
            return "reported (no goal on this CPU)"
        return "met" if self.met else "missed"

    @property
    def met(self) -> bool:
        if self.measured is None:
            return False
        return self.measured <= self.bound if self.at_most else self.measured >= self.bound

    @property
    def margin(self) -> float | None:
        """1 or more where met: bound / measured for an upper bound, measured / bound for a lower one."""
        if not self.measured or not self.bound:
            return None
        return self.bound / self.measured if self.at_most else self.measured / self.bound

    def row(self) -> dict[str, Any]:
        bound = f"{'<=' if self.at_most else '>='} {self.bound:g}"
        return {"goal": self.name, "measured": self.measured, "bound": bound, "verdict": self.verdict,
                "detail": self.detail}


def int8_dot_products_and_bf16(isa: Sequence[str]) -> bool:
    """The CPUs the speed goals are set for: bf16 and int8 dot products (AVX512-BF16 with VNNI, or AMX)."""
    return ("avx512_bf16" in isa and "avx512_vnni" in isa) or ("amx_bf16" in isa and "amx_int8" in isa)


def model_variants(isa: Sequence[str]) -> list[str]:
    """benchmarks.model's variants for this CPU: the float and int8 rungs as the archives build them here."""
    bf16 = "avx512_bf16" in isa or "amx_bf16" in isa
    return ["eager-fp32", "compile-dynamic-bf16-frozen" if bf16 else "compile-dynamic-fp32-frozen",
            "pt2e-static-int8-bf16-measured-cpp" if bf16 else "pt2e-static-int8-measured-cpp",
            "onnxruntime-fp32", "onnxruntime-int8", "openvino-bf16" if bf16 else "openvino-fp32", *SERVED]


# benchmarks.model's rows of what the shipped archives serve here (the ladder's rung race decides), and the forms
# each is raced from: the float archive's compile form or the int8 one, and OpenVINO's.
SERVED = ("served", "served-int8")
# The served forward may trail the faster of its two candidates by the race's own margin: within it, the rung earlier
# in the ladder serves.
SERVED_MARGIN = 1.05


def commands(out: Path, isa: Sequence[str], peers: bool) -> dict[str, list[str]]:
    """The benchmarks' command lines, as docs/performance.md quotes them, writing under ``out``."""
    python = sys.executable
    threads = str(len(os.sched_getaffinity(0)))
    e2e = [python, "-m", "benchmarks.e2e", "--workloads", "short", "uniform", "mixed", "--concurrency", "1",
           "16", "--requests", "120", "--extra-archive", f"{INT8}={INT8_CONFIG}", "--out", str(out / "e2e")]
    if peers:
        e2e[3:3] = ["--peers", *PEERS]
    overhead = [python, "-m", "benchmarks.overhead", "--warmup", "1000", "--requests", "200"]
    return {
        "model": [python, "-m", "benchmarks.model", "--threads", threads, "--iters", "40", "--rounds", "5",
                  "--batch-sizes", "1", "8", "--seq-lengths", "16", "128", "--variants", *model_variants(isa),
                  "--out", str(out / "model")],
        "e2e": e2e,
        "overhead-default": [*overhead, "--config", str(DEFAULT_CONFIG), "--out", str(out / "overhead-default")],
        "overhead-int8": [*overhead, "--config", str(INT8_CONFIG), "--out", str(out / "overhead-int8")],
    }


def run_all(out: Path, isa: Sequence[str], peers: bool) -> None:
    """Each benchmark in turn, from the repository's root; the first that fails stops the run (its output says
    why)."""
    for name, command in commands(out, isa, peers).items():
        log(f"goals: {name}: {' '.join(command)}")
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        log(f"goals: {name} done in {time.perf_counter() - started:.0f} s")


def read_outputs(directory: Path) -> dict[str, Any]:
    """The runs' outputs under ``directory``: model.json, e2e.json and the two overhead CSVs (each part's row)."""
    def overhead(name: str) -> dict[str, dict[str, float]]:
        path = directory / f"{name}.csv"
        if not path.is_file():
            return {}
        with path.open() as f:
            return {row["part"]: {key: float(value) for key, value in row.items() if key != "part"}
                    for row in csv.DictReader(f)}

    def json_file(name: str) -> dict[str, Any]:
        path = directory / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def first_line(name: str) -> str | None:  # benchmarks.overhead's markdown starts with its command
        path = directory / f"{name}.md"
        return path.read_text().partition("\n")[0] if path.is_file() else None

    model, e2e = json_file("model"), json_file("e2e")
    return {"model": model, "e2e": e2e,
            "overhead": {INT8: overhead("overhead-int8"), OURS: overhead("overhead-default")},
            "commands": [command for command in (model.get("command"), e2e.get("command"),
                                                 first_line("overhead-default"), first_line("overhead-int8"))
                         if command]}


def evaluate(outputs: Mapping[str, Any], isa: Sequence[str]) -> list[Goal]:
    """Every speed goal with what ``outputs`` (``read_outputs``) measured, on a CPU with these ``isa`` flags."""
    speed = int8_dot_products_and_bf16(isa)
    return [*_end_to_end(outputs["e2e"], speed), *_model_alone(outputs["model"], isa, speed),
            *_served(outputs["model"], isa, speed), *_lone_request(outputs["overhead"]), *_answers(outputs["e2e"])]


def _cells(e2e: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """e2e rows as {(workload, concurrency): {model: row}}."""
    cells: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for row in e2e.get("rows", []):
        cells.setdefault((row["workload"], int(row["concurrency"])), {})[row["model"]] = row
    return cells


def _end_to_end(e2e: Mapping[str, Any], speed: bool) -> list[Goal]:
    cells = _cells(e2e)

    def times_baseline(model: str, workload: str) -> float | None:
        cell = cells.get((workload, 16), {})
        if model not in cell or BASELINE not in cell:
            return None
        return round(cell[model]["throughput_rps"] / cell[BASELINE]["throughput_rps"], 3)

    goals = [Goal(f"{label} archive, {words}, 16 clients: req/s x the baseline", times_baseline(model, workload),
                  bound, False, speed, label=f"{label} {workload} c16")
             for model, label in ((INT8, "int8"), (OURS, "default"))
             for workload, words, bound in (("uniform", "~120 tokens", 3.0 if model == INT8 else 2.0),
                                            ("mixed", "8-96 words", 4.0 if model == INT8 else 2.5))]
    ratios = [(cell[model]["p99_ms"] / cell[BASELINE]["p99_ms"], f"{model} {workload} c{clients}")
              for (workload, clients), cell in cells.items() if BASELINE in cell
              for model in (OURS, INT8) if model in cell]
    worst = max(ratios, default=None)
    goals.append(Goal("p99 in every cell: the highest of ours / the baseline's", round(worst[0], 3) if worst else None,
                      1.0, True, speed, f"at {worst[1]}" if worst else "", "p99 / baseline's"))
    for peer in PEERS:
        compared = [(cell[INT8]["throughput_rps"] / cell[peer]["throughput_rps"],
                     cell[INT8]["p99_ms"] / cell[peer]["p99_ms"], f"{workload} c{clients}")
                    for (workload, clients), cell in cells.items() if peer in cell and INT8 in cell]
        slowest = min(compared, default=None)
        longest = max(compared, key=lambda item: item[1], default=None)
        goals.append(Goal(f"ahead of {peer} in req/s in every cell: the lowest of int8 / {peer}",
                          round(slowest[0], 3) if slowest else None, 1.0, False, True,
                          f"at {slowest[2]}" if slowest else "run without --no-peers", f"req/s / {peer}'s"))
        goals.append(Goal(f"ahead of {peer} in p99 in every cell: the highest of int8 / {peer}",
                          round(longest[1], 3) if longest else None, 1.0, True, True,
                          f"at {longest[2]}" if longest else "run without --no-peers", f"p99 / {peer}'s"))
    return goals


def _model_alone(model: Mapping[str, Any], isa: Sequence[str], speed: bool) -> list[Goal]:
    int8_variant, ort = model_variants(isa)[2], "onnxruntime-fp32"
    medians = {(row["variant"], row["shape"]): row["median_ms"] for row in model.get("rows", [])}
    at_8x128 = medians.get((int8_variant, "b8xL128"))
    int8_short, ort_short = medians.get((int8_variant, "b1xL16")), medians.get((ort, "b1xL16"))
    return [
        Goal("int8 model alone, 8 texts x 128 tokens: median ms", at_8x128, 40.0, True, speed, int8_variant,
             "int8 model 8x128 ms"),
        Goal("int8 model alone, 1 text x 16 tokens: int8 / ONNX Runtime fp32",
             round(int8_short / ort_short, 3) if int8_short and ort_short else None, 1.0, True, speed,
             f"{int8_short} / {ort_short} ms", "int8 model 1x16 / ORT's"),
    ]


def _served(model: Mapping[str, Any], isa: Sequence[str], speed: bool) -> list[Goal]:
    """Per shipped archive and shape: what it serves here against the faster of its compile form and OpenVINO."""
    variants = model_variants(isa)
    compile_forms = {"served": variants[1], "served-int8": variants[2]}
    openvino = variants[5]
    medians = {(row["variant"], row["shape"]): row["median_ms"] for row in model.get("rows", [])}
    goals = []
    for served, compiled in compile_forms.items():
        for shape in sorted({shape for variant, shape in medians if variant == served}):
            candidates = {name: medians.get((name, shape)) for name in (compiled, openvino)}
            known = {name: ms for name, ms in candidates.items() if ms}
            ms = medians.get((served, shape))
            fastest = min(known, key=known.get) if known else None
            ratio = round(ms / known[fastest], 3) if ms and fastest else None
            goals.append(Goal(f"{served}, {shape}: served ms / the faster of {compiled} and {openvino}", ratio,
                              SERVED_MARGIN, True, speed, f"{ms} / {known.get(fastest)} ms ({fastest})",
                              f"{served} {shape}"))
    return goals


def _lone_request(overhead: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[Goal]:
    goals = []
    for model, label in ((OURS, "default"), (INT8, "int8")):
        parts = overhead.get(model) or {}
        client, forward = (parts.get(part, {}).get("p50_ms") for part in ("client", "forward"))
        # The handler's own time as the worker measured it, request by request (Server-Timing), where the run read
        # it; an older run's, in process.
        own, where = next(((parts[part]["p50_ms"], where) for part, where in
                           (("worker_own", "in the worker"), ("ours", "in process")) if part in parts), (None, ""))
        goals.append(Goal(f"{label} archive, a lone request: the handler's own ms (p50)", own, 1.0, True, True,
                          where, label=f"{label} lone: own ms"))
        goals.append(Goal(f"{label} archive, a lone request: client / forward (p50)",
                          round(client / forward, 3) if client and forward else None, 2.0, True, True,
                          _lone_detail(parts) if client and forward else "", f"{label} lone: client / forward"))
    return goals


def _lone_detail(parts: Mapping[str, Mapping[str, float]]) -> str:
    """A lone request's p50 parts (ms), with TorchServe's floor where benchmarks.overhead measured it: what a handler
    that answers at once waits through the same TorchServe, and the batching window's share of it."""
    p50 = {part: parts.get(part, {}).get("p50_ms") for part in
           ("client", "torchserve", "forward", "worker_forward", "floor", "batching_window")}
    detail = f"client {p50['client']}, TorchServe {p50['torchserve']}, forward {p50['forward']} ms"
    if p50["worker_forward"] is not None:
        detail += f" (in the worker {p50['worker_forward']})"
    if p50["floor"] is not None:
        detail += f"; TorchServe's floor {p50['floor']} ms, its batching window {p50['batching_window']}"
    return detail


def _answers(e2e: Mapping[str, Any]) -> list[Goal]:
    """Each archive's answers against the baseline's (fp32 eager) within its own gate for the precision it served."""
    agreement = e2e.get("agreement") or {}
    described = e2e.get("described") or {}
    yamls = {OURS: e2e.get("model_yaml") or {}, **(e2e.get("extra_archive_yaml") or {})}
    goals = []
    for model, label in ((OURS, "default"), (INT8, "int8")):
        measured = agreement.get("min_cosine") if model == OURS else (
            (agreement.get("archives") or {}).get(model) or {}).get("min_cosine")
        dtype = ((described.get(model) or {}).get("optimization") or {}).get("dtype")
        gate = ((yamls.get(model) or {}).get("pt2_handlers") or {}).get("quality_gate") or {}
        key = {"int8": "min_cosine_int8", "bfloat16": "min_cosine_half", "float16": "min_cosine_half"}.get(
            dtype or "", "min_cosine")
        bound = gate.get(key)
        goals.append(Goal(f"{label} archive's answers: min cosine vs the baseline's", measured,
                          float(bound) if bound else 0.99, False, True,
                          f"served {dtype or 'unknown'}; its gate's {key}", f"{label} min cosine"))
    return goals


def report(goals: Sequence[Goal], out: Path, isa: Sequence[str], source: str, commands: Sequence[str] = ()) -> str:
    rows = [goal.row() for goal in goals]
    write_csv(out / "goals.csv", rows)
    columns = ["goal", "measured", "bound", "verdict", "detail"]
    table = markdown_table(columns, [[row[column] for column in columns] for row in rows])
    missed = [goal.name for goal in goals if goal.applies and goal.measured is not None and not goal.met]
    summary = (f"CPU flags: {' '.join(isa) or 'none of ' + '/'.join(CPU_ISA_FLAGS)}; {source}\n"
               f"{sum(goal.applies and goal.met for goal in goals)} goals met, {len(missed)} missed"
               + (f": {'; '.join(missed)}" if missed else ""))
    ran = "".join(f"\n    {command}" for command in commands)
    (out / "goals.md").write_text(f"{summary}\n\n{table}\n" + (f"\nMeasured by:\n{ran}\n" if ran else ""))
    log(f"wrote {out / 'goals.md'}")
    plotted = [goal for goal in goals if goal.margin is not None]
    write_plot(out / "goals.png", "the speed goals on this CPU: margin (1 or more: met)",
               [goal.label or goal.name for goal in plotted],
               [("measured vs bound", {"margin": [goal.margin for goal in plotted]})])
    return f"{summary}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goals", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "goals", help="directory for every output")
    parser.add_argument("--no-peers", action="store_true", help="leave the Infinity server out of the end-to-end run")
    parser.add_argument("--from", dest="source", type=Path,
                        help="read an earlier run's outputs from this directory instead of running the benchmarks")
    args = parser.parse_args(argv)
    isa = cpu_isa()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.source is None:
        run_all(args.out, isa, peers=not args.no_peers)
    source = args.source or args.out
    outputs = read_outputs(source)
    isa = outputs["model"].get("cpu_isa") or outputs["e2e"].get("cpu_isa") or isa  # the run's CPU, not this one's
    print(report(evaluate(outputs, isa), args.out, isa, f"outputs in {source}", outputs["commands"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
