"""The ladder with small real modules and fault-injecting rungs: the right rung ends active, reasons are
recorded, and every output the caller sees is correct."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from handlers.config import CompileSpec, DType, RungName, Tolerance, load_config
from handlers.ladder import (
    AttemptStatus,
    CompileRung,
    EagerRung,
    GuardedForward,
    IpexRung,
    ParityError,
    Rung,
    build_ladder,
    compare_outputs,
    run_ladder,
)

TOL = Tolerance(atol=1e-4, rtol=1e-3)


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture
def net():
    return SmallNet().eval()


@pytest.fixture
def batches():
    generator = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(2, 8, generator=generator)}, {"x": torch.randn(3, 8, generator=generator)}]


class FaultyRung(Rung):
    """Wraps the module; fails the way it is told to."""

    def __init__(self, name, fail_at=None, fail_on_call=None):
        self.name = name
        self.fail_at = fail_at
        self.fail_on_call = fail_on_call
        self.calls = 0

    def apply(self, module):
        if self.fail_at == "apply":
            raise RuntimeError("boom at compile")

        def forward(**batch):
            self.calls += 1
            if self.fail_at == "first_forward" or self.calls == self.fail_on_call:
                raise RuntimeError(f"boom on call {self.calls}")
            out = module(**batch)
            return out + 0.5 if self.fail_at == "wrong" else out

        return forward


def eager_out(net, batch):
    with torch.inference_mode():
        return net(**batch)


@pytest.mark.parametrize(
    ("fail_at", "reason"),
    [
        ("apply", "RuntimeError: boom at compile"),
        ("first_forward", "RuntimeError: boom on call 1"),
        ("wrong", "ParityError: output 0 differs from eager by up to 0.5 (atol=0.0001, rtol=0.001)"),
    ],
)
def test_a_failing_rung_hands_over_to_the_next(net, batches, fail_at, reason):
    result = run_ladder(net, [FaultyRung("compile", fail_at), FaultyRung("safe_compile"), EagerRung()], batches, TOL)
    assert result.active == "safe_compile"
    first, second = result.attempts
    assert (first.rung, first.status, first.reason) == ("compile", AttemptStatus.FAILED, reason)
    assert (second.rung, second.status, second.reason) == ("safe_compile", AttemptStatus.ACCEPTED, None)
    assert all(a.seconds >= 0 for a in result.attempts)
    for batch in batches:
        torch.testing.assert_close(result.forward(**batch), eager_out(net, batch))


def test_everything_failing_ends_on_eager(net, batches):
    rungs = [FaultyRung("compile", "apply"), FaultyRung("safe_compile", "wrong"), FaultyRung("ipex", "first_forward"),
             EagerRung()]
    result = run_ladder(net, rungs, batches, TOL)
    assert result.active == "eager"
    assert [a.status for a in result.attempts] == [AttemptStatus.FAILED] * 3 + [AttemptStatus.ACCEPTED]
    assert result.forward is net


def test_ladder_without_an_eager_rung_still_falls_back_to_eager(net, batches):
    result = run_ladder(net, [FaultyRung("compile", "apply")], batches, TOL)
    assert result.active == "eager" and result.forward is net


def test_live_failure_on_the_third_batch_is_answered_eagerly_then_demotes(net, batches, caplog):
    rung = FaultyRung("compile", fail_on_call=len(batches) + 3)  # warmup uses the first calls
    result = run_ladder(net, [rung, EagerRung()], batches, TOL)
    assert result.active == "compile"
    guard = GuardedForward(result, net, max_failures=2)
    live = batches[0]
    expected = eager_out(net, live)
    for _ in range(2):
        torch.testing.assert_close(guard(**live), expected)
    assert guard.failures == 0
    torch.testing.assert_close(guard(**live), expected)  # the 3rd live batch raised inside the rung
    assert guard.failures == 1 and guard.active == "compile" and not guard.demoted
    assert "boom on call" in guard.last_failure
    assert "answering this batch eagerly" in caplog.text

    rung.fail_on_call = rung.calls + 1  # the next optimized call fails too -> 2nd failure -> demote
    torch.testing.assert_close(guard(**live), expected)
    assert guard.failures == 2 and guard.active == "eager" and guard.demoted
    calls = rung.calls
    torch.testing.assert_close(guard(**live), expected)
    assert rung.calls == calls, "a demoted guard must not call the optimized rung again"
    assert guard.describe() == {"accepted": "compile", "runtime_failures": 2, "max_runtime_failures": 2,
                                "last_failure": guard.last_failure, "demoted": True}


def test_guard_raises_when_eager_fails_too(net):
    rung = FaultyRung("compile", fail_on_call=2)
    result = run_ladder(net, [rung], [{"x": torch.zeros(1, 8)}], TOL)
    guard = GuardedForward(result, net, max_failures=3)
    with pytest.raises(RuntimeError):
        guard(x=torch.zeros(1, 5))  # wrong width: optimized and eager both fail


def test_real_compile_with_a_backend_that_raises_at_first_forward(net, batches):
    spec = load_config({"pt2": {"compile": {"enable": True,
                                            "backend": "tests.faulty_backends:raise_on_compile"}}}).compile
    compiled = CompileRung("compile", spec).apply(net)  # lazy: nothing fails yet
    assert compiled is not None
    result = run_ladder(net, [CompileRung("compile", spec), EagerRung()], batches, TOL)
    assert result.active == "eager"
    assert result.attempts[0].status is AttemptStatus.FAILED
    assert "injected failure" in result.attempts[0].reason


def test_real_compile_with_a_backend_that_returns_wrong_numbers(net, batches):
    spec = CompileSpec(enabled=True, backend="tests.faulty_backends:wrong_numbers")
    result = run_ladder(net, [CompileRung("compile", spec), EagerRung()], batches, TOL)
    assert result.active == "eager"
    assert result.attempts[0].reason.startswith("ParityError: output 0 differs from eager")


def test_real_inductor_compile_is_accepted(net, batches):
    spec = CompileSpec(enabled=True, backend="inductor", mode="reduce-overhead")
    result = run_ladder(net, [CompileRung("compile", spec), EagerRung()], batches, TOL)
    assert result.active == "compile", result.attempts
    fresh = {"x": torch.randn(4, 8)}
    with torch.inference_mode():
        torch.testing.assert_close(result.forward(**fresh), net(**fresh), atol=1e-5, rtol=1e-4)


def test_build_ladder_skips_what_cannot_run(net, batches):
    config = load_config({"pt2": {"compile": {"enable": False}}})
    result = run_ladder(net, build_ladder(config, torch.device("cpu")), batches, TOL)
    skipped = {a.rung: a.reason for a in result.attempts if a.status is AttemptStatus.SKIPPED}
    assert skipped["compile"] == skipped["safe_compile"] == "pt2.compile.enable is not true"
    assert "intel_extension_for_pytorch is not installed" in skipped["ipex"]
    assert result.active == "eager"


def test_safe_compile_identical_to_the_request_is_skipped():
    config = load_config({"pt2": {"compile": {"enable": True}}})
    rungs = build_ladder(config, torch.device("cpu"))
    assert [r.name for r in rungs] == ["compile", "safe_compile", "ipex", "eager"]
    assert rungs[1].unavailable_reason() == "identical to the compile rung"


def test_ipex_is_cpu_only():
    rung = IpexRung(torch.device("cuda", 0), DType.FLOAT32)
    assert rung.unavailable_reason() == "IPEX runs on CPU only; this worker uses cuda:0"


def test_a_broken_ipex_install_is_skipped_not_fatal(tmp_path, monkeypatch, net, batches):
    """IPEX 2.8 on another torch raises AttributeError while importing; that must become a skip reason."""
    package = tmp_path / "intel_extension_for_pytorch"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        import torch
        torch._C._this_attribute_does_not_exist  # what a mismatched wheel does at import
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "intel_extension_for_pytorch", raising=False)
    result = run_ladder(net, [IpexRung(torch.device("cpu"), DType.FLOAT32), EagerRung()], batches, TOL)
    ipex = result.attempts[0]
    assert ipex.status is AttemptStatus.SKIPPED
    assert "failed to import" in ipex.reason and "AttributeError" in ipex.reason
    assert result.active == RungName.EAGER.value


def test_compare_outputs_checks_structure_shape_and_values():
    a = {"x": torch.ones(2, 3), "y": (torch.zeros(1),)}
    compare_outputs(a, {"x": torch.ones(2, 3), "y": (torch.zeros(1),)}, TOL)
    with pytest.raises(ParityError, match="structure differs"):
        compare_outputs(a, {"x": torch.ones(2, 3)}, TOL)
    with pytest.raises(ParityError, match=r"shape \(2, 3\), eager \(3, 2\)"):
        compare_outputs(torch.ones(2, 3), torch.ones(3, 2), TOL)
    with pytest.raises(ParityError, match="differs from eager by up to inf"):
        compare_outputs(torch.tensor([float("nan")]), torch.tensor([1.0]), TOL)
