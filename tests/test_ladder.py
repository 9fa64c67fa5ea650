"""The ladder with small real modules and fault-injecting rungs: the right rung ends active, reasons are
recorded, and every output the caller sees is correct."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time

import pytest
import torch

from handlers.config import CompileSpec, DType, RungName, load_config
from handlers.config.shapes import AfterReady
from handlers.ladder import AttemptStatus, Calibration, Precisions, QualityError, Site, Warmup, race, run_ladder
from handlers.ladder.decisions import DecisionStore
from handlers.ladder.guard import GuardedForward, ShapeNotWarmed, is_refused_recompile
from handlers.rungs import CompileRung, EagerRung, IpexRung, Rung, build_rungs
from handlers.rungs import thread_guard as global_state
from handlers.rungs.dynamo_counts import dynamo_counts
from handlers.rungs.ipex import probe_ipex
from handlers.tasks.embeddings import CosineGate

GATE = CosineGate(0.9999)


def ipex_usable() -> bool:
    return probe_ipex()[0] is not None


def ladder(net, rungs, batches, gate=GATE, precisions=(DType.FLOAT32,)):
    """The ladder at ``precisions`` (fp32 alone by default: the serving module is the reference itself)."""
    return run_ladder(net, rungs, Warmup(batches, lambda dtype: gate), Precisions(precisions))


def compiled_graphs() -> int:
    return dynamo_counts().graphs


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x.to(self.up.weight.dtype))))


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

    def apply(self, module, dtype):
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
        ("wrong", "QualityError: min_cosine "),
    ],
)
def test_a_failing_rung_hands_over_to_the_next(net, batches, fail_at, reason):
    result = ladder(net, [FaultyRung("compile", fail_at), FaultyRung("safe_compile"), EagerRung()], batches)
    assert result.active == "safe_compile"
    first, second = result.attempts
    assert (first.rung, first.status) == ("compile", AttemptStatus.FAILED) and first.reason.startswith(reason)
    assert (second.rung, second.status, second.reason) == ("safe_compile", AttemptStatus.ACCEPTED, None)
    assert all(a.seconds >= 0 for a in result.attempts)
    for batch in batches:
        torch.testing.assert_close(result.forward(**batch), eager_out(net, batch))


def test_everything_failing_ends_on_eager(net, batches):
    rungs = [FaultyRung("compile", "apply"), FaultyRung("safe_compile", "wrong"), FaultyRung("ipex", "first_forward"),
             EagerRung()]
    result = ladder(net, rungs, batches)
    assert result.active == "eager"
    assert [a.status for a in result.attempts] == [AttemptStatus.FAILED] * 3 + [AttemptStatus.ACCEPTED]
    assert result.forward is net


def test_ladder_without_an_eager_rung_still_falls_back_to_eager(net, batches):
    result = ladder(net, [FaultyRung("compile", "apply")], batches)
    assert result.active == "eager" and result.forward is net


def test_live_failure_on_the_third_batch_is_answered_eagerly_then_demotes(net, batches, caplog):
    rung = FaultyRung("compile", fail_on_call=len(batches) + 3)  # warmup uses the first calls
    result = ladder(net, [rung, EagerRung()], batches)
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
                                "last_failure": guard.last_failure, "demoted": True, "after_ready": "eager",
                                "compiles_after_ready": 0, "eager_batches": 0, "frames_given_up": 0}


def test_guard_raises_when_eager_fails_too(net):
    rung = FaultyRung("compile", fail_on_call=2)
    result = ladder(net, [rung], [{"x": torch.zeros(1, 8)}])
    guard = GuardedForward(result, net, max_failures=3)
    with pytest.raises(RuntimeError):
        guard(x=torch.zeros(1, 5))  # wrong width: optimized and eager both fail


def test_real_compile_with_a_backend_that_raises_at_first_forward(net, batches):
    spec = load_config({"pt2": {"compile": {"enable": True,
                                            "backend": "tests.faulty_backends:raise_on_compile"}}}).compile
    compiled = CompileRung("compile", spec).apply(net, DType.FLOAT32)  # lazy: nothing fails yet
    assert compiled is not None
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "eager"
    assert result.attempts[0].status is AttemptStatus.FAILED
    assert "injected failure" in result.attempts[0].reason


def test_real_compile_with_a_backend_that_returns_wrong_numbers(net, batches):
    spec = CompileSpec(enabled=True, backend="tests.faulty_backends:wrong_numbers")
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "eager"
    assert result.attempts[0].reason.startswith("QualityError: min_cosine")
    assert result.attempts[0].quality.value < 0.9999 and result.attempts[0].quality.threshold == 0.9999


def test_real_inductor_compile_is_accepted(net, batches):
    spec = CompileSpec(enabled=True, backend="inductor", mode="reduce-overhead")
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "compile", result.attempts
    fresh = {"x": torch.randn(4, 8)}
    with torch.inference_mode():
        torch.testing.assert_close(result.forward(**fresh), net(**fresh), atol=1e-5, rtol=1e-4)


def test_build_ladder_skips_what_cannot_run(net, batches):
    config = load_config({"pt2": {"compile": {"enable": False}},
                          "pt2_handlers": {"ladder": ["compile", "safe_compile", "ipex", "eager"]}})
    result = ladder(net, build_rungs(config, torch.device("cpu")), batches)
    skipped = {a.rung: a.reason for a in result.attempts if a.status is AttemptStatus.SKIPPED}
    assert skipped["compile"] == skipped["safe_compile"] == "pt2.compile.enable is not true"
    if ipex_usable():  # the ipex profile: the IPEX rung runs, passes the gate and serves
        assert result.active == "ipex" and "ipex" not in skipped
    else:
        assert "intel_extension_for_pytorch is not installed" in skipped["ipex"]
        assert result.active == "eager"


def test_safe_compile_identical_to_the_request_is_skipped():
    config = load_config({"pt2": {"compile": {"enable": True}}, "pt2_handlers": {"freezing": False}})
    rungs = build_rungs(config, torch.device("cpu"))
    assert [r.name for r in rungs] == ["openvino", "compile", "safe_compile", "ipex", "eager"]
    assert rungs[2].unavailable_reason() == "identical to the compile rung"


@pytest.mark.parametrize("freezing", [True, False])
def test_freezing_makes_the_weights_constants_of_the_compiled_graph(freezing, net, batches):
    """``freezing: true`` must freeze: inductor folds the weights into the graph, so a later in-place change to
    a weight no longer reaches the output (torch.compile's ``options={"freezing": True}`` alone does not do it;
    the weights stay graph inputs). Without freezing the change shows."""
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=False, freezing=freezing)
    rung = CompileRung("compile", spec)
    forward = rung.apply(net, DType.FLOAT32)
    x = batches[0]["x"]
    with torch.inference_mode(), rung.warmup_context(1):  # traced as the ladder traces
        before = forward(x=x)
        torch.testing.assert_close(before, net(x))
    graphs = compiled_graphs()
    with torch.no_grad():
        net.down.bias.add_(1.0)  # the same tensor: dynamo's guards still pass, nothing is traced again
    with torch.inference_mode():
        after = forward(x=x)
    assert compiled_graphs() == graphs
    if freezing:
        torch.testing.assert_close(after, before)
    else:
        torch.testing.assert_close(after, before + 1.0)
    torch._dynamo.reset()


@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_cpp_wrapper_calls_the_kernels_from_cpp(cpp_wrapper, net, batches):
    """``pt2.compile.options: {cpp_wrapper: true}`` must reach inductor: the graph it generates is then C++ (an
    ``inductor_entry_impl`` that calls the kernels), not a Python ``call`` function; the answers stay the model's."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=False, options={"cpp_wrapper": cpp_wrapper})
    rung = CompileRung("compile", spec)
    forward = rung.apply(net, DType.FLOAT32)
    x = batches[0]["x"]
    with torch.inference_mode(), rung.warmup_context(1):
        out, code = run_and_get_code(forward, x=x)
    torch.testing.assert_close(out, net(x))
    assert any("inductor_entry_impl" in source for source in code) is cpp_wrapper
    torch._dynamo.reset()


def test_ipex_is_cpu_only():
    rung = IpexRung(torch.device("cuda", 0))
    assert rung.unavailable_reason() == "IPEX runs on CPU only; this worker uses cuda:0"


def test_a_broken_ipex_install_is_skipped_not_fatal(tmp_path, monkeypatch, request, net, batches):
    """IPEX 2.8 on another torch raises AttributeError while importing; that must become a skip reason."""
    package = tmp_path / "intel_extension_for_pytorch"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        import torch
        torch._C._this_attribute_does_not_exist  # what a mismatched wheel does at import
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "intel_extension_for_pytorch", raising=False)
    probe_ipex.cache_clear()
    request.addfinalizer(probe_ipex.cache_clear)  # the real IPEX (or its absence) for later tests
    result = ladder(net, [IpexRung(torch.device("cpu")), EagerRung()], batches)
    ipex = result.attempts[0]
    assert ipex.status is AttemptStatus.SKIPPED
    assert "failed to import" in ipex.reason and "AttributeError" in ipex.reason
    assert result.active == RungName.EAGER.value


def test_cosine_gate_checks_shape_and_nan():
    assert GATE.measure(torch.ones(2, 3), [torch.ones(2, 3)]) == pytest.approx(1.0)
    with pytest.raises(QualityError, match=r"shape \(2, 3\), fp32 eager \(3, 2\)"):
        GATE.measure(torch.ones(2, 3), [torch.ones(3, 2)])
    assert GATE.measure(torch.tensor([[float("nan"), 1.0]]), [torch.ones(1, 2)]) == -1.0


def test_a_bf16_rung_is_judged_against_fp32_eager_and_recorded(net, batches):
    result = ladder(net, [EagerRung()], batches, CosineGate(0.999), precisions=(DType.BFLOAT16,))
    assert (result.active, result.dtype) == ("eager", DType.BFLOAT16)
    screen, accepted = result.attempts
    assert (screen.rung, screen.status, screen.dtype) == ("eager", AttemptStatus.PASSED, "bfloat16") and screen.screen
    assert 0.999 <= screen.quality.value < 1.0 and accepted.quality == screen.quality
    assert (accepted.status, accepted.reason) == (AttemptStatus.ACCEPTED, "answers proven by its screen")
    assert accepted.to_json()["quality"]["metric"] == "min_cosine"
    assert next(result.forward.parameters()).dtype is torch.bfloat16 and next(net.parameters()).dtype is torch.float32


def test_a_precision_that_fails_its_screen_is_compiled_nowhere(net, batches):
    """bf16 cannot keep 6 nines, even eagerly: no rung is tried in it; compile runs in fp32 at once."""
    compile_rung = FaultyRung("compile")
    result = ladder(net, [compile_rung, FaultyRung("safe_compile"), EagerRung()], batches,
                    CosineGate(0.999999), precisions=(DType.BFLOAT16, DType.FLOAT32))
    assert [(a.rung, a.status, a.dtype) for a in result.attempts] == [
        ("eager", AttemptStatus.FAILED, "bfloat16"), ("compile", AttemptStatus.ACCEPTED, "float32")]
    assert result.attempts[0].screen and "so no rung runs in bfloat16" in result.attempts[0].reason
    assert (result.active, result.dtype) == ("compile", DType.FLOAT32)


def test_a_rung_that_fails_the_gate_in_bf16_is_tried_in_fp32_before_the_next_rung(net, batches):
    class LossyInBf16(FaultyRung):  # a compile whose bf16 numbers are off, though eager bf16 is fine
        def apply(self, module, dtype):
            forward = super().apply(module, dtype)
            return (lambda **batch: forward(**batch) + 0.5) if dtype is DType.BFLOAT16 else forward

    result = ladder(net, [LossyInBf16("compile"), FaultyRung("safe_compile"), EagerRung()], batches,
                    CosineGate(0.999), precisions=(DType.BFLOAT16, DType.FLOAT32))
    assert [(a.rung, a.status.value, a.dtype) for a in result.attempts] == [
        ("eager", "passed", "bfloat16"), ("compile", "failed", "bfloat16"), ("compile", "accepted", "float32")]


def test_only_half_precisions_that_all_fail_end_on_fp32_eager(net, batches):
    result = ladder(net, [FaultyRung("compile"), EagerRung()], batches, CosineGate(0.9999999),
                    precisions=(DType.BFLOAT16,))
    assert [(a.rung, a.status, a.dtype) for a in result.attempts] == [
        ("eager", AttemptStatus.FAILED, "bfloat16"), ("eager", AttemptStatus.ACCEPTED, "float32")]
    assert "no rung kept the answers in bfloat16" in result.attempts[-1].reason
    assert result.forward is net and result.dtype is DType.FLOAT32


def test_a_model_that_cannot_be_converted_to_a_precision_is_served_in_the_next(net, batches, monkeypatch):
    """Converting the model (e.g. int8's quantization) happens at the precision's screen: if it raises, the
    precision is out, the load goes on and describe says why."""
    import handlers.ladder.variants

    def in_precision(module, dtype):
        raise RuntimeError(f"no {dtype.value} kernels for this layer")

    monkeypatch.setattr(handlers.ladder.variants, "in_precision", in_precision)
    result = ladder(net, [FaultyRung("compile"), EagerRung()], batches, CosineGate(0.999),
                    precisions=(DType.BFLOAT16, DType.FLOAT32))
    assert [(a.rung, a.status, a.dtype, a.screen) for a in result.attempts] == [
        ("eager", AttemptStatus.FAILED, "bfloat16", True), ("compile", AttemptStatus.ACCEPTED, "float32", False)]
    assert result.attempts[0].reason == ("screen: converting the model to bfloat16 failed: RuntimeError: no bfloat16 "
                                         "kernels for this layer; so no rung runs in bfloat16")
    assert result.dtype is DType.FLOAT32


class SlowIn(FaultyRung):
    """A compile rung that runs int8 too (as the real one) and sleeps ``ms`` per call in ``dtype``."""

    def __init__(self, name, dtype, ms):
        super().__init__(name)
        self.slow_dtype, self.ms = dtype, ms

    def runs_in(self, dtype):
        return True

    def apply(self, module, dtype):
        forward = super().apply(module, dtype)
        if dtype is not self.slow_dtype:
            return forward

        def slow(**batch):
            time.sleep(self.ms / 1000)
            return forward(**batch)

        return slow


def int8_gate(dtype):
    return CosineGate(0.9 if dtype is DType.INT8 else 0.999)


def test_a_race_counts_each_forwards_least_disturbed_call():
    """A neighbour loading beside the worker slows calls at random; the race counts each forward's fastest call,
    so the forward that is faster on a quiet machine wins though most of its calls were disturbed."""
    calls = {"fast": 0}

    def fast(_):
        calls["fast"] += 1
        time.sleep(0.030 if calls["fast"] % 5 in (1, 2, 3) else 0.002)  # three of each five calls disturbed

    def steady(_):
        time.sleep(0.008)

    fast_ms, steady_ms = race.forward_ms([fast, steady], [None, None], lambda forward, batch: forward(batch))
    assert calls["fast"] == 2 * race.ROUNDS * race.IN_A_ROW
    assert fast_ms < 2 * 8 <= steady_ms  # a median would have read 2 x 30 ms
    assert race.pays(fast_ms, steady_ms) and not race.pays(steady_ms, fast_ms)


def test_a_race_on_a_busy_machine_is_run_again_and_counts_the_fastest_call_of_every_try():
    """While a neighbour keeps this worker's cores busy (other processes use them, and this one waits for a CPU),
    the race pauses and runs again, up to its patience; each forward counts its fastest call over all tries."""
    waits = iter([0.0, 5.0, 5.0, 5.0])  # (before, after) per try: the first try waited ~all its time, the second not
    others = iter([0.0, 9.0, 9.0, 9.0])  # ... while other processes used the cores, then not
    slept = []
    calls = race.ROUNDS * race.IN_A_ROW  # per try
    durations = {"a": iter([0.020] * calls + [0.002] * calls), "b": iter([0.004] * (2 * calls))}

    def timed(name):
        return lambda _: time.sleep(next(durations[name]))

    raced = race.run_race([timed("a"), timed("b")], [None], lambda forward, batch: forward(batch),
                          waited=lambda: next(waits), others=lambda: next(others), sleep=slept.append,
                          patience_s=race.PATIENCE_S)
    assert raced.tries == 2 and slept == [race.PAUSE_S]
    assert raced.ms[0] < 4 <= raced.ms[1]  # a's quiet try counts: 2 ms against 4
    assert not raced.disturbed and raced.describe() == "2 tries"


@pytest.mark.parametrize(("waiting", "others_busy", "tries"), [(True, False, 1), (False, True, 1), (True, True, 2)])
def test_a_race_runs_again_only_when_it_waited_for_cores_that_others_used(waiting, others_busy, tries):
    """Either signal alone misleads: this process's own threads wait for each other (torch's OpenMP threads spin
    beside the main thread), and on a big host other tenants' load rarely takes this worker's cores."""
    counters = {"waited": 0.0, "others": 0.0}

    def count(name, busy):
        def read():
            counters[name] += 100.0 if busy else 0.0  # per reading: a share far past either threshold, or none
            return counters[name]
        return read

    raced = race.run_race([lambda _: None], [None], lambda forward, batch: forward(batch),
                          waited=count("waited", waiting), others=count("others", others_busy),
                          patience_s=0.08, pause_s=0.05)  # time for two tries
    assert raced.tries == tries and raced.disturbed is (tries > 1)
    if raced.disturbed:
        assert "so the times are unreliable" in raced.describe()


@pytest.mark.parametrize(("said", "patience"), [(None, race.PATIENCE_S), ("0", 0.0), ("4.5", 4.5),
                                              *((said, race.PATIENCE_S) for said in ("", "soon", "-1", "nan", "inf"))])
def test_the_operator_bounds_how_long_a_busy_race_tries_again(monkeypatch, caplog, said, patience):
    """PT2_RACE_PATIENCE_S: 0 runs a race once however busy the machine (a host busy by design never quietens);
    a value that is not a number of seconds keeps the default, with a warning naming it."""
    if said is None:
        monkeypatch.delenv(race.PATIENCE_ENV, raising=False)
    else:
        monkeypatch.setenv(race.PATIENCE_ENV, said)
    with caplog.at_level(logging.WARNING, logger="handlers.ladder.race"):
        assert race.race_patience_s() == patience
    assert (race.PATIENCE_ENV in caplog.text) is (said in ("soon", "-1", "nan", "inf"))
    if patience == 0:
        slept = []
        busy = iter(float(reading) for reading in range(0, 1000, 100))  # every reading far past both thresholds
        raced = race.run_race([lambda _: None], [None], lambda forward, batch: forward(batch),
                              waited=lambda: next(busy), others=lambda: next(busy), sleep=slept.append)
        assert raced.tries == 1 and slept == [] and raced.disturbed


def test_the_cpu_probes_see_a_neighbour_on_this_processs_cores():
    """The kernel's counters: a busy process pinned to this process's cores makes torch's threads wait for a CPU
    (measured: 1.2 s of 1.4 s beside a busy loop, against 0.002 s of 0.25 s quiet) and uses those cores."""
    import subprocess

    assert race.runqueue_wait_s() is not None, "/proc/self/task/*/schedstat is missing: the race cannot tell"
    assert race.other_cpu_s() is not None, "/proc/stat is missing: the race cannot tell"
    work = torch.randn(256, 256)
    cores = sorted(os.sched_getaffinity(0))
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cores]
    try:
        for neighbour in neighbours:
            os.sched_setaffinity(neighbour.pid, cores)
        time.sleep(0.2)
        started, waited, others = time.perf_counter(), race.runqueue_wait_s(), race.other_cpu_s()
        while time.perf_counter() - started < 0.5:
            work @ work
        seconds = time.perf_counter() - started
        wait_share = (race.runqueue_wait_s() - waited) / seconds
        other_share = (race.other_cpu_s() - others) / seconds / len(cores)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert wait_share > race.MAX_WAIT_SHARE and other_share > race.MIN_OTHER_SHARE, (wait_share, other_share)


@pytest.mark.torchao
@pytest.mark.parametrize("slow", [DType.INT8, DType.BFLOAT16])
def test_int8_that_passes_the_gate_serves_only_where_it_is_faster(net, batches, slow):
    """int8 trades answers for speed: it is raced on the warmup batches against the same rung in the next
    precision that passes, and serves only if at least 5 % faster; both times are in describe."""
    result = run_ladder(net, [SlowIn("compile", slow, 10), EagerRung()], Warmup(batches, int8_gate),
                        Precisions((DType.INT8, DType.BFLOAT16, DType.FLOAT32)))
    attempts = [(a.rung, a.dtype, a.status.value) for a in result.attempts]
    winner = DType.BFLOAT16 if slow is DType.INT8 else DType.INT8
    assert result.dtype is winner and result.active == "compile"
    statuses = {"int8": "accepted" if winner is DType.INT8 else "slower",
                "bfloat16": "accepted" if winner is DType.BFLOAT16 else "slower"}
    # bf16 is screened first: int8's float layers run in bf16 only where bf16 passed its screen.
    assert attempts == [("eager", "bfloat16", "passed"), ("eager", "int8", "passed"),
                        ("compile", "int8", statuses["int8"]), ("compile", "bfloat16", statuses["bfloat16"])]
    assert "its float layers in bfloat16" in result.attempts[1].reason
    int8, bf16 = result.attempts[2], result.attempts[3]
    slow_ms, fast_ms = (int8, bf16) if slow is DType.INT8 else (bf16, int8)
    assert slow_ms.forward_ms >= 10 * len(batches) > fast_ms.forward_ms  # 5 calls each, the fastest of them
    for attempt in (int8, bf16):
        assert f"{int8.forward_ms:.2f} ms in int8 against {bf16.forward_ms:.2f} in bfloat16" in attempt.reason
    loser = int8 if winner is DType.BFLOAT16 else bf16
    assert loser.reason.startswith("passed the gate, but") and loser.to_json()["forward_ms"] == loser.forward_ms
    with torch.inference_mode():
        assert int8_gate(winner).measure(result.forward(**batches[0]), [net(**batches[0])]) >= 0.9


class SlowWhen(SmallNet):
    """SmallNet whose forward sleeps 20 ms while its weights are in ``dtype``: with bf16, a CPU whose bf16
    instructions run slower than its fp32 ones (a Xeon whose AMX the hypervisor hides); with fp32, one whose
    bf16 pays."""

    def __init__(self, dtype):
        super().__init__()
        self.slow_dtype = dtype

    def forward(self, x):
        if self.up.weight.dtype is self.slow_dtype:
            time.sleep(0.02)
        return super().forward(x)


@pytest.mark.parametrize("slow", [torch.bfloat16, torch.float32])
def test_autos_bf16_serves_only_where_its_eager_screen_beats_fp32(batches, slow, monkeypatch):
    """auto promises the fastest precision that keeps the answers: its bf16 is raced against fp32 eager in the
    screen (eager, no compile), and where it is not faster no rung runs in it; fp32 compiles instead."""
    # A race run once on a machine the other test stage keeps busy can time either side slow: this one waits for a
    # quiet moment, as a worker's race does by default.
    monkeypatch.setenv(race.PATIENCE_ENV, "30")
    result = run_ladder(SlowWhen(slow).eval(), [SlowIn("compile", None, 0), EagerRung()],
                        Warmup(batches, lambda dtype: CosineGate(0.99)),
                        Precisions((DType.BFLOAT16, DType.FLOAT32), must_beat_fp32=(DType.BFLOAT16,)))
    attempts = [(a.rung, a.dtype, a.status.value) for a in result.attempts]
    screen = result.attempts[0]
    assert screen.screen and screen.forward_ms is not None
    if slow is torch.bfloat16:
        assert attempts == [("eager", "bfloat16", "slower"), ("compile", "float32", "accepted")]
        assert screen.forward_ms >= 20 * len(batches)
        assert "but is not 5% faster than float32 here" in screen.reason
        assert "so no rung runs in bfloat16" in screen.reason
        assert result.dtype is DType.FLOAT32
    else:
        assert attempts == [("eager", "bfloat16", "passed"), ("compile", "bfloat16", "accepted")]
        assert "and is faster than float32 here" in screen.reason
        assert result.dtype is DType.BFLOAT16


def test_workers_of_one_model_follow_the_race_an_earlier_load_kept(batches, tmp_path, monkeypatch):
    """auto's bf16 screen is a race, and a worker that raced while its siblings loaded beside it timed a busy
    machine: it could pick the other precision, whose graph no worker compiled. So a load keeps its race (beside the
    compile cache) and the next load of the same model on the same machine follows it: without racing where its
    times were reliable; where they were not, a reliable race replaces it and an unreliable one follows it."""
    memory = DecisionStore(tmp_path / "memory")
    raced = []

    def serves(outcome, machine="2 cores"):
        def run_race(*args, **kwargs):
            assert outcome is not None, "raced again"
            raced.append(outcome)
            return outcome

        monkeypatch.setattr(race, "run_race", run_race)
        result = run_ladder(SmallNet().eval(), [SlowIn("compile", None, 0), EagerRung()],
                            Warmup(batches, lambda dtype: CosineGate(0.99)),
                            Precisions((DType.BFLOAT16, DType.FLOAT32), must_beat_fp32=(DType.BFLOAT16,)),
                            Site(decisions=memory, machine=machine))
        return result.dtype, result.attempts[0].reason

    busy, quiet = (0.5, 0.5), (0.0, 0.0)
    # The first worker raced on a busy machine and found bf16 slower; the next, as busy, the other way: it follows.
    assert serves(race.Race([30.0, 10.0], 3, *busy))[0] is DType.FLOAT32
    dtype, reason = serves(race.Race([5.0, 10.0], 1, *busy))
    assert dtype is DType.FLOAT32 and "30.00 ms eager in bfloat16 against 10.00 in float32" in reason, reason
    assert "the times are unreliable; remembered from an earlier load, which this worker follows" in reason
    # A quiet race replaces the unreliable one, and the next worker follows it without racing.
    assert serves(race.Race([5.0, 10.0], 1, *quiet))[0] is DType.BFLOAT16
    dtype, reason = serves(None)
    assert dtype is DType.BFLOAT16 and reason.endswith("1 try; remembered from an earlier load, which this worker "
                                                       "follows); faster rungs try it first"), reason
    assert len(raced) == 3
    # Another machine (CPU, kernel level, threads) races for itself.
    assert serves(race.Race([30.0, 10.0], 1, *quiet), machine="4 cores")[0] is DType.FLOAT32
    assert len(list((tmp_path / "memory").glob("*.json"))) == 2


@pytest.mark.torchao
def test_int8_that_won_its_race_before_serves_without_compiling_its_rival(net, batches, tmp_path,
                                                                           quiet_load_counters):
    """The next worker of a model whose int8 won its race on this machine builds int8 and serves it: the rival's
    compile would only lose (a warm worker's seconds). describe keeps both times, the rival "not built"."""
    # The first race must count as quiet to be followed (a busy one is raced again: test_workers_of_one_model_follow_
    # the_race_an_earlier_load_kept); the fp32 rival's 10 ms sleep loses on any machine.
    memory = DecisionStore(tmp_path / "memory")

    class Counted(SlowIn):
        built: list = []

        def apply(self, module, dtype):
            self.built.append(dtype)
            return super().apply(module, dtype)

    def load(options=None):
        Counted.built = []
        rung = Counted("compile", DType.FLOAT32, 10)
        rung.spec = options  # as CompileRung's: what the YAML asks of the compile
        result = run_ladder(net, [rung, EagerRung()], Warmup(batches, int8_gate),
                            Precisions((DType.INT8, DType.FLOAT32)), Site(decisions=memory, machine="2 cores"))
        return result, Counted.built

    first, built = load()
    assert (first.dtype, built) == (DType.INT8, [DType.INT8, DType.FLOAT32])
    second, built = load()
    assert (second.dtype, built) == (DType.INT8, [DType.INT8])
    int8, rival = second.attempts[-2:]
    assert [(a.rung, a.dtype, a.status) for a in (int8, rival)] == [("compile", "int8", AttemptStatus.ACCEPTED),
                                                                     ("compile", "float32", AttemptStatus.SLOWER)]
    assert (int8.forward_ms, rival.forward_ms) == (first.attempts[-2].forward_ms, first.attempts[-1].forward_ms)
    assert rival.reason.startswith("not built: int8 was faster here: ") and rival.reason.endswith(
        "remembered from an earlier load, which this worker follows)"), rival.reason
    # Other compile options (e.g. the C++ wrapper turned off) make other forwards: raced again.
    _, built = load(options={"cpp_wrapper": False})
    assert built == [DType.INT8, DType.FLOAT32]


def test_a_named_bf16_is_not_raced_in_its_screen(batches):
    """bf16 the YAML names (not auto's) serves as asked, slower or not: the user may want it for its memory."""
    result = run_ladder(SlowWhen(torch.bfloat16).eval(), [SlowIn("compile", None, 0), EagerRung()],
                        Warmup(batches, lambda dtype: CosineGate(0.99)), Precisions((DType.BFLOAT16, DType.FLOAT32)))
    assert [(a.rung, a.dtype, a.status.value) for a in result.attempts] == [
        ("eager", "bfloat16", "passed"), ("compile", "bfloat16", "accepted")]
    assert result.attempts[0].forward_ms is None


@pytest.mark.torchao
def test_int8_runs_its_float_layers_in_fp32_where_autos_bf16_does_not_pay(batches):
    """int8's float layers follow bf16's screen: where bf16 is slower than fp32, int8 keeps them in fp32 and races
    the fp32 compile."""
    net = SlowWhen(torch.bfloat16).eval()
    result = run_ladder(net, [SlowIn("compile", DType.FLOAT32, 10), EagerRung()], Warmup(batches, int8_gate),
                        Precisions((DType.INT8, DType.BFLOAT16, DType.FLOAT32), must_beat_fp32=(DType.BFLOAT16,)))
    attempts = [(a.rung, a.dtype, a.status.value) for a in result.attempts]
    assert attempts == [("eager", "bfloat16", "slower"), ("eager", "int8", "passed"), ("compile", "int8", "accepted"),
                        ("compile", "float32", "slower")]
    assert "its float layers in float32" in result.attempts[1].reason
    assert "ms in int8 against" in result.attempts[2].reason and "in float32" in result.attempts[2].reason


def test_a_rung_that_raises_in_bf16_hands_over_to_the_next_rung_in_bf16(net, batches):
    result = ladder(net, [FaultyRung("compile", "apply"), FaultyRung("safe_compile"), EagerRung()], batches,
                    CosineGate(0.999), precisions=(DType.BFLOAT16, DType.FLOAT32))
    assert [(a.rung, a.status.value, a.dtype) for a in result.attempts] == [
        ("eager", "passed", "bfloat16"), ("compile", "failed", "bfloat16"), ("safe_compile", "accepted", "bfloat16")]


class GrowingCounter(torch.nn.Module):
    """A Python int attribute that grows every call: each call guards on a new value and recompiles, until dynamo
    gives up on the frame and runs it eagerly, without an error."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x) + 0 * self.calls


def test_a_compile_that_dynamo_gives_up_on_is_not_accepted_as_compiled(batches):
    torch._dynamo.reset()
    net = GrowingCounter().eval()
    spec = CompileSpec(enabled=True, backend="eager", dynamic=False)
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    compile_attempt = result.attempts[0]
    assert (compile_attempt.rung, compile_attempt.status) == ("compile", AttemptStatus.FAILED)
    assert compile_attempt.reason.startswith("NotCompiled: the second warmup pass compiled"), compile_attempt.reason
    assert result.active == "eager"


class CountingEncoder(torch.nn.Module):
    """A real (tiny) BERT encoder whose wrapper keeps a Python int that grows every call, as a module that counts
    its calls or a position kept on ``self`` would: dynamo guards on the int, so every call recompiles until it
    gives up on the frame and runs it eagerly, without an error."""

    def __init__(self, model_dir):
        super().__init__()
        import transformers

        self.bert = transformers.AutoModel.from_pretrained(model_dir).eval()
        self.calls = 0

    def forward(self, input_ids, attention_mask):
        self.calls += 1
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return hidden[:, 0] * (1 + 0 * self.calls)


def test_an_encoder_that_recompiles_every_call_is_not_accepted_as_compiled(tiny_bert_dir):
    torch._dynamo.reset()
    encoder = CountingEncoder(tiny_bert_dir)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(1000, 2000, (rows, 16), generator=generator),
                "attention_mask": torch.ones(rows, 16, dtype=torch.long)} for rows in (1, 2)]
    spec = CompileSpec(enabled=True, backend="eager", dynamic=False)
    result = ladder(encoder, [CompileRung("compile", spec), EagerRung()], batches)
    failed = result.attempts[0]
    assert (failed.rung, failed.status, result.active) == ("compile", AttemptStatus.FAILED, "eager"), failed
    assert failed.reason.startswith("NotCompiled: "), failed.reason
    assert failed.dynamo is not None and failed.dynamo.graphs >= len(batches)


class GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.linear(x)
        torch._dynamo.graph_break()
        return y + 1


def test_graph_breaks_are_accepted_and_counted(batches):
    torch._dynamo.reset()
    spec = CompileSpec(enabled=True, backend="eager", dynamic=False)
    result = ladder(GraphBreak().eval(), [CompileRung("compile", spec), EagerRung()], batches)
    accepted = result.attempts[0]
    assert accepted.status is AttemptStatus.ACCEPTED and accepted.dynamo.graph_breaks >= 1
    assert accepted.to_json()["dynamo"]["frames_given_up"] == 0


def static_compile(net, shapes):
    """A static compile (cheap eager backend) proven on one batch per shape."""
    batches = [{"x": torch.randn(rows, 8)} for rows in shapes]
    spec = CompileSpec(enabled=True, backend="eager", dynamic=False)
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "compile", result.attempts
    return result


def test_more_static_shapes_than_the_recompile_limit_are_all_compiled(net):
    torch._dynamo.reset()
    before = compiled_graphs()
    result = static_compile(net, range(1, 13))  # 12 shapes > dynamo's default limit of 8
    assert compiled_graphs() - before == 12
    guard = GuardedForward(result, net, max_failures=1, after_ready=AfterReady.FAIL)
    for rows in range(1, 13):  # every warmed shape is served compiled: none is refused
        guard(x=torch.randn(rows, 8))
    assert guard.describe()["compiles_after_ready"] == 0 and guard.failures == 0


@pytest.mark.parametrize(("one_graph", "graphs"), [(True, 1), (False, 2)])
def test_dynamic_one_graph_serves_batch_size_one_without_its_own_graph(net, one_graph, graphs):
    """torch specializes size-1 dims; one_graph keeps them symbolic while tracing, so a warm restart traces
    once. Either way every size after READY is served by a warmed graph."""
    torch._dynamo.reset()
    before = compiled_graphs()
    spec = CompileSpec(enabled=True, backend="eager", dynamic=True, one_graph=one_graph)
    batches = [{"x": torch.randn(rows, 8)} for rows in (1, 3)]
    result = ladder(net, [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "compile" and compiled_graphs() - before == graphs
    guard = GuardedForward(result, net, max_failures=1, after_ready=AfterReady.FAIL)
    for rows in (1, 2, 7):
        batch = {"x": torch.randn(rows, 8)}
        torch.testing.assert_close(guard(**batch), eager_out(net, batch))
    assert guard.describe()["compiles_after_ready"] == 0 and guard.failures == 0


@pytest.mark.parametrize("after_ready", list(AfterReady))
def test_after_ready_stance_for_an_unseen_shape(net, after_ready):
    torch._dynamo.reset()
    guard = GuardedForward(static_compile(net, [1, 2]), net, max_failures=1, after_ready=after_ready)
    unseen = {"x": torch.randn(5, 8)}
    if after_ready is AfterReady.FAIL:
        with pytest.raises(ShapeNotWarmed, match=r"input shape 5x8 was not warmed"):
            guard(**unseen)
        return
    torch.testing.assert_close(guard(**unseen), eager_out(net, unseen))
    described = guard.describe()
    assert (described["eager_batches"], described["compiles_after_ready"]) == (
        (1, 0) if after_ready is AfterReady.EAGER else (0, 1))
    assert guard.failures == 0 and not guard.demoted


def test_compiles_after_ready_count_the_guards_own_and_no_one_elses(net):
    """The guard reads dynamo's counts in full only when they moved: each of its own compiles counts once, and a
    compile elsewhere in the process between its batches is not counted as its own."""
    torch._dynamo.reset()
    guard = GuardedForward(static_compile(net, [1, 2]), net, max_failures=1, after_ready=AfterReady.COMPILE)
    for rows, compiles in ((5, 1), (5, 1), (2, 1), (6, 2)):
        batch = {"x": torch.randn(rows, 8)}
        torch.testing.assert_close(guard(**batch), eager_out(net, batch))
        assert guard.describe()["compiles_after_ready"] == compiles, rows
    elsewhere = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    elsewhere(torch.randn(3))
    guard(x=torch.randn(6, 8))
    assert guard.describe()["compiles_after_ready"] == 2 and guard.describe()["frames_given_up"] == 0


def test_the_refused_recompile_message_is_the_one_torch_raises(net):
    """is_refused_recompile reads torch's message; a torch upgrade that changes it must fail here."""
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="eager", dynamic=False)
    compiled(torch.randn(1, 8))
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError) as caught:
        compiled(torch.randn(3, 8))
    assert is_refused_recompile(caught.value)
    assert not is_refused_recompile(RuntimeError("boom"))


def test_reduce_overhead_on_cpu_says_there_are_no_cuda_graphs(net):
    spec = CompileSpec(enabled=True, mode="reduce-overhead")
    assert CompileRung("compile", spec).notes(torch.device("cpu")) == [
        "mode reduce-overhead: no CUDA graphs on cpu; inductor compiles without them"]
    assert CompileRung("compile", spec).notes(torch.device("cuda", 0)) == []


@pytest.mark.slow
def test_compile_rungs_build_no_precompiled_headers(tmp_path, monkeypatch):
    """Inductor keeps precompiled C++ headers under $TMPDIR, outside the compile cache, and rebuilds them in
    a new container even when every kernel is cached (+6 s per new host). The compile rungs do without."""
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(tmp_path / "headers" / "locks"))
    torch._dynamo.reset()

    class FreshKernel(torch.nn.Module):
        def forward(self, x):  # a constant no other test compiles, so its C++ kernel is not cached anywhere
            return torch.tanh(x * 1.2345) + x

    batches = [{"x": torch.randn(rows, 8)} for rows in (1, 3)]
    spec = CompileSpec(enabled=True, backend="inductor", dynamic=False)
    result = ladder(FreshKernel(), [CompileRung("compile", spec), EagerRung()], batches)
    assert result.active == "compile", result.attempts
    assert not (tmp_path / "headers").exists() or not any((tmp_path / "headers").glob("*.h*"))

    # The control: torch's default does build them, so the assertion above is not vacuous.
    torch.compile(lambda x: torch.tanh(x * 2.3456) - x)(torch.randn(2, 8))
    assert any((tmp_path / "headers").glob("*.h*"))


def test_a_cpu_worker_without_a_cpp_compiler_skips_the_inductor_rungs_at_once():
    """No g++ in the worker image: the inductor rungs are skipped with the reason, before any tracing; a custom
    backend (no C++) still gets its try."""
    from torch._inductor import config as inductor_config

    from handlers.cpu import features

    cpu = torch.device("cpu")
    assert features.cpp_compiler_problem(cpu) is None  # this machine has g++
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        problem = features.cpp_compiler_problem(cpu)
    assert problem is not None and "needs a C++ compiler and none works here" in problem
    assert features.cpp_compiler_problem(torch.device("meta")) is None
    config = load_config({"pt2": {"compile": {"enable": True, "backend": "tests.faulty_backends:raise_on_compile"}},
                          "pt2_handlers": {"ladder": ["compile", "safe_compile", "eager"]}})
    rungs = build_rungs(config, cpu, inductor_unavailable=problem)
    assert [rung.unavailable_reason() for rung in rungs[:2]] == [None, problem]


@pytest.mark.torchao
@pytest.mark.parametrize("spread", [1.0, 20.0])
def test_int8_is_judged_on_held_out_batches_its_calibration_never_saw(net, batches, spread):
    """Static int8 fixes its activation scales on the calibration batches. Held-out batches like them pass; held-out
    batches 20 times wider clip at those scales and fail the int8 screen, though the warmup batches pass: describe
    gives both values and what int8 was calibrated on."""
    generator = torch.Generator().manual_seed(2)
    calibration = Calibration([{"x": torch.randn(4, 8, generator=generator)} for _ in range(4)],
                              [{"x": spread * torch.randn(2, 8, generator=generator)}], "four random batches",
                              "other random rows")
    result = run_ladder(net, [SlowIn("compile", DType.FLOAT32, 0), EagerRung()], Warmup(batches, int8_gate),
                        Precisions((DType.INT8, DType.FLOAT32), calibration=calibration))
    screen = result.attempts[0]
    assert (screen.rung, screen.dtype, screen.screen) == ("eager", "int8", True)
    assert screen.quality.held_out is not None and screen.quality.value == min(screen.quality.held_out,
                                                                                screen.quality.value)
    assert result.calibration == ("calibrated on four random batches (4 batches); judged on the 2 warmup batches "
                                  "and 1 held-out batches of other random rows")
    if spread == 1.0:
        assert screen.status is AttemptStatus.PASSED and screen.quality.held_out >= 0.9
        compiled = result.attempts[1]
        assert (compiled.rung, compiled.dtype) == ("compile", "int8") and compiled.quality.held_out >= 0.9
    else:
        assert screen.status is AttemptStatus.FAILED and screen.quality.held_out < 0.9
        assert "below the gate's 0.9 on held-out batches (calibration never saw them; the warmup batches read " \
               in screen.reason
        assert result.dtype is DType.FLOAT32


def fails_at_one_thread(graph_module, example_inputs):
    """A dynamo backend (``tests.test_ladder:fails_at_one_thread``) that cannot compile at 1 thread."""
    if torch.get_num_threads() == 1:
        raise RuntimeError("no kernels for 1 thread")
    return graph_module.forward


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_compiled_forward_is_proven_at_each_thread_count_it_may_be_given(net, batches, two_threads):
    """Dynamo guards the intra-op thread count with torch's global state: called at another count, a compiled
    forward compiles again, which after READY the stance refuses (here: after_ready fail raises)."""
    torch._dynamo.reset()
    rung = CompileRung("compile", CompileSpec(enabled=True, backend="eager"))
    result = run_ladder(net, [rung, EagerRung()], Warmup(batches, lambda dtype: GATE), Precisions((DType.FLOAT32,)),
                        Site(thread_counts=(1, 2)))
    assert result.active == "compile" and result.threads == (1, 2)
    assert torch.get_num_threads() == 2  # the load's count again
    guard = GuardedForward(result, net, 3, AfterReady.FAIL)
    for count in (1, 2):
        torch.set_num_threads(count)
        torch.testing.assert_close(guard(**batches[0]), eager_out(net, batches[0]))
    assert guard.eager_batches == 0 and guard.failures == 0
    torch.set_num_threads(3)
    with pytest.raises(ShapeNotWarmed):
        guard(**batches[0])


def test_an_inductor_compile_on_shared_cores_serves_every_count_with_the_same_graphs(net, batches, two_threads):
    """handlers.rungs.thread_guard: compiled with kernels that follow the thread count, the forward leaves dynamo's
    global-state guard out and checks the rest of that state itself. Under torch 2.8, which always adds the guard,
    each count compiles its own graphs, as in the test above."""
    rung = CompileRung("compile", CompileSpec(enabled=True, backend="inductor", threads_follow=True))
    one_set = global_state.guard_can_be_left_out()
    torch._dynamo.reset()
    before = compiled_graphs()
    result = run_ladder(net, [rung], Warmup(batches, lambda dtype: GATE), Precisions((DType.FLOAT32,)))
    assert result.active == "compile"
    at_one_count = compiled_graphs() - before
    torch._dynamo.reset()
    before = compiled_graphs()
    result = run_ladder(net, [rung, EagerRung()], Warmup(batches, lambda dtype: GATE), Precisions((DType.FLOAT32,)),
                        Site(thread_counts=(1, 2)))
    assert result.active == "compile" and result.threads == (1, 2)
    at_two_counts = compiled_graphs() - before
    assert at_two_counts == at_one_count if one_set else at_two_counts > at_one_count  # 2.8: graphs of its own
    guard = GuardedForward(result, net, 3, AfterReady.FAIL)
    for count in (1, 2):
        torch.set_num_threads(count)
        torch.testing.assert_close(guard(**batches[0]), eager_out(net, batches[0]))
    assert guard.failures == 0
    torch.set_num_threads(3)  # a count it was not proven at (the share never gives one)
    if not one_set:
        with pytest.raises(ShapeNotWarmed):
            guard(**batches[0])
        return
    torch.testing.assert_close(guard(**batches[0]), eager_out(net, batches[0]))  # the same graphs
    assert compiled_graphs() - before == at_one_count
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)  # the rest of the global state is still checked, by the forward
    try:
        answer = guard(**batches[0])
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(answer, eager_out(net, batches[0]))  # served eagerly
    assert guard.failures == 1 and "GlobalStateChanged" in guard.last_failure, guard.last_failure
    assert "deterministic_algorithms" in guard.last_failure


def test_a_thread_count_the_compile_fails_at_is_left_out(net, batches, two_threads):
    torch._dynamo.reset()
    rung = CompileRung("compile", CompileSpec(enabled=True, backend="tests.test_ladder:fails_at_one_thread"))
    result = run_ladder(net, [rung, EagerRung()], Warmup(batches, lambda dtype: GATE), Precisions((DType.FLOAT32,)),
                        Site(thread_counts=(1, 2)))
    assert result.active == "compile" and result.threads == (2,)


def test_eager_runs_at_any_thread_count_and_ipex_at_the_one_it_was_built_at(net, batches):
    result = run_ladder(net, [EagerRung()], Warmup(batches, lambda dtype: GATE), Precisions((DType.FLOAT32,)),
                        Site(thread_counts=(1, 2)))
    assert result.active == "eager" and result.threads is None
    assert EagerRung().follows_threads() and not IpexRung(torch.device("cpu")).follows_threads()
    assert not CompileRung("compile", CompileSpec(enabled=True)).follows_threads()
