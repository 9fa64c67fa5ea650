"""What a load keeps for the next (handlers.ladder.decisions): records that never fail a load, keys that change with
what a decision depends on, and a ladder that measures again where a record cannot be read."""

from __future__ import annotations

import json
import logging

import torch

from handlers.config import CompileSpec, DType
from handlers.ladder import Precisions, Site, Warmup, race, run_ladder
from handlers.ladder.decisions import DecisionStore, batch_tensors, fingerprint
from handlers.rungs import CompileRung, EagerRung
from handlers.tasks.embeddings import CosineGate
from tests.test_ladder import SmallNet


def test_a_record_is_read_back_and_a_missing_one_is_none(tmp_path):
    memory = DecisionStore(tmp_path / "kept")
    assert memory.recall("abc") is None
    memory.keep("abc", {"ms": [1.5, 2.0], "tries": 1})
    assert memory.recall("abc") == {"ms": [1.5, 2.0], "tries": 1}
    assert [path.name for path in (tmp_path / "kept").iterdir()] == ["abc.json"]  # no partial file left


def test_a_record_that_cannot_be_read_or_kept_never_fails_a_load(tmp_path, caplog):
    memory = DecisionStore(tmp_path)
    (tmp_path / "torn.json").write_text('{"ms": [1.5,', encoding="utf-8")
    (tmp_path / "list.json").write_text("[1, 2]", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="handlers.ladder.decisions"):
        assert memory.recall("torn") is None and memory.recall("list") is None
    assert "the remembered record torn cannot be read" in caplog.text
    blocked = tmp_path / "a-file"
    blocked.write_text("", encoding="utf-8")
    # a file where the directory should be: warned, not raised
    DecisionStore(blocked / "kept").keep("abc", {"tries": 1})
    assert "a measurement cannot be kept in" in caplog.text


def test_the_key_changes_with_every_tensor_byte_shape_and_what_is_said():
    weights = {"w": torch.ones(2, 3)}
    key = fingerprint("race", tensors=weights.items())
    assert key == fingerprint("race", tensors={"w": torch.ones(2, 3)}.items())
    changed = torch.ones(2, 3)
    changed[1, 2] = 1.0000001
    assert key != fingerprint("race", tensors={"w": changed}.items())
    assert key != fingerprint("race", tensors={"w": torch.ones(3, 2)}.items())
    assert key != fingerprint("race", tensors={"w": torch.ones(2, 3, dtype=torch.float64)}.items())
    assert key != fingerprint("int8 layers", tensors=weights.items())
    batches = [{"input_ids": torch.tensor([[1, 2]]), "note": "not a tensor"}, "a task's own batch"]
    assert [name for name, _ in batch_tensors(batches)] == ["input_ids"]


def test_a_race_record_this_version_cannot_read_is_raced_again(tmp_path, monkeypatch, caplog):
    """A record another version kept (fields renamed) is not a decision: the worker races and keeps its own."""
    memory = DecisionStore(tmp_path)
    batches = [{"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}]
    raced = []

    def run_race(*args, **kwargs):
        raced.append(1)
        return race.Race([10.0, 5.0], 1, 0.0, 0.0)

    monkeypatch.setattr(race, "run_race", run_race)

    def load():
        return run_ladder(SmallNet().eval(),
                          [CompileRung("compile", CompileSpec(enabled=True, backend="eager")), EagerRung()],
                          Warmup(batches, lambda dtype: CosineGate(0.99)),
                          Precisions((DType.BFLOAT16, DType.FLOAT32), must_beat_fp32=(DType.BFLOAT16,)),
                          Site(decisions=memory, machine="here"))

    first = load()
    assert first.dtype is DType.FLOAT32 and len(raced) == 1
    # the weights hashed once for the keys, handed on with the result (the length-groups model's key takes them)
    assert first.weights_key == fingerprint(tensors=SmallNet().eval().state_dict().items())
    [kept] = list(tmp_path.glob("*.json"))
    kept.write_text(json.dumps({"milliseconds": [1.0, 9.0]}), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="handlers.ladder"):
        assert load().dtype is DType.FLOAT32 and len(raced) == 2
    assert "is not what this version keeps" in caplog.text
    assert json.loads(kept.read_text(encoding="utf-8"))["ms"] == [10.0, 5.0]  # kept over
