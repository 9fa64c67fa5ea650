"""Answers of transformers 4.57.1's ``question-answering`` pipeline, the last release that has it (transformers 5
dropped it), run eagerly in a subprocess so that it never meets the transformers 5 the handlers use.

    PYTHONPATH=$PT2_QA_REFERENCE_DIR python tests/pipeline_reference.py < calls.json > answers.json

Input: ``{"model": dir, "calls": [{"question": ..., "context": ..., <pipeline keyword arguments>}, ...]}``;
output: one answer per call, as the pipeline returns it. ``answers(model_dir, calls)`` does the round trip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REFERENCE_ENV = "PT2_QA_REFERENCE_DIR"


def answers(model_dir: Path, calls: list[dict[str, Any]]) -> list[Any]:
    reference = os.environ[REFERENCE_ENV]
    env = {**os.environ, "PYTHONPATH": reference, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, __file__], input=json.dumps({"model": str(model_dir), "calls": calls}),
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"reference pipeline failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    import transformers

    assert transformers.__version__ == "4.57.1", f"the reference is transformers 4.57.1, got {transformers.__version__}"
    request = json.load(sys.stdin)
    pipe = transformers.pipeline("question-answering", model=request["model"], device="cpu")
    json.dump([pipe(**call) for call in request["calls"]], sys.stdout)


if __name__ == "__main__":
    main()
