"""``shapes.small_batch_tokens``: small batches through a second graph of the compile rung
(handlers.rungs.small_batch_graph). The config refuses what could not work, the batches go to the graph their size
says, both graphs are traced before READY and none after, and the answers are the model's."""

from __future__ import annotations

import pytest
import torch

from handlers.config import CompileSpec, ConfigError, DType, load_config
from handlers.rungs import CompileRung
from handlers.rungs.dynamo_counts import dynamo_counts
from handlers.rungs.small_batch_graph import SmallBatchForward, tokens_of, unsupported_reason

SMALL = 32


def settings(**shapes):
    return {"pt2": {"compile": {"enable": True, "dynamic": True}},
            "pt2_handlers": {"task": "embeddings", "freezing": True,
                             "shapes": {"batch_sizes": [1, 8], "seq_lengths": [16, 64], **shapes}}}


def test_the_config_turns_it_on_for_frozen_dynamic_compiles_and_describe_says_so():
    config = load_config(settings(small_batch_tokens=SMALL))
    assert config.served_compile.small_batch_tokens == SMALL
    assert config.served_compile.describe()["small_batch_tokens"] == SMALL
    assert config.settings.shapes.describe()["small_batch_tokens"] == SMALL
    assert load_config(settings()).served_compile.small_batch_tokens == 0
    # The fallback compile is the plain one: one graph.
    assert config.served_compile.safer().small_batch_tokens == 0


@pytest.mark.parametrize(("change", "says"), [
    ({"shapes": {"policy": "buckets", "small_batch_tokens": SMALL}}, "needs the dynamic policy"),
    ({"freezing": False, "shapes": {"small_batch_tokens": SMALL}}, "needs freezing: true"),
    ({"shapes": {"batch_sizes": [1, 8], "seq_lengths": [64, 128], "small_batch_tokens": SMALL}},
     "no warmup shape has at most 32 tokens"),
])
def test_the_config_refuses_a_small_batch_graph_that_could_not_work(change, says):
    raw = settings()
    raw["pt2"]["compile"]["dynamic"] = "policy" not in change.get("shapes", {})
    raw["pt2_handlers"] = {**raw["pt2_handlers"], **change}
    with pytest.raises(ConfigError, match=says):
        load_config(raw)


def test_batches_go_to_the_graph_their_tokens_say():
    forward = SmallBatchForward(lambda **batch: "large", lambda **batch: "small", SMALL)

    def ids(rows, length):
        return {"input_ids": torch.zeros(rows, length, dtype=torch.long)}

    assert [forward(**ids(1, 16)), forward(**ids(2, 16)), forward(**ids(1, 32)), forward(**ids(1, 33)),
            forward(**ids(8, 16))] == ["small", "small", "small", "large", "large"]
    assert (forward.small_batches, forward.large_batches) == (3, 2)
    assert tokens_of({"x": torch.zeros(5)}) == 5


class TinyEncoder(torch.nn.Module):
    """Token ids -> one vector per row, through linears the GEMM template can take."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        return (hidden + self.down(torch.nn.functional.gelu(self.up(hidden)))).mean(dim=1)


def batch(rows, length, seed):
    return {"input_ids": torch.randint(0, 100, (rows, length), generator=torch.Generator().manual_seed(seed))}


# torch 2.13 only: torch 2.8 (the ipex profile) keeps both graphs in one cache of this forward, guards each copy's
# frozen weights by identity, and its small graph (from the graph cache, traced at 1 x 16) was specialized to one row,
# so (2, 16) matched neither and was traced again (measured; with the setting off, 2.8 keeps one graph: docs/shapes.md).
@pytest.mark.default_profile
def test_both_graphs_are_traced_in_the_warmup_and_serve_every_later_size_without_a_new_compile():
    torch._dynamo.reset()
    model = TinyEncoder().eval()
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=True, freezing=True, one_graph=True,
                       small_batch_tokens=SMALL)
    rung = CompileRung("compile", spec)
    forward = rung.apply(model, DType.FLOAT32)
    assert isinstance(forward, SmallBatchForward)
    warmup = [batch(1, 16, 0), batch(1, 64, 1), batch(8, 16, 2), batch(8, 64, 3)]  # as the dynamic policy warms
    with torch.inference_mode(), rung.warmup_context(len(warmup)):
        for one in warmup:
            torch.testing.assert_close(forward(**one), model(**one))
    assert (forward.small_batches, forward.large_batches) == (1, 3)
    graphs = dynamo_counts().graphs
    later = [batch(2, 16, 4), batch(1, 32, 5), batch(1, 17, 6), batch(1, 48, 7), batch(3, 40, 8), batch(8, 128, 9)]
    with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
        for one in later:
            torch.testing.assert_close(forward(**one), model(**one))
    assert dynamo_counts().graphs == graphs
    assert (forward.small_batches, forward.large_batches) == (4, 6)
    torch._dynamo.reset()


def test_a_torch_without_working_small_graphs_keeps_one_graph_and_describe_says_why():
    """Both profiles: torch 2.13 (default) builds the second graph; torch 2.8 (ipex) keeps one and notes why, since
    its small graph could come back from the graph cache fitted to one row and serve later sizes eagerly."""
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=True, freezing=True, one_graph=True,
                       small_batch_tokens=SMALL)
    rung = CompileRung("compile", spec)
    works = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
    assert (unsupported_reason() is None) == works
    notes = rung.notes(torch.device("cpu"))
    assert notes == ([] if works else [unsupported_reason()])
    if not works:
        assert notes[0].startswith(f"shapes.small_batch_tokens: one graph under torch {torch.__version__}")
    assert isinstance(rung.apply(TinyEncoder().eval(), DType.FLOAT32), SmallBatchForward) == works  # nothing traced yet
    # int8 keeps one graph on every torch: the small graph's int8 template answered wrong (handlers.rungs)
    assert not isinstance(rung.apply(TinyEncoder().eval(), DType.INT8), SmallBatchForward)
    plain = CompileRung("compile", CompileSpec(enabled=True, dynamic=True, freezing=True))
    assert plain.notes(torch.device("cpu")) == []  # without the setting, nothing to say
