"""handlers.cpu.idle_cores: a small forward after idle virtual cores runs on one thread, anything else on its share."""

from __future__ import annotations

import time

import pytest
import torch

from handlers.cpu import idle_cores
from handlers.cpu.idle_cores import IdleCores
from tests.test_embeddings import make_engine, reference

SHORT = "a short text"
LONG = " ".join(["word"] * (idle_cores.SMALL_TOKENS + 1))


def test_only_a_small_batch_after_idleness_runs_on_the_fewest_proven_threads():
    rule = IdleCores(idle_s=0.02, small_tokens=64)
    assert rule.counts((1, 2), tokens=20, idle_s=0.5) == (1,)
    assert rule.counts((1, 2), tokens=64, idle_s=None) == (1,)  # the first forward after the load
    assert rule.counts(None, tokens=20, idle_s=0.5) == (1,)  # a forward that runs at any count: one
    assert rule.counts((2, 4), tokens=20, idle_s=0.5) == (2,)  # never a count it was not proven at
    assert rule.counts((1, 2), tokens=65, idle_s=0.5) == (1, 2)  # a larger batch keeps its share
    assert rule.counts((1, 2), tokens=20, idle_s=0.001) == (1, 2)  # threads still awake: every core
    assert rule.counts((1, 2), tokens=None, idle_s=0.5) == (1, 2)  # a task that loops (generation)
    assert rule.counts(None, tokens=65, idle_s=0.5) is None


def test_the_rule_holds_only_where_the_cpu_says_it_is_virtual():
    assert idle_cores.for_cpu({"avx2", "hypervisor"}) == IdleCores()
    assert idle_cores.for_cpu({"avx2", "avx512f"}) is None
    assert "waking an idle one" in IdleCores().describe()


@pytest.fixture(scope="module")
def engine(tiny_bert_dir):
    engine = make_engine(tiny_bert_dir, name="idle")  # threads: auto
    engine.load()
    if engine.cpu.share is None or engine.cpu.share.cores < 2:
        pytest.fail(f"this test needs 2+ cores shared forward by forward, found {engine.cpu.share}")
    engine.cpu.idle_cores = IdleCores()  # as on a virtual CPU, whatever this one is
    return engine


def embedding(engine, text: str) -> torch.Tensor:
    return torch.tensor(engine.predict([{"text": text}])[0]["embedding"])


def test_a_short_text_after_idleness_runs_on_one_thread_with_the_same_answer(engine, tiny_bert_dir):
    time.sleep(engine.cpu.idle_cores.idle_s * 2)
    after_idle = embedding(engine, SHORT)
    assert engine.last_batch.threads == 1
    # Right after a forward its threads are still awake. Judged against a 1 s window, not 20 ms: on a busy machine
    # the request's own parse once took 36 ms between the two forwards.
    engine.cpu.idle_cores = IdleCores(idle_s=1.0)
    try:
        awake = embedding(engine, SHORT)
    finally:
        engine.cpu.idle_cores = IdleCores()
    assert engine.last_batch.threads == engine.cpu.share.cores
    want = reference(tiny_bert_dir, [SHORT])[0]
    for got in (after_idle, awake):
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9999


def test_a_long_text_after_idleness_keeps_every_core(engine):
    time.sleep(engine.cpu.idle_cores.idle_s * 2)
    embedding(engine, LONG)
    assert engine.last_batch.threads == engine.cpu.share.cores


def test_describe_says_when_a_forward_runs_on_fewer_threads(engine):
    per_forward = engine.describe()["optimization"]["threads"]["per_forward"]
    assert per_forward.startswith(f"shared with the other workers on these {engine.cpu.share.cores} cores"), per_forward
    assert per_forward.endswith(IdleCores().describe()), per_forward
