"""handlers/serving/management.py's answers to races in TorchServe. A race cannot be produced on demand (a worker
changing state while the frontend edits its worker list, or dying between two calls), so a stand-in for the management
API answers with the exact errors TorchServe 0.12 gave: the one place here where the real server is replaced."""

from __future__ import annotations

import json

import pytest

from handlers.serving import management as manage

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


def listed(*statuses: str, customized: bool = False) -> tuple[int, bytes]:
    entry = {"modelName": "minilm", "modelVersion": "1.0", "workers": [
        {"id": f"900{index}", "pid": 100 + index, "status": status} for index, status in enumerate(statuses)]}
    if customized:
        entry["customizedMetadata"] = {"task": "embeddings", "optimization": {"active": "compile"}}
    return 200, json.dumps([entry]).encode()


WORKER_DIED = (507, json.dumps({"code": 507, "type": "InternalServerException", "message": "Worker died."}).encode())


def test_describe_asks_a_ready_worker_for_the_ladder():
    api = ManagementApi(listed("READY"), listed("READY", customized=True))
    assert manage.describe(api, "minilm")[0]["customizedMetadata"]["optimization"]["active"] == "compile"
    assert api.calls == [("GET", "/models/minilm"), ("GET", "/models/minilm?customized=true")]


def test_describe_does_not_wait_for_a_loading_worker():
    """TorchServe would hold the customized question until a worker is READY: minutes for a cold compile."""
    api = ManagementApi(listed("UNLOADING", "STARTED"))
    shown = manage.format_description(manage.describe(api, "minilm"))
    assert api.calls == [("GET", "/models/minilm")]
    assert "pid 101 STARTED" in shown and "no worker answered for it -- loading, restarting or busy" in shown
    # TorchServe's word for a loading worker reads as if it were going away
    assert "pid 100 not READY (loading, or stopping: TorchServe says UNLOADING for both)" in shown


def test_describe_shows_the_workers_when_the_worker_asked_dies(capsys):
    api = ManagementApi(listed("READY"), WORKER_DIED)
    shown = manage.format_description(manage.describe(api, "minilm"))
    assert "pid 100 READY" in shown and "no worker answered for it" in shown
    assert "the worker asked died meanwhile" in capsys.readouterr().err


class Unanswered(ManagementApi):
    """The customized describe waits in TorchServe's queue past the client's timeout."""

    def management(self, method: str, path: str, timeout: float = 120) -> tuple[int, bytes]:
        if "customized" in path:
            self.calls.append((method, path))
            raise TimeoutError(f"timed out after {timeout}s")
        return super().management(method, path, timeout)


def test_describe_gives_up_on_a_worker_that_does_not_take_the_question(capsys):
    api = Unanswered(listed("READY"))
    shown = manage.format_description(manage.describe(api, "minilm", worker_timeout=3))
    assert "pid 100 READY" in shown and len(api.calls) == 2
    assert "no worker answered within 3s" in capsys.readouterr().err


@pytest.mark.parametrize("answer", [
    (404, b'{"code": 404, "type": "ModelNotFoundException", "message": "Model not found: minilm"}'),
    (500, b'{"code": 500, "type": "InternalServerException", "message": "handler describe failed"}')])
def test_any_other_describe_error_is_shown_as_it_is(answer):
    """A 500 from the handler's own describe is a bug to see, not a restart to wait out."""
    api = ManagementApi(listed("READY"), answer)
    with pytest.raises(manage.ManagementError, match=f"{answer[0]} "):
        manage.describe(api, "minilm")
