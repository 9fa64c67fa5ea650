"""The IPEX 2.8 wheel beside torch 2.13 (the default profile), as a user gets by pip-installing IPEX into the
wrong venv. Importing it there raises AttributeError; with TS_IPEX_ENABLE=true TorchServe's own base_handler
import dies of it. pt2-handlers must skip the ipex rung with the version reason and keep serving.
The wheel is unpacked by ``scripts/setup.sh --ipex-wheel`` and put on PYTHONPATH (PT2_IPEX_WHEEL_DIR)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from handlers.serving import server as tsctl
from tests.conftest import IPEX_WHEEL_ENV
from tests.test_torchserve import TEXTS, assert_close_embeddings, describe, predict, shifted_config

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.ipex_mismatch, pytest.mark.integration]


@pytest.fixture(scope="module")
def wheel_env() -> dict[str, str]:
    return {"PYTHONPATH": os.environ[IPEX_WHEEL_ENV], "TS_IPEX_ENABLE": "true"}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_the_mismatched_wheel_is_skipped_with_the_version_reason(wheel_env):
    raw = run_python("import intel_extension_for_pytorch", wheel_env)
    assert raw.returncode != 0 and "AttributeError" in raw.stderr, "the wheel imports here: this proves nothing"
    probe = run_python("from handlers.rungs.ipex import probe_ipex; print(probe_ipex()[1])", wheel_env)
    assert probe.returncode == 0, probe.stderr
    assert "intel_extension_for_pytorch 2.8.0 works only with torch 2.8.*" in probe.stdout
    assert "version mismatch; not imported" in probe.stdout


def test_ts_ipex_enable_does_not_take_the_worker_down(tmp_path, wheel_env, model_store, reference):
    stock = run_python("import ts.torch_handler.base_handler", wheel_env)
    assert stock.returncode != 0, "TorchServe's base_handler survives this IPEX now: the control proves nothing"
    run_dir = tmp_path / "run"
    started = time.monotonic()
    server = tsctl.start(shifted_config(tmp_path), model_store, ["minilm-faulty=minilm-faulty.mar"], run_dir,
                         timeout=900, extra_env=wheel_env)
    try:
        print(f"TorchServe with TS_IPEX_ENABLE=true READY in {time.monotonic() - started:.0f}s")
        optimization = describe(server, "minilm-faulty")["customizedMetadata"]["optimization"]
        # By (rung, dtype): a rung may be tried at several precisions (the archive pins float32).
        attempts = {(a["rung"], a["dtype"]): a for a in optimization["attempts"] if not a["screen"]}
        assert attempts[("compile", "float32")]["status"] == "failed"  # the faulty archive: fails at first forward
        ipex = attempts[("ipex", "float32")]
        assert ipex["status"] == "skipped" and "version mismatch" in ipex["reason"], ipex
        assert optimization["active"] == "eager"
        want = reference(TEXTS[:2])
        for index, text in enumerate(TEXTS[:2]):
            status, answer = predict(server, {"text": text}, model="minilm-faulty")
            assert status == 200, answer
            assert_close_embeddings(answer["embedding"], want[index])
        log = (run_dir / "logs" / "model_log.log").read_text(errors="replace")
        assert "IPEX is tried by the pt2-handlers ladder" in log
    finally:
        tsctl.stop(run_dir)
