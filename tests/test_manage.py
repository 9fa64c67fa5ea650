"""scripts/manage.py's answer to a race in TorchServe's frontend. The race itself cannot be produced on demand (it
needs a worker to change state while the frontend edits its worker list), so a stand-in for the management API
answers with the exact 500 TorchServe 0.12 gave: the one place here where the real server is replaced."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import manage  # noqa: E402

RACE = (500, json.dumps({"code": 500, "type": "ConcurrentModificationException"}).encode())
SCALED = (200, json.dumps({"status": "Processing worker updates..."}).encode())


class ManagementApi:
    """Answers each management call with the next scripted (status, body), and records the calls."""

    def __init__(self, *answers: tuple[int, bytes]):
        self.answers = list(answers)
        self.calls: list[tuple[str, str]] = []

    def management(self, method: str, path: str, timeout: float = 120) -> tuple[int, bytes]:
        self.calls.append((method, path))
        return self.answers.pop(0)


def test_scale_asks_again_when_the_frontend_races(capsys):
    api = ManagementApi(RACE, RACE, SCALED)
    assert manage.scale(api, "minilm", 1, 1, retry_pause=0) == {"status": "Processing worker updates..."}
    assert api.calls == [("PUT", "/models/minilm?min_worker=1&max_worker=1&synchronous=false")] * 3
    assert capsys.readouterr().err.count("ConcurrentModificationException (a race in its frontend)") == 2


def test_scale_gives_up_after_three_races():
    api = ManagementApi(RACE, RACE, RACE, SCALED)
    with pytest.raises(manage.ManagementError, match="500 .*ConcurrentModificationException"):
        manage.scale(api, "minilm", 1, 1, retry_pause=0)
    assert len(api.calls) == manage.SCALE_ATTEMPTS == 3


def test_any_other_scale_error_is_not_retried():
    api = ManagementApi((404, b'{"code": 404, "type": "ModelNotFoundException", "message": "Model not found: x"}'))
    with pytest.raises(manage.ManagementError, match="404 .*Model not found: x"):
        manage.scale(api, "x", 1, 1, retry_pause=0)
    assert len(api.calls) == 1
