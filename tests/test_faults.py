"""Faults in the worker's environment and in the archive, on a real TorchServe.

The server here starts with ``CXX`` naming a compiler that does not exist, as a worker image without g++ would
have. Inductor on CPU cannot build its kernels there. So the shipped archive must come up on a lower rung at once,
with the reason in describe. An archive whose YAML is invalid (built past python -m handlers package's check) must
fail to register, with the reason in the model log, and must not leave workers restarting.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from handlers.rungs.ipex import probe_ipex
from handlers.serving import archive as package
from handlers.serving import server as tsctl
from tests.conftest import port_shift
from tests.test_torchserve import TEXTS, assert_close_embeddings, describe, predict

REPO = Path(__file__).resolve().parent.parent

# Once, in the ipex stage when scripts/test.sh runs one (TorchServe's handling of these faults does not depend on
# torch's version; a worker without a compiler serves there on the IPEX rung, here on eager).
pytestmark = [pytest.mark.integration, pytest.mark.ipex_stage]

PORT_SHIFT = port_shift(12000)  # clear of the other test servers (+10000, +11000)
NO_COMPILER = "/nonexistent/g++"


@pytest.fixture(scope="module")
def no_toolchain(tmp_path_factory, model_store):
    tmp = tmp_path_factory.mktemp("faults")
    store = tmp / "store"
    store.mkdir()
    os.link(model_store / "minilm.mar", store / "minilm.mar")
    started = time.monotonic()
    server = tsctl.start(tsctl.shifted_config(tmp, PORT_SHIFT), store, ["minilm=minilm.mar"], tmp / "run",
                         timeout=900, extra_env={"CXX": NO_COMPILER})
    print(f"READY without a C++ compiler in {time.monotonic() - started:.0f}s")
    yield server
    tsctl.stop(server.run_dir)


def test_a_worker_without_a_cpp_compiler_serves_on_a_lower_rung_and_says_why(no_toolchain, reference):
    optimization = describe(no_toolchain)["customizedMetadata"]["optimization"]
    attempts = {a["rung"]: a for a in optimization["attempts"]}
    for rung in ("compile", "safe_compile"):
        assert attempts[rung]["status"] == "skipped", attempts[rung]
        assert f"needs a C++ compiler and none works here (tried '{NO_COMPILER}'" in attempts[rung]["reason"]
        assert attempts[rung]["seconds"] == 0.0  # skipped before any tracing
    if probe_ipex()[0] is not None:  # the ipex profile: IPEX needs no C++ compiler
        assert optimization["active"] == "ipex"
    else:
        assert optimization["active"] == "eager" and attempts["ipex"]["status"] == "skipped"
    want = reference(TEXTS[:4])
    for index, text in enumerate(TEXTS[:4]):
        status, answer = predict(no_toolchain, {"text": text})
        assert status == 200
        assert_close_embeddings(answer["embedding"], want[index])


def typo_archive(model_dir: Path, store: Path, tmp: Path) -> Path:
    """An archive whose YAML has a typo, built past python -m handlers package's check (which would refuse it)."""
    config = tmp / "typo.yaml"
    config.write_text("minWorkers: 1\nmaxWorkers: 1\npt2:\n  compile:\n    enable: true\n    mdoe: reduce-overhead\n")
    with tempfile.TemporaryDirectory() as staging_root:
        staging = Path(staging_root) / "archive"
        package.stage(model_dir, staging)
        subprocess.run(package.archiver_command("typo", "1.0", staging, config, store), check=True)
    return store / "typo.mar"


REASON = "pt2.compile: unknown key(s) mdoe (did you mean mode?)"


def test_an_archive_with_an_invalid_yaml_fails_to_register_with_the_reason_and_no_restart_storm(
        no_toolchain, tiny_bert_dir, tmp_path):
    typo_archive(tiny_bert_dir, no_toolchain.run_dir.parent / "store", tmp_path)
    log = no_toolchain.run_dir / "logs" / "model_log.log"
    offset = log.stat().st_size
    started = time.monotonic()
    status, body = no_toolchain.management("POST", "/models?url=typo.mar&initial_workers=1&synchronous=true",
                                           timeout=300)
    seconds = time.monotonic() - started
    assert status >= 400, body
    text = log.read_text(errors="replace")
    assert f"model typo failed to load: invalid model YAML: {REASON}" in text[offset:], text[-2000:]
    assert no_toolchain.management("GET", "/models/typo")[0] == 404, "the failed model stays registered"
    time.sleep(10)  # a restart storm would keep starting workers (and logging the reason) from here on
    later = log.read_text(errors="replace")[len(text):]
    assert REASON not in later, "workers of the failed model are still being restarted"
    print(f"register refused in {seconds:.1f}s with {status}: {body[:200]!r}; "
          f"{text[offset:].count(REASON)} load attempt(s) logged the reason")


def test_a_server_started_with_an_invalid_archive_says_why_at_once(tiny_bert_dir, tmp_path):
    """Loaded at startup (--models), a failing model is retried by TorchServe with backoff, for ever, while
    describe shows only a worker that is not READY. scripts/start.sh stops waiting at the first failure and says
    why."""
    store = tmp_path / "store"
    store.mkdir()
    typo_archive(tiny_bert_dir, store, tmp_path)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    try:
        said = r"typo failed to load: invalid model YAML: pt2\.compile: unknown key\(s\) mdoe \(did you mean mode\?\)"
        with pytest.raises(RuntimeError, match=said + r"; allowed: .*\. TorchServe keeps retrying"):
            tsctl.start(tsctl.shifted_config(tmp_path, PORT_SHIFT + 1000), store, ["typo=typo.mar"], run_dir,
                        timeout=300)
        print(f"start.sh said why after {time.monotonic() - started:.0f}s")
    finally:
        tsctl.stop(run_dir)


def test_a_server_that_cannot_bind_its_port_is_reported_not_waited_for(model_store, tmp_path):
    """TorchServe exits when its inference port is taken (a server still shutting down, say); waiting for READY
    then waited out its whole timeout (900 s in the benchmarks). start says why at once instead."""
    config = tsctl.shifted_config(tmp_path, PORT_SHIFT + 5000)  # +17000: no other test server there
    port = int(tsctl.read_properties(config)["inference_address"].rsplit(":", 1)[1])
    store = tmp_path / "store"
    store.mkdir()
    os.link(model_store / "minilm.mar", store / "minilm.mar")
    started = time.monotonic()
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(RuntimeError, match=r"TorchServe exited while minilm was loading: .*Failed to bind to "
                                               rf"address: http://127\.0\.0\.1:{port}"):
            tsctl.start(config, store, ["minilm=minilm.mar"], tmp_path / "run", timeout=300)
    assert time.monotonic() - started < 120
