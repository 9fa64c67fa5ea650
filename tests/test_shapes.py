"""handlers/config/shapes.py: the padded shape each batch runs at."""

from __future__ import annotations

import torch

from handlers.config import CompileSpec, DType
from handlers.config.shapes import PolicyKind, ShapePolicy
from handlers.serving.batching import pad_batch
from handlers.rungs import CompileRung, EagerRung


def half(policy: ShapePolicy) -> ShapePolicy:
    """The policy as a worker serving bf16/fp16 resolves it (seq_multiple left to the precision)."""
    return policy.for_served(kernels_per_shape=True)


def test_dynamic_pads_the_sequence_up_to_a_multiple_of_16_and_keeps_the_rows():
    policy = half(ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16, 64, 256)).fitted(256))
    assert [policy.serving_shape(3, seq) for seq in (1, 15, 16, 17, 100, 241, 256)] == [
        (3, 16), (3, 16), (3, 16), (3, 32), (3, 112), (3, 256), (3, 256)]
    # every length from 1 to 256 at every batch size runs at 4 x 16 shapes: the matmul kernels (and the oneDNN
    # primitives cached per shape in bf16) stay bounded however mixed the traffic is
    assert len({policy.serving_shape(rows, seq) for rows in range(1, 5) for seq in range(1, 257)}) == 64


def test_dynamic_rounding_never_pads_past_the_models_max_length():
    policy = half(ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16, 64)).fitted(100))
    assert policy.serving_shape(2, 90) == (2, 96) and policy.serving_shape(2, 97) == (2, 100)
    assert policy.serving_shape(2, 100) == (2, 100)


def test_seq_multiple_1_runs_each_batch_at_its_own_length():
    policy = half(ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16,), seq_multiple=1).fitted(256))
    assert policy.serving_shape(3, 17) == (3, 17)


def test_what_keeps_no_kernel_per_shape_keeps_exact_lengths_unless_the_yaml_says_otherwise():
    """Unfrozen fp32 matmuls go through MKL, which keeps nothing per shape: padding would only cost time there."""
    policy = ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16,)).fitted(256)
    assert policy.for_served(kernels_per_shape=False).serving_shape(3, 17) == (3, 17)
    assert policy.for_served(kernels_per_shape=True).serving_shape(3, 17) == (3, 32)
    configured = ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16,), seq_multiple=8).fitted(256)
    assert configured.for_served(kernels_per_shape=False).serving_shape(3, 17) == (3, 24)


def test_buckets_ignore_the_multiple():
    policy = ShapePolicy(PolicyKind.BUCKETS, (1, 4), (16, 64)).fitted(128)
    assert policy.serving_shape(3, 17) == (4, 64) and policy.serving_shape(1, 100) == (1, 128)
    assert "seq_multiple" not in policy.describe()
    assert half(ShapePolicy(PolicyKind.DYNAMIC)).describe()["seq_multiple"] == 16


def test_the_rounded_shape_pads_with_masked_positions():
    batch = {"input_ids": torch.tensor([[101, 7, 102]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    shape = half(ShapePolicy(PolicyKind.DYNAMIC, (1, 4), (16,)).fitted(256)).serving_shape(1, 3)
    padded = pad_batch(batch, shape, {"input_ids": 0})
    assert padded["input_ids"].shape == (1, 16) and padded["attention_mask"][0].tolist() == [1, 1, 1] + [0] * 13


def _onednn_primitives_created(forward, capfd, lengths) -> int:
    """How many oneDNN primitives ``forward`` creates while it runs a batch at each of ``lengths``."""
    capfd.readouterr()
    with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        for length in lengths:
            forward(torch.randn(2, length, 64))
    return sum(",create:" in line for line in capfd.readouterr().out.splitlines())


def test_a_frozen_float32_graph_keeps_a_oneDNN_kernel_per_length_so_its_lengths_are_rounded(capfd):
    """Frozen, inductor prepacks float32 weights for oneDNN where the rows are symbolic, and oneDNN builds and keeps
    a primitive for each new length: a worker at exact lengths grew 36 % in a short soak on an AVX2 EPYC. Unfrozen,
    the same graph's matmuls go through MKL and create none. Real inductor, a small model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).eval()
    created = {}
    for freezing in (False, True):
        torch._dynamo.reset()
        rung = CompileRung("compile", CompileSpec(enabled=True, backend="inductor", dynamic=True, freezing=freezing))
        forward = rung.apply(model, DType.FLOAT32)
        with rung.warmup_context(2), torch.no_grad():
            forward(torch.randn(2, 16, 64)), forward(torch.randn(2, 24, 64))
        created[freezing] = _onednn_primitives_created(forward, capfd, lengths=(17, 18, 19))
        assert rung.keeps_kernels_per_shape(DType.FLOAT32) is freezing
    torch._dynamo.reset()
    # torch 2.8 (the ipex profile) packs them for MKL instead: there the rounding costs a little time, no memory
    assert created[False] == 0 and (created[True] >= 3) is (torch.__version__ >= "2.13"), created
    eager, unfrozen = EagerRung(), CompileRung("compile", CompileSpec(enabled=True, backend="inductor"))
    assert eager.keeps_kernels_per_shape(DType.BFLOAT16) and not eager.keeps_kernels_per_shape(DType.FLOAT32)
    assert unfrozen.keeps_kernels_per_shape(DType.INT8)  # int8 always freezes
