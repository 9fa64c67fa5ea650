#!/usr/bin/env python3
"""Send one request to the running server and show the answer and the active rung: a text to an embeddings model,
or with --image a picture's bytes to an image classifier (as curl -T sends them).

  .venv/bin/python scripts/sample_request.py [--model minilm] [--text TEXT]     # against scripts/start.sh's server
  .venv/bin/python scripts/sample_request.py --model mobilenet --image photo.jpg
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's handlers package (not installed)

from handlers.serving.server import DEFAULT_CONFIG, DEFAULT_RUN_DIR, server_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--text", default="TorchServe with torch.compile, verified at load time.")
    parser.add_argument("--image", type=Path, help="a picture to classify (the model is an image classifier)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    args = parser.parse_args()
    server = server_for(args.config, args.run_dir)
    if args.image:
        body, content_type, sent = args.image.read_bytes(), "application/octet-stream", f"{args.image} (bytes)"
    else:
        body, content_type, sent = json.dumps({"text": args.text}).encode(), "application/json", {"text": args.text}
    started = time.perf_counter()
    status, answer = server.call("POST", f"{server.inference_url}/predictions/{args.model}", "inference", body,
                                 content_type)
    millis = (time.perf_counter() - started) * 1000
    if status != 200:
        raise SystemExit(f"request failed ({status}): {answer.decode(errors='replace')}")
    print(f"POST /predictions/{args.model} {sent} -> {status} in {millis:.0f} ms")
    if args.image:
        print("labels:", ", ".join(f"{label} {probability:.4f}" for label, probability in json.loads(answer).items()))
    else:
        vector = json.loads(answer)["embedding"]
        norm = sum(v * v for v in vector) ** 0.5
        print(f"embedding: {len(vector)} dims, L2 norm {norm:.4f}, first values {[round(v, 4) for v in vector[:5]]}")
    _, meta = server.management("GET", f"/models/{args.model}?customized=true")
    optimization = json.loads(meta)[0]["customizedMetadata"]["optimization"]
    print(f"active rung: {optimization['active']} (device {optimization['device']}, torch {optimization['torch']})")
    for attempt in optimization["attempts"]:
        reason = f" -- {attempt['reason']}" if attempt.get("reason") else ""
        rung = f"{attempt['rung']} (screen)" if attempt.get("screen") else attempt["rung"]
        precision = attempt.get("dtype") or ""
        print(f"  {rung:<15} {precision:<9} {attempt['status']:<9} {attempt['seconds']:>7.1f}s{reason}")


if __name__ == "__main__":
    main()
