"""int8 beyond its rule: which of the layers static int8 keeps in float it can quantize too, measured one at a time
(handlers.precision.sensitivity), and the ladder building int8 again by the rule when the measured layers together lose
the answers. Real PT2E quantization, real fake quantization; the models are small and built to be sensitive where
the tests say."""

from __future__ import annotations

import pytest
import torch

from handlers.config import CompileSpec, DType
from handlers.ladder import AttemptStatus, Precisions, Site, Warmup, run_ladder
from handlers.ladder.decisions import DecisionStore
from handlers.precision import quantize, sensitivity
from handlers.rungs import CompileRung, EagerRung
from handlers.tasks.embeddings import CosineGate

pytestmark = pytest.mark.torchao


def widening_then_narrowing(outliers: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """An FFN's two linears, 16 -> 64 -> 16: the first ``outliers`` hidden channels 500 times the rest, ignored by
    the narrowing layer."""
    up, down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    with torch.no_grad():
        up.weight[:outliers] *= 500
        up.bias[:outliers] = 500
        down.weight[:, :outliers] = 0
    return up, down


class Branches(torch.nn.Module):
    """Three FFN-like branches, each widening then narrowing (the rule keeps the narrowing layers in float). In
    two, some hidden channels are 500 times the rest and the narrowing layer ignores them: one uint8 scale per
    tensor then rounds the channels it reads to a few steps. ``one``: a single such channel, which int8 can keep
    in float; ``many``: 16, more than it keeps. ``even``: none."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for branch, outliers in (("even", 0), ("one", 1), ("many", 16)):
            up, down = widening_then_narrowing(outliers)
            setattr(self, f"up_{branch}", up)
            setattr(self, f"down_{branch}", down)

    def forward(self, x):
        even, one, many = (getattr(self, f"down_{branch}")(torch.nn.functional.gelu(getattr(self, f"up_{branch}")(x)))
                           for branch in ("even", "one", "many"))
        return even + one + many


def batches(seed: int, count: int = 3) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 6, 16, generator=generator)} for _ in range(count)]


def cosine_score(batch_list):
    gate = CosineGate(0.0)

    def score(module):
        with torch.inference_mode():
            return min(gate.measure(module(**batch), want) for batch, want in zip(batch_list, wanted, strict=True))

    model = Branches().eval()
    with torch.inference_mode():
        wanted = [model(**batch) for batch in batch_list]
    return model, score


def test_cheap_layers_are_taken_one_with_its_outlier_channel_in_float_and_the_costly_one_is_not():
    judged = batches(seed=2)
    model, score = cosine_score(judged)
    before = [model(**batch) for batch in judged]
    choice = sensitivity.choose(model, ["down_even", "down_one", "down_many"], batches(seed=1), score, threshold=0.99)
    assert choice.taken == ("down_even",), choice
    assert list(choice.split) == ["down_one"] and 0 in choice.split["down_one"], choice.split
    assert len(choice.split["down_one"]) == sensitivity.OUTLIER_CHANNELS
    assert 0 <= choice.costs["down_even"] < 0.001 and 0 <= choice.costs["down_one"] < 0.001, choice.costs
    assert choice.costs["down_many"] > 0.1, choice.costs
    assert choice.budget == pytest.approx(sensitivity.SHARE * 0.01, abs=1e-6)
    assert "2 of the 3 layers kept in float by rule quantized too (1 with their 4 largest input channels in float)" \
        in choice.describe()
    assert 0 <= choice.together <= choice.budget
    # With the layers int8 quantizes anyway simulated too, the budget is a share of the margin they leave.
    widening = ["up_even", "up_one", "up_many"]
    anyway = sensitivity.choose(model, ["down_even", "down_one", "down_many"], batches(seed=1), score, threshold=0.99,
                                quantized=widening)
    assert anyway.budget < choice.budget and (anyway.taken, dict(anyway.split)) == (choice.taken, dict(choice.split))
    after = [model(**batch) for batch in judged]  # measured through hooks, removed after: the model is unchanged
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.modules())


def test_a_layer_split_around_its_outlier_channels_computes_the_same_and_quantizes_its_main_part():
    model = Branches().eval()
    split = Branches().eval()
    assert quantize.split_outliers(split, {"down_one": (0, 5, 6, 7)}) == {"down_one": "down_one.main"}
    assert isinstance(split.down_one, quantize.OutlierSplit)
    x = batches(seed=3, count=1)[0]["x"]
    with torch.inference_mode():
        torch.testing.assert_close(split(x), model(x), rtol=1e-5, atol=1e-3)
    quantized = quantize.static_int8(split, batches(seed=1), keep_float=lambda name, layer: name in ("down_even",
                                                                                                      "down_many"))
    targets = [str(node.target) for node in quantized.graph.graph.nodes if node.op == "call_function"]
    # the three widening layers, down_one's main part, and up_one's rows for the channels down_one keeps in float
    # (their own int8 linear, so up_one fuses GELU and its quantize step: handlers.precision.outlier_producers): five
    assert targets.count("quantized_decomposed.dequantize_per_channel.default") == 5, targets


def test_a_budget_of_nothing_takes_nothing_and_no_candidates_measure_nothing():
    model, score = cosine_score(batches(seed=2))
    nothing = sensitivity.choose(model, ["down_even"], batches(seed=1), score, threshold=1.0)
    assert nothing.taken == () and not nothing.split
    none = sensitivity.choose(model, [], batches(seed=1), score, threshold=0.99)
    assert none.taken == () and none.describe() == "no layer is kept in float by rule"


class Stack(torch.nn.Module):
    """Three FFN-like blocks in a ModuleList, run in turn with a residual (a transformer's layers, in small): the
    middle one's hidden channel 0 is 500 times the rest, the others even. ``ran`` counts each block's real runs (at
    its GELU: the linears are swapped for stand-ins while scored)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList()
        for outliers in (0, 1, 0):
            up, down = widening_then_narrowing(outliers)
            self.blocks.append(torch.nn.Sequential(up, torch.nn.GELU(), down))
        self.ran = [0, 0, 0]
        for index, block in enumerate(self.blocks):
            block[1].register_forward_pre_hook(lambda *_, index=index: self.ran.__setitem__(index, self.ran[index] + 1))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("held_out", [False, True], ids=["one-scorer", "held-out-scorer"])
def test_layers_after_the_first_block_are_scored_alone_on_its_replayed_outputs_with_the_same_answers(monkeypatch,
                                                                                                     held_out):
    """Scoring a layer alone reruns only its block and those after: the blocks before it give back what they gave
    (recorded once). The choice is the same to the bit as when every scoring runs the whole model."""
    judged = batches(seed=2)
    model = Stack().eval()
    with torch.inference_mode():
        wanted = [model(**batch) for batch in judged]
    gate = CosineGate(0.0)

    def scorer(count):
        def score(module):
            with torch.inference_mode():
                return min(gate.measure(module(**batch), want) for batch, want in
                           zip(judged[:count], wanted[:count], strict=True))
        return score

    def choose():
        model.ran = [0, 0, 0]
        return sensitivity.choose(model, ["blocks.0.2", "blocks.1.2", "blocks.2.2"], batches(seed=1), scorer(3),
                                  threshold=0.99, quantized=["blocks.0.0", "blocks.1.0", "blocks.2.0"],
                                  score_alone=scorer(2) if held_out else None), list(model.ran)

    replayed, ran = choose()
    monkeypatch.setattr(sensitivity, "REPLAY_BYTES", 0)  # nothing kept: every scoring runs the whole model
    whole, ran_whole = choose()
    assert (replayed.taken, dict(replayed.split), replayed.costs, replayed.together, replayed.budget) == (
        whole.taken, dict(whole.split), whole.costs, whole.together, whole.budget)
    assert "blocks.1.2" not in replayed.taken and replayed.costs["blocks.1.2"] > replayed.costs["blocks.0.2"]
    alone = 2 if held_out else 3  # the batches of one scoring alone: each block runs once per batch
    # Six scorings alone (3 layers x 2 forms): block 0 runs in the two of its own layer, block 1 in four.
    assert [whole - mine for whole, mine in zip(ran_whole, ran, strict=True)] == [4 * alone, 2 * alone, 0]
    assert not any(layer._forward_hooks for layer in model.modules())
    assert not any("forward" in vars(block) for block in model.blocks)


def test_a_scoring_that_feeds_answers_back_is_run_whole(monkeypatch):
    """A second pass over the model's own answer (as a decode loop feeds tokens back): on it the first block is given
    what the layer scored made, not what was recorded, so that scoring runs the whole model: the same choice."""
    judged = batches(seed=2)
    model = Stack().eval()

    def twice(module, batch):
        return module(module(**batch))

    with torch.inference_mode():
        wanted = [twice(model, batch) for batch in judged]
    gate = CosineGate(0.0)

    def score(module):
        with torch.inference_mode():
            return min(gate.measure(twice(module, batch), want) for batch, want in zip(judged, wanted, strict=True))

    def choose():
        model.ran = [0, 0, 0]
        return sensitivity.choose(model, ["blocks.0.2", "blocks.1.2", "blocks.2.2"], batches(seed=1), score,
                                  threshold=0.99, quantized=["blocks.0.0", "blocks.1.0", "blocks.2.0"]), list(model.ran)

    fed_back, ran = choose()
    monkeypatch.setattr(sensitivity, "REPLAY_BYTES", 0)
    whole, ran_whole = choose()
    assert (fed_back.taken, dict(fed_back.split), fed_back.costs, fed_back.together) == (
        whole.taken, dict(whole.split), whole.costs, whole.together)
    # Each scoring of a later block's layer stops at the second pass, then runs whole: more runs, never fewer.
    assert all(mine >= theirs for mine, theirs in zip(ran, ran_whole, strict=True)) and ran != ran_whole
    assert not any("forward" in vars(block) for block in model.blocks)


def ladder(model, memory=None):
    """int8, then fp32: a compile rung (dynamo's eager backend: the gate and the order are tested here) and eager."""
    rungs = [CompileRung("compile", CompileSpec(enabled=True, backend="eager")), EagerRung()]
    return run_ladder(model, rungs,
                      Warmup(batches(seed=1), lambda dtype: CosineGate(0.99 if dtype is DType.INT8 else 0.9999)),
                      Precisions((DType.INT8, DType.FLOAT32)), Site(decisions=memory))


def int8_compile_passed(result):
    [compiled] = [attempt for attempt in result.attempts if (attempt.rung, attempt.dtype) == ("compile", "int8")]
    return compiled.status in (AttemptStatus.ACCEPTED, AttemptStatus.SLOWER)  # passed the gate; then raced fp32


def test_the_ladder_quantizes_the_measured_layer_and_says_so():
    result = ladder(Branches().eval())
    screen = result.attempts[0]
    assert (screen.rung, screen.dtype, screen.status, screen.screen) == ("eager", "int8", AttemptStatus.PASSED, True)
    assert "2 of the 3 layers kept in float by rule quantized too (" in screen.reason, screen.reason
    assert 0.99 <= screen.quality.value < 0.9999
    assert int8_compile_passed(result)


def test_when_the_measured_layers_lose_the_answers_int8_is_built_again_by_the_rule(monkeypatch):
    """The measurement judges each layer with the rest in float; in the real int8 model they are int8 together.
    Where that loses the answers the gate catches it and int8 is built by the rule alone, visibly. (The measurement
    is made wrong on purpose here: it offers the narrowing layer of the branch with many outliers.)"""
    wrong = sensitivity.Choice(("down_many",), {"down_even": 0.0, "down_one": 0.0, "down_many": 0.0}, 0.0025, 0.1)
    monkeypatch.setattr(sensitivity, "choose", lambda *args, **kwargs: wrong)
    result = ladder(Branches().eval())
    first, second = result.attempts[:2]
    assert (first.dtype, first.status, first.screen) == ("int8", AttemptStatus.FAILED, True)
    assert first.quality is not None and first.quality.value < 0.99
    assert first.reason.endswith("with 1 of the 3 layers kept in float by rule quantized too, measured alone, then "
                                 "together: cost 0.000000 within 0.002500, 0.1s; int8 is built again with the "
                                 "rule's float layers"), first.reason
    assert (second.dtype, second.status, second.screen) == ("int8", AttemptStatus.PASSED, True)
    assert "the rule's float layers only: with the measured ones too it lost the answers" in second.reason
    assert int8_compile_passed(result)


def test_a_second_load_reads_the_measurement_an_earlier_one_kept(tmp_path, monkeypatch):
    """A warm worker does not measure again: the choice is kept beside the compile cache, keyed by the weights and
    batches, and read back; the int8 model built from it is judged by the gate as always. Other weights, another key:
    measured again."""
    memory = DecisionStore(tmp_path / "int8")
    first = ladder(Branches().eval(), memory=memory)
    assert len(list((tmp_path / "int8").glob("*.json"))) == 2  # the measurement, and int8's race against fp32
    measured = first.attempts[0].reason

    def measured_again(*args, **kwargs):
        raise AssertionError("measured again")

    real_choose = sensitivity.choose
    monkeypatch.setattr(sensitivity, "choose", measured_again)
    second = ladder(Branches().eval(), memory=memory)
    screen = second.attempts[0]
    assert screen.status is AttemptStatus.PASSED, screen.reason
    assert screen.reason.endswith("remembered from an earlier load); faster rungs try it first"), screen.reason
    assert measured.split("measured alone")[0] == screen.reason.split("measured alone")[0]
    assert int8_compile_passed(second)

    monkeypatch.setattr(sensitivity, "choose", real_choose)
    other = Branches().eval()
    with torch.no_grad():
        other.down_even.weight.mul_(1.01)
    third = ladder(other, memory=memory)
    assert "remembered" not in third.attempts[0].reason
    assert len(list((tmp_path / "int8").glob("*.json"))) == 4
