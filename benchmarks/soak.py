"""A bounded soak through a running TorchServe: many requests at high concurrency, texts of mixed lengths (an image
classifier: photographs of mixed sizes), and a sprinkle of bad requests (bad images) among them.

It passes (exit 0) when all of these hold:
- every good request got a 200 and every bad one its 4xx;
- a sample of the answers equals fp32 eager (an image's most likely label the same, its probability within the
  gate's bound). The reference is the archive's own model and YAML, loaded here on the eager rung;
- after warmup, the worker's RSS grew by less than --max-rss-growth, and its open files and threads did not grow
  over the second half of the requests, nor by more than one over the first (a pool started at its first use).
Progress prints every 10%. The report gives RSS after warmup, at the halfway request, at the end and at its peak:
growth in the second half says whether it still grows or has levelled off. With --out it writes a CSV of the
process samples (each with the requests answered so far) and a PNG plot of them.

  scripts/start.sh
  .venv/bin/python -m benchmarks.soak --model minilm --archive model_store/minilm.mar    # 5,000 requests at c32
  ... --out /tmp/soak --idle-after 30      # CSV + PNG; keep sampling 30 s once the traffic stops

The test suite runs a shorter soak (tests/test_production.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import hostile_images, hostile_inputs
from handlers.config.task_facts import IMAGE_GATE
from handlers.serving import server as torchserve

LAZY_START = 1  # threads or open files a worker may add after warmup without leaking: a pool started at first use

WORDS = ("serving compile graph kernel batch token model worker cache tensor queue latency python torch inference "
         "request answer embedding sentence vector cat dog tea train music weather river city garden").split()


@dataclass
class ProcessSample:
    seconds: float
    rss_mb: float
    fds: int
    threads: int
    requests: int = 0  # answered so far


def process_sample(pid: int, started: float, requests: int = 0) -> ProcessSample:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return ProcessSample(round(time.monotonic() - started, 2), rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd")),
                         len(os.listdir(f"/proc/{pid}/task")), requests)


@dataclass
class Sampler:
    """Samples one process every ``interval`` seconds on a thread, until stopped; ``done`` counts the requests
    answered so far (each sample records it)."""

    pid: int
    interval: float = 0.5
    done: Callable[[], int] = lambda: 0
    samples: list[ProcessSample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(process_sample(self.pid, self.started, self.done()))
            self._stop.wait(self.interval)

    def stop(self) -> list[ProcessSample]:
        self._stop.set()
        self._thread.join()
        return self.samples


def reference_engine(archive: Path, work: Path) -> Any:
    """The archive's model and YAML, served on the eager rung in fp32 in this process: the reference answers."""
    from handlers.config import load_config
    from handlers.serving.engine import Engine

    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(work)
    manifest = json.loads((work / "MAR-INF" / "MANIFEST.json").read_text())
    import yaml

    raw = yaml.safe_load((work / manifest["model"]["configFile"]).read_text())
    raw.pop("pt2", None)
    settings = raw.setdefault("pt2_handlers", {})
    settings.update(ladder=["eager"], dtype="float32")
    settings.pop("compile_cache", None)
    import torch

    from handlers.models.files import ModelFiles

    model = manifest["model"]  # a model.py + state_dict, or an exported program, where the archive packs one
    files = ModelFiles(model.get("modelFile") or None, model.get("serializedFile") or None)
    engine = Engine(load_config(raw), work, torch.device("cpu"), "reference", files=files)
    engine.load()
    return engine


def mixed_texts(count: int, rng: random.Random, words: tuple[int, int] = (3, 96)) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(count)]


def good_bodies(task: str, count: int, rng: random.Random) -> list[tuple[bytes, str]]:
    """(body, Content-Type) of ``count`` good requests: texts of mixed lengths, or JPEG photographs' stand-ins of
    mixed sizes sent as raw bytes (as ``curl -T`` sends them)."""
    if task == hostile_inputs.IMAGE_TASK:
        photos = hostile_images.good_photos(12)
        return [(photos[rng.randrange(len(photos))], "image/jpeg") for _ in range(count)]
    spec = hostile_inputs.TASKS[task]
    return [(json.dumps(spec.good(text)).encode(), "application/json") for text in mixed_texts(count, rng)]


def same_answer(task: str, dtype: str, got: Any, want: Any) -> bool:
    """A served answer against fp32 eager's: within the quality gate's bound for the served precision."""
    if task == hostile_inputs.IMAGE_TASK:  # the image gate: the same most likely label, probabilities within its bound
        bound = IMAGE_GATE.defaults[0 if dtype == "float32" else 1]
        (label, score), (want_label, want_score) = next(iter(got.items())), next(iter(want.items()))
        # a near tie may swap the top two in a half precision (bf16 can round both to one value): the label served
        # must then be as likely, within the bound, by fp32 eager's own probabilities
        return abs(score - want_score) <= bound and (
            label == want_label or (label in want and want_score - want[label] <= bound))
    return hostile_inputs.close(got, want, 1e-3 if dtype == "float32" else 2e-2)


def bad_cases(task: str, inputs: dict[str, Any]) -> list[hostile_inputs.Case]:
    """The cheap hostile cases (no oversize body, none answered 200)."""
    return [case for case in hostile_inputs.cases(task, inputs, hostile_inputs.DEFAULT_MAX_REQUEST_SIZE)
            if case.status != 200 and len(case.body) < 200_000]


def soak(server: torchserve.Server, model: str, archive: Path, requests: int = 5000, concurrency: int = 32,
         bad_every: int = 20, sample_every: int = 25, warmup: int = 200, max_rss_growth: float = 0.10, seed: int = 0,
         progress: Callable[[str], None] = print, idle_after: float = 1.0) -> dict[str, Any]:
    """Run the soak; returns the figures and ``problems`` (empty: passed). ``idle_after``: seconds the worker is
    still sampled once the last answer is in (its end RSS is the last of those samples)."""
    meta = hostile_inputs.describe(server, model)
    task = meta["customizedMetadata"]["task"]
    dtype = meta["customizedMetadata"]["optimization"]["dtype"]
    pid = meta["workers"][0]["pid"]
    rng = random.Random(seed)
    bad = bad_cases(task, meta["customizedMetadata"]["inputs"])
    # body, content type, the path after /predictions/<model> ("" for none), expected status
    plan: list[tuple[bytes, str | None, str, int]] = []
    for index, (body, content_type) in enumerate(good_bodies(task, requests, rng)):
        if index % bad_every == bad_every - 1:
            case = bad[index // bad_every % len(bad)]
            plan.append((case.body, case.content_type, case.after_model(meta["modelVersion"]), case.status))
        else:
            plan.append((body, content_type, "", 200))
    # warmup at the soak's concurrency, so that batches of every size form: allocator pools, caches and what a worker
    # starts at its first full batch (the threads an image batch is decoded on) settle before the first sample
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda request: hostile_inputs.send(server, model, *request[:3]), plan[:warmup]))
    progress(f"[soak] {model} ({task}, {dtype}, worker pid {pid}): {len(plan)} requests at concurrency "
             f"{concurrency}, 1 in {bad_every} bad, after {warmup} warmup requests")
    answers: list[hostile_inputs.Answer | None] = [None] * len(plan)
    done = [0]
    sampler = Sampler(pid, done=lambda: done[0])
    lock = threading.Lock()
    started = time.monotonic()

    def one(index: int) -> None:
        answers[index] = hostile_inputs.send(server, model, *plan[index][:3])
        with lock:
            done[0] += 1
            if done[0] % max(1, len(plan) // 10) == 0:
                progress(f"[soak] {done[0]}/{len(plan)} in {time.monotonic() - started:.0f}s")

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(plan))))
    seconds = time.monotonic() - started
    time.sleep(idle_after)  # samples once idle
    samples = sampler.stop()
    report = judge(archive, plan, answers, samples, (task, dtype), sample_every, max_rss_growth, progress)
    workers = hostile_inputs.describe(server, model)["workers"]
    if [(w["pid"], w["status"]) for w in workers] != [(pid, "READY")]:
        report["problems"].append(f"the worker changed: pid {pid} -> {workers}")
    return {"model": model, "task": task, "dtype": dtype, "seconds": round(seconds, 1),
            "requests_per_s": round(len(plan) / seconds, 1), **report}


def wrong_answers(archive: Path, plan: list, answers: list, checked: list[int], served: tuple[str, str],
                  progress: Callable[[str], None]) -> list[str]:
    """The ``checked`` answers that differ from fp32 eager's (the archive's model and YAML, on the eager rung)."""
    progress(f"[soak] checking {len(checked)} sampled answers against fp32 eager")
    problems = []
    with tempfile.TemporaryDirectory() as work:
        engine = reference_engine(archive, Path(work))
        for start in range(0, len(checked), 8):
            chunk = checked[start:start + 8]
            want = engine.predict([plan[i][0] if plan[i][1] != "application/json" else json.loads(plan[i][0])
                                   for i in chunk])
            problems += [f"request {i}: answer {answers[i][1][:120]!r} differs from fp32 eager's {ref}"
                         for i, ref in zip(chunk, want, strict=True)
                         if not same_answer(*served, json.loads(answers[i][1]), ref)]
    return problems


def judge(archive: Path, plan: list, answers: list, samples: list[ProcessSample], served: tuple[str, str],
          sample_every: int, max_rss_growth: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """``served``: the task and the precision it served in."""
    problems = []
    wrong_status = [(i, answers[i][0], answers[i][1][:120]) for i, (*_, want) in enumerate(plan)
                    if answers[i] is None or answers[i][0] != want]
    good = [i for i, (*_, want) in enumerate(plan) if want == 200]
    if wrong_status:
        problems.append(f"{len(wrong_status)} requests got an unexpected status, e.g. {wrong_status[:3]}")
    checked = [i for i in good[::sample_every] if answers[i] is not None and answers[i][0] == 200]
    if checked:
        problems += wrong_answers(archive, plan, answers, checked, served, progress)
    base, end = samples[0], samples[-1]
    halfway = next(s for s in samples if s.requests >= len(plan) // 2 or s is end)
    rss_growth = (end.rss_mb - base.rss_mb) / base.rss_mb
    if rss_growth >= max_rss_growth:
        problems.append(f"worker RSS grew {rss_growth:.1%} ({base.rss_mb:.0f} -> {end.rss_mb:.0f} MB)")
    # A leak grows with the requests: any growth over the second half is one. In the first, one more thread or file
    # is a pool started at its first use (a batch of a size the warmup did not form), not a leak.
    if any(end_count > half_count or end_count > base_count + LAZY_START for base_count, half_count, end_count in
           ((base.fds, halfway.fds, end.fds), (base.threads, halfway.threads, end.threads))):
        problems.append(f"worker fds {base.fds} -> {halfway.fds} -> {end.fds}, threads {base.threads} -> "
                        f"{halfway.threads} -> {end.threads} (after warmup, halfway, at the end)")
    return {
        "requests": len(plan), "good": len(good), "bad": len(plan) - len(good), "unexpected_status": len(wrong_status),
        "answers_checked": len(checked), "rss_growth": round(rss_growth, 4),
        # growth over the second half of the requests, relative to the after-warmup RSS: ~0 once it levels off
        "rss_growth_second_half": round((end.rss_mb - halfway.rss_mb) / base.rss_mb, 4),
        "rss_mb": {"after_warmup": round(base.rss_mb, 1), "halfway": round(halfway.rss_mb, 1),
                   "end": round(end.rss_mb, 1), "max": round(max(s.rss_mb for s in samples), 1)},
        "fds": [base.fds, end.fds], "threads": [base.threads, end.threads], "samples": samples, "problems": problems,
    }


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """CSV of the process samples, the report as JSON, and a PNG of RSS / fds / threads over time (where
    matplotlib imports)."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    samples = report.pop("samples")
    with (out / "soak_samples.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seconds", "requests", "rss_mb", "fds", "threads"])
        writer.writerows([s.seconds, s.requests, round(s.rss_mb, 1), s.fds, s.threads] for s in samples)
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    try:  # the bench extra (pip install -e '.[bench]'); without it, the CSV and the JSON only
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"[soak] no soak.png ({exc}); install the bench extra: pip install -e '.[bench]'")
        return

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.5))
    times = [s.seconds for s in samples]
    rss = [s.rss_mb for s in samples]
    axes[0].plot([s.requests for s in samples], rss)
    axes[0].set(title="worker RSS (MB) by requests answered", xlabel="requests answered")
    axes[0].set_ylim(bottom=0)
    for ax, (name, values) in zip(axes[1:], (("worker RSS (MB)", rss), ("open files", [s.fds for s in samples]),
                                             ("threads", [s.threads for s in samples])), strict=True):
        ax.plot(times, values)
        ax.set_title(name)
        ax.set_xlabel("seconds into the soak")
        ax.set_ylim(bottom=0)
    fig.suptitle(f"soak: {report['requests']} requests to {report['model']} ({report['dtype']}) at "
                 f"{report['requests_per_s']} req/s, RSS growth {report['rss_growth']:.1%} "
                 f"({report['rss_growth_second_half']:+.1%} in the second half)")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--archive", type=Path, default=torchserve.DEFAULT_MODEL_STORE / "minilm.mar",
                        help="the .mar the model was registered from (its model and YAML give the reference)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--bad-every", type=int, default=20, help="one bad request in this many")
    parser.add_argument("--sample-every", type=int, default=25, help="check one good answer in this many")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--config", type=Path, default=torchserve.DEFAULT_CONFIG)
    parser.add_argument("--run-dir", type=Path, default=torchserve.DEFAULT_RUN_DIR)
    parser.add_argument("--idle-after", type=float, default=1.0,
                        help="seconds to keep sampling the worker once the last answer is in")
    parser.add_argument("--out", type=Path, default=None, help="write soak_samples.csv, soak.json, soak.png here")
    args = parser.parse_args()
    server = torchserve.server_for(args.config, args.run_dir.resolve())
    report = soak(server, args.model, args.archive, args.requests, args.concurrency, args.bad_every,
                  args.sample_every, args.warmup, args.max_rss_growth, idle_after=args.idle_after)
    if args.out:
        write_outputs(report, args.out)
    report.pop("samples", None)
    print(json.dumps(report, indent=2))
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
