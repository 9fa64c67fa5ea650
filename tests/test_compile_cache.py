"""The compile cache: a usable directory is used; an unusable one degrades to a private directory with a
warning (never a crash), and nowhere to write skips compiling with the reason."""

from __future__ import annotations

import os
import subprocess
import sys

from handlers.rungs.compile_cache import ENV_VAR, choose, configured_dir, prepare

UNCREATABLE = "/proc/pt2-handlers-cannot-create-this"  # even root cannot mkdir under /proc


def test_the_configured_directory_wins_and_is_exported(tmp_path):
    environ = {ENV_VAR: str(tmp_path / "from-env")}
    choice = prepare(str(tmp_path / "configured"), environ)
    assert (choice.path, choice.source, choice.warning) == (str(tmp_path / "configured"),
                                                           "pt2_handlers.compile_cache", None)
    assert environ[ENV_VAR] == choice.path and (tmp_path / "configured").is_dir()


def test_the_environment_then_torch_default(tmp_path):
    assert choose(None, {ENV_VAR: str(tmp_path)}).source == ENV_VAR
    default = choose(None, {})
    assert default.source == "torch default" and "torchinductor_" in default.path


def test_an_unusable_directory_falls_back_to_a_private_one_with_a_warning():
    environ = {ENV_VAR: UNCREATABLE}
    choice = prepare(None, environ)
    assert choice.source == "private fallback" and os.path.isdir(choice.path)
    assert UNCREATABLE in choice.warning and "starts cold" in choice.warning
    assert environ[ENV_VAR] == choice.path


def test_a_file_in_the_way_is_unusable(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    assert choose(str(blocker), {}).source == "private fallback"


def test_nowhere_to_write_means_no_compile(monkeypatch):
    monkeypatch.setattr("tempfile.mkdtemp", lambda **_: (_ for _ in ()).throw(OSError("read-only file system")))
    choice = choose(UNCREATABLE, {})
    assert choice.path is None and "compiling is skipped" in choice.warning


def test_configured_dir_is_read_leniently_before_validation():
    assert configured_dir({"pt2_handlers": {"compile_cache": "/srv/c"}}) == "/srv/c"
    assert configured_dir({"pt2_handlers": {"compile_cache": 3}}) is None
    assert configured_dir({"pt2_handlers": "x"}) is None and configured_dir(None) is None


def torch_minor() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_prepare_keeps_torch_dynamo_importable_in_a_fresh_process():
    """The defect this module exists for: torch dies importing dynamo when the cache dir cannot be made."""
    code = ("from handlers.rungs.compile_cache import prepare; c = prepare(None); import torch._dynamo; "
            "print(c.source)")
    env = {**os.environ, ENV_VAR: UNCREATABLE}
    crash = subprocess.run([sys.executable, "-c", "import torch._dynamo"], env=env, capture_output=True, text=True)
    # Measured: torch 2.13 dies there; torch 2.8 (the ipex profile) imports and fails later, at compile.
    assert (crash.returncode != 0) == (torch_minor() >= (2, 13)), crash.stderr[-500:]
    fixed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "private fallback"
