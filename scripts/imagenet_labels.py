#!/usr/bin/env python3
"""Write ImageNet-1k index_to_name.json (TorchServe format) from timm's ImageNet info files.

Get the two input files without installing timm:

    pip download --no-deps timm==1.0.31
    unzip timm-1.0.31-py3-none-any.whl \\
        timm/data/_info/imagenet_synsets.txt \\
        timm/data/_info/imagenet_synset_to_lemma.txt

then:

    python scripts/imagenet_labels.py --info-dir timm/data/_info \\
        -o docs/examples/mobilenet_v2/index_to_name.json

Each entry is ``"<class index>": ["<synset id>", "<label>"]``; the label is the
synset's first lemma with spaces replaced by underscores, as in TorchServe's
examples/image_classifier/index_to_name.json.
"""

import argparse
import json
import sys
from pathlib import Path


def build(synsets_path: Path, lemma_path: Path) -> dict:
    synsets = [s.strip() for s in synsets_path.read_text().splitlines() if s.strip()]
    if len(synsets) != 1000:
        raise SystemExit(f"{synsets_path}: expected 1000 synsets, found {len(synsets)}")
    lemmas = {}
    for line in lemma_path.read_text().splitlines():
        if not line.strip():
            continue
        synset, names = line.split("\t", 1)
        lemmas[synset.strip()] = names
    missing = [s for s in synsets if s not in lemmas]
    if missing:
        raise SystemExit(f"{lemma_path}: no lemma for {len(missing)} synsets, e.g. {missing[:3]}")
    return {str(i): [s, lemmas[s].split(",")[0].strip().replace(" ", "_")] for i, s in enumerate(synsets)}


def dumps(mapping: dict) -> str:
    """JSON with one entry per line, so diffs stay readable."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in mapping.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Writes ImageNet-1k index_to_name.json (TorchServe format) from timm's "
            "ImageNet info files. Get them with: pip download --no-deps timm==1.0.31, "
            "then unzip timm/data/_info/imagenet_synsets.txt and "
            "timm/data/_info/imagenet_synset_to_lemma.txt from the wheel."
        ),
    )
    parser.add_argument(
        "--info-dir",
        type=Path,
        default=Path("timm/data/_info"),
        help="folder holding imagenet_synsets.txt and imagenet_synset_to_lemma.txt (default: %(default)s)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="where to write the JSON (default: standard output)",
    )
    args = parser.parse_args()

    mapping = build(
        args.info_dir / "imagenet_synsets.txt",
        args.info_dir / "imagenet_synset_to_lemma.txt",
    )
    text = dumps(mapping)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {len(mapping)} classes to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
