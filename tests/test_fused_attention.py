"""The fused attention kernel (handlers/cpu/fused_attention.cpp) against PyTorch's SDPA, and when a model uses it.

The kernel is AVX-512 code built with the machine's compiler: on a CPU without AVX-512 the kernel tests are deselected
(tests/conftest.py: fused_kernel, with the reason), and the choice tests check that models are left on SDPA and why."""

from __future__ import annotations

import hashlib

import pytest
import torch
import transformers

from handlers.cpu import features, fused_attention

F = torch.nn.functional

needs_kernel = pytest.mark.fused_kernel


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The kernel built and loaded, whatever torch's dispatch level (the AVX2-held stage runs these too)."""
    assert fused_attention.load(tmp_path_factory.mktemp("fused-attention")) is None


@pytest.fixture(scope="module")
def kernel(built):
    """The kernel as compiled graphs call it: on AMX tiles where the CPU has them."""
    return torch.ops.pt2_handlers.fused_attention


def cpu_has_amx() -> bool:
    """What the kernel's AMX path is built for (``-march=native`` defines __AMX_TILE__ and __AMX_BF16__)."""
    return {"amx_tile", "amx_bf16"} <= features.linux_cpu_flags()


def kernel_paths() -> list[str]:
    """The kernel as called, and where the CPU has AMX (which it then runs on) its AVX-512 path too: elsewhere that
    is the path called."""
    return ["fused_attention", "fused_attention_avx512"] if cpu_has_amx() else ["fused_attention"]


@pytest.fixture(scope="module", params=kernel_paths())
def each_path(built, request):
    """The kernel as called, and held to its AVX-512 path where the CPU has AMX."""
    return getattr(torch.ops.pt2_handlers, request.param)


def expected_instructions() -> str:
    return ("amx_bf16" if cpu_has_amx() else "avx512_bf16" if "avx512_bf16" in features.linux_cpu_flags()
            else "avx512f")


def heads(batch: int, length: int, heads_: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[batch, heads, length, size] as a linear layer's output viewed per head (strided, as in the model)."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(batch, length, heads_ * size, generator=generator).to(dtype)
    return flat.view(batch, length, heads_, size).transpose(1, 2)


def sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """SDPA in float32 on the same (rounded) inputs, laid out as the kernel answers: [batch, queries, heads, size]."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("size", [16, 32, 64])  # 16: float32 math for every dtype (not a multiple of 32)
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16,) * 3,
                                    (torch.bfloat16, torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "mixed", "fp32-values"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "full-bool", "additive", "holes", "additive-inf"])
@pytest.mark.parametrize("lengths", [(1, 1), (7, 7), (37, 37), (128, 128), (5, 70)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_sdpa(each_path, size, dtypes, mask_kind, lengths):
    kernel = each_path
    batch, queries, keys, n_heads = 3, *lengths, 2
    q = heads(batch, queries, n_heads, size, dtypes[0], 1)
    k, v = (heads(batch, keys, n_heads, size, dtype, seed) for dtype, seed in zip(dtypes[1:], (2, 3), strict=True))
    valid = torch.tensor([keys, max(1, keys - 3), max(1, keys // 2)])
    padding = torch.arange(keys)[None, :] < valid[:, None]  # [batch, keys]
    mask = {"none": None,
            "padding": padding[:, None, None, :],  # one row per text, as handlers.cpu.fused_attention.mask gives
            "full-bool": padding[:, None, None, :].expand(batch, 1, queries, keys).contiguous(),
            "additive": torch.where(padding, 0.0, -1e4)[:, None, None, :].expand(batch, n_heads, queries, keys)
            .to(dtypes[0]),
            # keys masked inside the text, not only at its end: those past the last attended key are skipped
            "holes": (padding & (torch.arange(keys) % 3 != 1))[:, None, None, :],
            "additive-inf": torch.where(padding, 0.0, -torch.inf)[:, None, None, :]}[mask_kind]
    got = kernel(q, k, v, mask, size ** -0.5)
    want = sdpa(q, k, v, mask, size ** -0.5)
    assert got.shape == (batch, queries, n_heads, size) and got.dtype == dtypes[0] and got.is_contiguous()
    tolerance = 2e-5 if dtypes[0] == torch.float32 and all(d == torch.float32 for d in dtypes) else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@needs_kernel
def test_a_query_that_may_attend_to_nothing_gets_zeros(kernel):
    q, k, v = (heads(1, 4, 1, 32, torch.float32, seed) for seed in (1, 2, 3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 2] = False
    got = kernel(q, k, v, mask, 0.2)
    assert torch.equal(got[0, 2], torch.zeros(1, 32))
    torch.testing.assert_close(got[0, [0, 1, 3]], sdpa(q, k, v, mask, 0.2)[0, [0, 1, 3]], atol=2e-5, rtol=2e-5)


@needs_kernel
def test_float32_values_are_not_rounded_to_bf16(each_path):
    """An int8 model keeps sensitive value projections in float32: the kernel multiplies them as they are (AVX-512:
    bf16 dot products only for the bf16 queries and keys; AMX: values and probabilities as two bf16 halves each,
    good to ~2^-16), so the answer is SDPA's in float32, rounded once to bf16."""
    kernel = each_path
    q, k = (heads(2, 64, 2, 32, torch.bfloat16, seed) for seed in (1, 2))
    v = heads(2, 64, 2, 32, torch.float32, 3)
    want = sdpa(q, k, v, None, 0.18).to(torch.bfloat16).float()
    torch.testing.assert_close(kernel(q, k, v, None, 0.18).float(), want, atol=1e-3, rtol=2 ** -7)  # one bf16 step
    if "avx512_bf16" in features.linux_cpu_flags():  # bf16 values take bf16 probabilities too: a coarser answer
        with pytest.raises(AssertionError):
            torch.testing.assert_close(kernel(q, k, v.to(torch.bfloat16), None, 0.18).float(), want, atol=1e-3,
                                       rtol=2 ** -7)


@needs_kernel
def test_the_amx_path_answers_as_the_avx512_path(built):
    """Same inputs, same roundings: where the CPU has AMX the two paths differ only in the order of float32 sums
    (float32 values: by the ~2^-16 of their two bf16 halves), so within one bf16 step of each other; elsewhere they
    are one path."""
    for values in (torch.bfloat16, torch.float32):
        q, k = (heads(4, 77, 3, 64, torch.bfloat16, seed) for seed in (1, 2))
        v = heads(4, 77, 3, 64, values, 3)
        mask = (torch.arange(77)[None, :] < torch.tensor([77, 60, 33, 1])[:, None])[:, None, None, :]
        amx = torch.ops.pt2_handlers.fused_attention(q, k, v, mask, 0.125).float()
        avx512 = torch.ops.pt2_handlers.fused_attention_avx512(q, k, v, mask, 0.125).float()
        torch.testing.assert_close(amx, avx512, atol=2 ** -8, rtol=2 ** -7)
        if expected_instructions() != "amx_bf16":
            assert torch.equal(amx, avx512)


@needs_kernel
def test_torchs_own_amx_kernels_still_answer_after_the_kernel(built):
    """On AMX the kernel loads its own tile configuration and puts the caller's back: torch's bf16 matmuls (oneDNN,
    AMX where the CPU has it) and SDPA, run between its calls on the same threads, answer as before it ran."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 384).bfloat16(), torch.randn(1536, 384).bfloat16()
    q, k, v = (heads(2, 128, 12, 32, torch.bfloat16, seed) for seed in (1, 2, 3))
    with torch.inference_mode():
        linear, attention = F.linear(x, w), F.scaled_dot_product_attention(q, k, v)
        ours = torch.ops.pt2_handlers.fused_attention(q, k, v, None, 32 ** -0.5)
        for _ in range(3):
            assert torch.equal(torch.ops.pt2_handlers.fused_attention(q, k, v, None, 32 ** -0.5), ours)
            assert torch.equal(F.linear(x, w), linear)
            assert torch.equal(F.scaled_dot_product_attention(q, k, v), attention)


@needs_kernel
def test_the_outcome_says_which_instructions_the_kernel_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # the AVX2-held stage too
    outcome = choose(tiny_bert(), tmp_path)
    assert outcome.fused and outcome.describe()["instructions"] == expected_instructions(), outcome
    assert outcome.summary() == f"pt2_handlers_fused on {expected_instructions()} ({outcome.reason})"
    source = hashlib.sha256(fused_attention.SOURCE.read_bytes()).hexdigest()[:16]
    assert outcome.identity == f"pt2_handlers_fused {source} {expected_instructions()}"  # a changed kernel races again


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_text_whose_keys_are_all_masked_gets_zeros(kernel, dtype):
    """With one mask row per text the kernel skips the keys past the last attended one: here all of them."""
    q, k, v = (heads(2, 40, 2, 32, dtype, seed) for seed in (1, 2, 3))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1] = False
    got = kernel(q, k, v, mask, 0.2)
    assert torch.equal(got[1], torch.zeros(40, 2, 32, dtype=dtype))
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].float(), sdpa(q, k, v, mask, 0.2)[0], atol=tolerance, rtol=tolerance)


@needs_kernel
def test_kernel_refuses_what_it_does_not_compute(kernel):
    q = heads(1, 4, 2, 24, torch.float32, 1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(q, q, q, None, 0.2)
    q16 = heads(1, 4, 2, 32, torch.float16, 1)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        kernel(q16, q16, q16, None, 0.2)


def tiny_bert(heads_: int = 2, hidden: int = 64) -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=2,
                                     num_attention_heads=heads_, intermediate_size=128, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def choose(model, tmp_path, **overrides) -> fused_attention.Outcome:
    arguments = {"wanted": True, "causal": False, "backends": {"inductor"}} | overrides
    return fused_attention.use_in_compiled_graphs(model, torch.device("cpu"), tmp_path, **arguments)


@needs_kernel
def test_compiled_graphs_run_the_kernel_and_eager_forwards_run_sdpa(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # the AVX2-held stage too
    reference, model = tiny_bert(), tiny_bert()
    outcome = choose(model, tmp_path)
    assert outcome.fused and model.config._attn_implementation == fused_attention.IMPLEMENTATION, outcome
    inputs = batch()
    with torch.inference_mode():
        want = reference(**inputs).last_hidden_state
        assert torch.equal(model(**inputs).last_hidden_state, want)  # eager: transformers' SDPA function, exactly
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(model, backend=recording, dynamic=True)(**inputs).last_hidden_state
    calls = [node for graph in graphs for node in graph.graph.nodes
             if node.target in (torch.ops.pt2_handlers.fused_attention, torch.ops.pt2_handlers.fused_attention.default)]
    assert len(calls) == 2  # one per layer
    mask_shape = tuple(calls[0].args[3].meta["example_value"].shape)
    assert mask_shape[1:3] == (1, 1), mask_shape  # one padding row per text, not one per query
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, reason", [
    ({"wanted": False}, "pt2_handlers.attention is sdpa"),
    ({"causal": True}, "causal attention"),
    ({"backends": set()}, "no compile rung can run"),
    ({"backends": {"inductor", "ipex"}}, "compile backend ipex would trace the kernel too"),
])
def test_left_on_sdpa_where_it_does_not_apply(tmp_path, overrides, reason):
    model = tiny_bert()
    outcome = choose(model, tmp_path, **overrides)
    assert not outcome.fused and outcome.reason.startswith(reason), outcome
    assert model.config._attn_implementation == "sdpa"
    assert outcome.describe() == {"kernel": "sdpa", "reason": outcome.reason}
    assert outcome.summary() == f"sdpa ({outcome.reason})"
    assert outcome.identity == "sdpa"


def test_left_on_sdpa_where_torch_is_held_below_avx512(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    outcome = choose(tiny_bert(), tmp_path)
    assert not outcome.fused and "torch dispatches at AVX2 here" in outcome.reason, outcome
    assert fused_attention.unavailable_here() == outcome.reason


def test_left_on_sdpa_on_a_gpu_or_without_a_compile_cache(tmp_path):
    model = tiny_bert()
    on_gpu = fused_attention.use_in_compiled_graphs(model, torch.device("cuda"), tmp_path, wanted=True, causal=False,
                                                    backends={"inductor"})
    assert not on_gpu.fused and "runs on CPU" in on_gpu.reason
    no_cache = fused_attention.use_in_compiled_graphs(model, torch.device("cpu"), None, wanted=True, causal=False,
                                                      backends={"inductor"})
    assert not no_cache.fused and "no writable compile cache" in no_cache.reason
    assert model.config._attn_implementation == "sdpa"


def test_a_build_that_fails_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(fused_attention, "SOURCE", tmp_path / "broken.cpp")
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="exited"):
        fused_attention.build(tmp_path / "build")
    assert not list((tmp_path / "build").glob("*.so"))  # no half-written library left for the next worker


@needs_kernel
def test_the_kernel_is_built_once_per_machine_kind(tmp_path):
    first = fused_attention.build(tmp_path)
    built_at = first.stat().st_mtime_ns
    assert fused_attention.build(tmp_path) == first and first.stat().st_mtime_ns == built_at
    assert [path.name for path in tmp_path.iterdir()] == [first.name]
