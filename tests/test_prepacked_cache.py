"""A frozen graph (oneDNN-prepacked weights: int8, or float32 with symbolic rows) is kept in inductor's FX graph cache
and loaded from it, with the weights of the model being compiled, never those of the model that filled the cache.
Real inductor, real PT2E int8, a small model, a private cache directory."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from handlers.config import CompileSpec, DType
from handlers.precision import choice, quantize
from handlers.rungs import CompileRung, prepacked_cache

FEATURES, HIDDEN = 64, 128
EXAMPLES = [{"inputs": torch.randn(rows, FEATURES, generator=torch.Generator().manual_seed(rows))} for rows in (4, 8)]


class TwoLayers(torch.nn.Module):
    def __init__(self, flipped: bool):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(FEATURES, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, FEATURES)
        if flipped:  # other weights, the same quantization scales (symmetric per channel), so the same cache key
            with torch.no_grad():
                self.down.weight.neg_()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(inputs)))


def _compiled(dtype: DType, flipped: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model in ``dtype`` (int8, or float32 frozen with symbolic rows, as the shipped YAMLs serve fp32), and what
    its compile rung serves for ``EXAMPLES[1]``, compiled as in the ladder's warmup."""
    module = TwoLayers(flipped).eval()
    spec = CompileSpec(enabled=True, backend="inductor")
    if dtype is DType.INT8:
        module = quantize.static_int8(module, EXAMPLES, keep_float=lambda name, layer: False,
                                      weights=choice.int8_weights())  # as the rung builds it on this CPU
    else:
        spec = CompileSpec(enabled=True, backend="inductor", dynamic=True, freezing=True)
    rung = CompileRung("compile", spec)
    forward = rung.apply(module, dtype)
    with rung.warmup_context(1), torch.no_grad():
        return module, forward(**EXAMPLES[1])


def _graph_cache_use() -> dict[str, int]:
    return {outcome: counters["inductor"][f"fxgraph_cache_{outcome}"] for outcome in ("hit", "miss", "bypass")}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [pytest.param(DType.INT8, marks=pytest.mark.torchao), DType.FLOAT32])
def test_a_frozen_graph_is_cached_and_loaded_with_the_weights_being_compiled(private_inductor_cache, dtype):
    """The model's own answers (int8: the PT2E reference's, up to rounding), where the other model's weights would be
    over 100 % off. torch 2.8 (the ipex profile, float32 only) packs frozen float32 weights for MKL, not oneDNN: its
    graph is cached all the same."""
    inputs = EXAMPLES[1]
    counters.clear()
    first, served_first = _compiled(dtype, flipped=False)
    with torch.no_grad():
        assert _relative_error(served_first, first(**inputs)) < 0.02
    # stored, not bypassed for its oneDNN weights
    assert _graph_cache_use() == {"hit": 0, "miss": 1, "bypass": 0}

    torch._dynamo.reset()  # a new worker: nothing compiled in memory, the cache on disk
    counters.clear()
    other, served_other = _compiled(dtype, flipped=True)  # other weights (int8: the same scales)
    with torch.no_grad():
        assert _relative_error(served_other, other(**inputs)) < 0.02
    assert _graph_cache_use() == {"hit": 1, "miss": 0, "bypass": 0}
    assert _relative_error(served_other, served_first) > 1  # the new weights served, not the cached ones


def _cache_key_methods() -> tuple[object, ...]:
    from torch._inductor import codecache

    return (getattr(codecache, "CacheabilityValidator", None).__dict__.get("check_tensor")
            if hasattr(codecache, "CacheabilityValidator") else None,
            codecache.FxGraphCachePickler.__dict__["_reduce_tensor"])


def test_the_cache_key_change_holds_only_while_entered_and_nests():
    """torch 2.13 (the default profile) has what it changes; torch 2.8 (the ipex profile, no int8) has not, and
    there it changes nothing."""
    from torch._inductor import codecache

    applies = torch.__version__ >= "2.13"
    before = _cache_key_methods()
    with prepacked_cache.keyed_by_metadata() as outer:
        assert outer is applies
        changed = _cache_key_methods()
        assert (changed != before) is applies
        with prepacked_cache.keyed_by_metadata() as inner:
            assert inner is applies and _cache_key_methods() == changed
        assert _cache_key_methods() == changed
    assert _cache_key_methods() == before
    unfrozen = torch.randn(4, 4).to_mkldnn()  # not a frozen weight: still refused, as torch does
    with prepacked_cache.keyed_by_metadata(), pytest.raises(codecache.BypassFxGraphCache, match="mkldnn"):
        codecache.FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(unfrozen)


def test_only_frozen_oneDNN_weights_too_large_to_inline_are_keyed_by_their_shape():
    """On torch 2.13; on torch 2.8 (the ipex profile) every oneDNN tensor is refused, as torch does."""
    from torch._inductor import codecache, freezing_utils

    def frozen(tensor):
        with freezing_utils.enter_freezing():
            freezing_utils.maybe_set_is_frozen_param(tensor)
        return tensor

    one, other = (frozen(torch.randn(16, 4, generator=torch.Generator().manual_seed(seed)).to_mkldnn())
                  for seed in (1, 2))
    small = frozen(torch.randn(4).to_mkldnn())  # inductor would inline its values into the code
    with prepacked_cache.keyed_by_metadata() as applies:
        # made while entered, as inductor makes its pickler for each graph it compiles
        pickler = codecache.FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
        if applies:
            assert pickler.dumps(one) == pickler.dumps(other)  # values come from the model being compiled
            assert pickler.dumps(one) != pickler.dumps(frozen(torch.randn(16, 8).to_mkldnn()))
        else:
            with pytest.raises(codecache.BypassFxGraphCache, match="mkldnn"):
                pickler.dumps(one)
        with pytest.raises(codecache.BypassFxGraphCache, match="mkldnn"):
            pickler.dumps(small)
