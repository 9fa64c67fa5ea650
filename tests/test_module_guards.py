"""Compiles leave out dynamo's guards on the model's attributes only where the model's own forwards leave them as
they were (handlers.rungs.module_guards): the ladder looks, describe says which and why, and two compiled copies of one
class still run their own graphs."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from handlers.config import CompileSpec, DType, ModuleGuards, load_config
from handlers.errors import ConfigError
from handlers.ladder import Precisions, Warmup, run_ladder
from handlers.rungs import CompileRung, EagerRung, module_guards
from handlers.rungs.dynamo_counts import dynamo_counts
from handlers.tasks.embeddings import CosineGate

GATE = CosineGate(0.9999)


class Scaled(torch.nn.Module):
    """A linear layer and a Python float its forward reads (a guard on the module's attribute)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(8, 8)
        self.scale = 2.0
        self.config = SimpleNamespace(flag=True, sizes=[8, 8])

    def forward(self, x):
        return self.linear(x) * self.scale


class Counting(Scaled):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class SetsUpOnce(Scaled):
    """Keeps a table made at its first call, as rotary embeddings or a warned-once flag do."""

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.ones(8)
        return super().forward(x) + 0 * self.table


def batches(count=2):
    generator = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, 8, generator=generator)} for rows in range(2, 2 + count)]


def run(module, batch):
    return module(**batch)


def ladder(model, backend="inductor", freezing=True, optional=True):
    """The ladder over a compile rung and eager, fp32, from a clean dynamo."""
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend=backend, dynamic=False, freezing=freezing)
    return run_ladder(model, [CompileRung("compile", spec), EagerRung()], Warmup(batches(), lambda dtype: GATE),
                      Precisions((DType.FLOAT32,)), module_guards_optional=optional)


def test_the_state_is_the_same_after_forwards_that_change_nothing_and_what_set_up_once():
    for model in (Scaled(), SetsUpOnce()):
        with torch.inference_mode():
            results, changed = module_guards.run_watching_state(model, batches(3), run)
        assert changed == [] and len(results) == 3


def test_what_a_forward_changes_is_named_down_to_a_config_attribute():
    model = Counting()
    with torch.inference_mode():
        _, changed = module_guards.run_watching_state(model, batches(), run)
    assert changed == ["calls"]
    before = module_guards.state_of(model)
    model.config.flag = False
    model.config.sizes.append(16)
    model.linear.weight = torch.nn.Parameter(model.linear.weight.detach().clone())
    changed = module_guards.changes(before, module_guards.state_of(model))
    assert {"config.flag", "config.sizes", "config.sizes[2]"} <= set(changed), changed
    assert any(path.startswith("linear._parameters") for path in changed), changed


def test_one_batch_is_run_twice_so_a_counter_still_shows():
    model = Counting()
    with torch.inference_mode():
        results, changed = module_guards.run_watching_state(model, batches(1), run)
    assert len(results) == 1 and model.calls == 2 and changed == ["calls"]


def test_the_ladder_leaves_the_guards_out_for_a_model_that_keeps_its_attributes_and_says_so():
    model = Scaled().eval()
    result = ladder(model)
    assert result.active == "compile"
    x = batches()[0]["x"]
    before = dynamo_counts().graphs
    model.scale = 3.0
    with torch.inference_mode():
        result.forward(x=x)
    unsupported = module_guards.unsupported_reason()
    if unsupported:  # torch 2.8, the ipex profile: every guard, so the change is seen and compiled
        assert result.module_guards == f"kept: {unsupported}" and dynamo_counts().graphs == before + 1
        return
    assert result.module_guards == ("left out: 2 eager forwards of the model left its attributes as they were "
                                    "(2 graph(s) without them)")  # static shapes: a graph per warmup batch
    # Left out for real: an attribute changed afterwards (which the model's own forwards never did) compiles
    # nothing new. That is the trade: the ladder looks first.
    assert dynamo_counts().graphs == before


def test_torch_2_8_keeps_every_guard_and_2_13_may_leave_them_out():
    """torch 2.8 reads each guard's value to hand the filter, and a guard that a config attribute is absent raises
    there (the ipex profile's MiniLM compile failed so, and served its safe compile)."""
    reason = module_guards.unsupported_reason()
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        assert reason is None
    else:
        assert reason is not None and torch.__version__ in reason and "2.13" in reason


def test_an_unfrozen_compile_keeps_every_guard_and_says_why():
    """Unfrozen, the weights are the graph's inputs, guarded by dtype and shape: nothing would tell two models of
    one class apart without the module guards."""
    model = Scaled().eval()
    result = ladder(model, backend="eager", freezing=False)
    assert result.active == "compile"
    unsupported = module_guards.unsupported_reason()
    assert result.module_guards == (f"kept: {unsupported}" if unsupported else "kept: the compile does not freeze the "
                                    "weights (graph inputs, guarded by dtype and shape only)")
    before = dynamo_counts().graphs
    model.scale = 3.0
    with torch.inference_mode():
        assert torch.allclose(result.forward(x=batches()[0]["x"]), model(batches()[0]["x"]))
    assert dynamo_counts().graphs == before + 1


def test_a_model_whose_forward_changes_an_attribute_keeps_every_guard_and_describe_names_it():
    model = Counting().eval()
    result = ladder(model, backend="eager", freezing=False)
    assert result.module_guards == "kept: the model's eager forwards changed calls"
    # Guarded: the counter in the graph is checked, so the compile rung is refused as recompiling every call
    # (tests/test_ladder.py::test_an_encoder_that_recompiles_every_call_is_not_accepted_as_compiled).
    assert result.active == "eager"


def test_two_frozen_copies_of_one_class_run_their_own_weights_without_the_guards():
    """Frozen, each copy's weights are constants of its graph, told apart by the identity of its first weight."""
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=False, freezing=True)
    first = Scaled(seed=0).eval()
    second = copy.deepcopy(first)
    with torch.no_grad():
        second.linear.weight.add_(1.0)
    x = batches()[0]["x"]
    for model in (first, second):
        forward = CompileRung("compile", spec).without_module_guards().apply(model, DType.FLOAT32)
        with torch.inference_mode():
            assert torch.allclose(forward(x=x), model(x), atol=1e-6)


class Stacked(torch.nn.Module):
    """One class, as many layers as asked: models of one class and different structure (as two int8 builds of one
    model, with different layers kept in float, are)."""

    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(layers)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("backend, freezing", [("inductor", True), ("eager", False)])
def test_a_model_compiled_after_another_of_its_class_was_dropped_runs_its_own_graph(backend, freezing):
    """The first model's graph stays in its class's frame cache after the model is gone, and the second model's
    first weight may come at the dead one's address. Frozen, dynamo drops the graphs of a weight it guarded by
    identity when the weight is freed; unfrozen, weights are guarded by dtype and shape only, so every guard stays."""
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend=backend, dynamic=False, freezing=freezing)
    x = batches()[0]["x"]
    for layers in (1, 2, 2, 1):
        model = Stacked(layers).eval()
        forward = CompileRung("compile", spec).without_module_guards().apply(model, DType.FLOAT32)
        with torch.inference_mode():
            assert torch.allclose(forward(x=x), model(x), atol=1e-6), layers
        del forward, model


def entry(guard_type, name, on_module=True):
    source = SimpleNamespace(is_unspecialized_nn_module=lambda: on_module)
    return SimpleNamespace(guard_type=guard_type, name=name, orig_guard=SimpleNamespace(source=source))


@pytest.mark.parametrize("anchors, kept", [
    ((entry("TYPE_MATCH", "self"), entry("ID_MATCH", "self._modules['linear']._parameters['weight']")),
     [True, True, True, False, False]),  # frozen: the weight by identity
    ((entry("TYPE_MATCH", "self"), entry("TENSOR_MATCH", "self._modules['linear']._parameters['weight']")),
     [True] * 5),  # the weights are inputs, guarded by dtype and shape only: everything
    ((entry("TYPE_MATCH", "self"),), [True] * 4),  # no weight to tell copies apart: everything
    ((entry("ID_MATCH", "self._parameters['w']"),), [True] * 4),  # no type of its own (a compiled function)
])
def test_the_filter_keeps_the_inputs_the_type_and_the_first_weights_identity_or_everything(anchors, kept):
    entries = [entry("TENSOR_MATCH", "x", on_module=False), *anchors,
               entry("CONSTANT_MATCH", "self.scale"), entry("TYPE_MATCH", "self._modules")]
    assert module_guards.without_module_guards(entries) == kept


def test_module_guards_keep_keeps_every_guard_whatever_the_model_does():
    config = load_config({"pt2_handlers": {"module_guards": "keep"}})
    assert config.settings.module_guards is ModuleGuards.KEEP
    assert load_config({}).settings.module_guards is ModuleGuards.AUTO
    with pytest.raises(ConfigError, match="module_guards"):
        load_config({"pt2_handlers": {"module_guards": "off"}})
    model = Scaled().eval()
    result = ladder(model, backend="eager", freezing=False, optional=False)
    assert (result.active, result.module_guards) == ("compile", "kept: pt2_handlers.module_guards is keep")
    before = dynamo_counts().graphs
    model.scale = 3.0
    with torch.inference_mode():
        assert torch.allclose(result.forward(x=batches()[0]["x"]), model(batches()[0]["x"]))
    assert dynamo_counts().graphs == before + 1  # guarded: the change is seen and compiled


def test_the_default_archives_compile_a_mode_and_freezing_takes_the_filter():
    """torch.compile takes a mode or options, and the filter goes in the options: with freezing, reduce-overhead
    (the default archive's mode, CUDA graphs on a GPU) is spelled out as its options."""
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend="inductor", mode="reduce-overhead", dynamic=False, freezing=True)
    model = Scaled().eval()
    rung = CompileRung("compile", spec).without_module_guards()
    forward = rung.apply(model, DType.FLOAT32)
    x = batches()[0]["x"]
    with torch.inference_mode():
        assert torch.allclose(forward(x=x), model(x), atol=1e-6)
    left_out = rung.module_guard_filter(DType.FLOAT32)
    assert left_out is not None and (left_out.left_out, left_out.kept) == (1, 0)
