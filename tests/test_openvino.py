"""The openvino rung (handlers.rungs.openvino): the module exported, converted and compiled by OpenVINO, proven like
every rung; a model it cannot convert lands on the next rung; its IR kept for the next worker; its telemetry off;
raced against compile, the faster serving; and ``pt2.compile.backend: openvino`` served by it."""

from __future__ import annotations

import logging

import pytest
import torch

from handlers.config import DType, load_config
from handlers.ladder import AttemptStatus, Precisions, Site, Warmup, run_ladder, tensors
from handlers.ladder.decisions import DecisionStore
from handlers.rungs import SERVED_BY_OPENVINO, CompileRung, EagerRung, OpenVinoRung, build_rungs
from handlers.rungs.openvino import example_batch, probe_openvino
from handlers.rungs.openvino_ir import BLOBS, DIRECTORY, MODEL
from handlers.tasks.embeddings import CosineGate

pytestmark = pytest.mark.openvino

CPU = torch.device("cpu")


class Mixer(torch.nn.Module):
    """Two inputs by keyword, a batch and a sequence axis, a dict of outputs: what the task modules look like."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.nn.functional.gelu(self.mix(self.embed(ids))) * mask[..., None]
        pooled = hidden.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return {"scores": self.head(pooled), "pooled": pooled}


class Unconvertible(torch.nn.Module):
    """An op OpenVINO's PyTorch frontend has no conversion for (a Bessel function): the rung must hand over."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.special.bessel_j0(x))


def mixer_batches(*shapes):
    generator = torch.Generator().manual_seed(1)
    return [{"ids": torch.randint(0, 50, shape, generator=generator), "mask": torch.ones(shape, dtype=torch.long)}
            for shape in shapes]


def gate(outputs, expected):
    return min(torch.nn.functional.cosine_similarity(outputs[key], expected[key]).min().item() for key in expected)


class DictGate(CosineGate):
    """The smallest cosine per row over every output (the reference's outputs come as a list of tensors)."""

    def measure(self, actual, expected):
        return min(torch.nn.functional.cosine_similarity(a.float(), e).min().item()
                   for a, e in zip(tensors(actual), expected, strict=True))


def ladder(model, rungs, batches, precisions=(DType.FLOAT32,), site=None, race_rungs=True):
    return run_ladder(model, rungs, Warmup(batches, lambda dtype: DictGate(0.999 if dtype is DType.FLOAT32 else 0.99)),
                      Precisions(precisions), site=site, race_rungs=race_rungs)


def test_openvino_serves_a_keyword_module_with_dynamic_batch_and_sequence(tmp_path):
    model = Mixer().eval()
    result = ladder(model, [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], mixer_batches((1, 5), (3, 9)))
    assert (result.active, result.dtype) == ("openvino", DType.FLOAT32)
    # shapes the warmup never saw: the batch and sequence axes were exported dynamic
    for batch in mixer_batches((7, 3), (2, 31)):
        with torch.inference_mode():
            expected = model(**batch)
        answered = result.forward(**batch)
        assert set(answered) == {"scores", "pooled"} and gate(answered, expected) > 0.9999


def test_bf16_runs_by_openvinos_hint_on_the_fp32_weights(tmp_path):
    """The rung converts the fp32 model (not a bf16 copy) and asks OpenVINO for bf16; on a CPU without bf16 dot
    products OpenVINO runs it in f32. Either way the gate judged it against fp32 eager."""
    rung = OpenVinoRung(CPU, str(tmp_path))
    result = ladder(Mixer().eval(), [rung, EagerRung()], mixer_batches((1, 5), (3, 9)),
                    precisions=(DType.BFLOAT16, DType.FLOAT32))
    assert (result.active, result.dtype) == ("openvino", DType.BFLOAT16)
    assert rung.config(DType.BFLOAT16)["INFERENCE_PRECISION_HINT"] == "bf16"
    assert rung.config(DType.FLOAT32)["INFERENCE_NUM_THREADS"] == torch.get_num_threads()
    assert next(a for a in result.attempts if a.rung == "openvino").quality.value >= 0.99


def test_a_model_openvino_cannot_convert_lands_on_the_next_rung_with_the_reason(tmp_path, caplog):
    batches = [{"x": torch.randn(2, 8)}, {"x": torch.randn(3, 8)}]
    root_level, root_handlers = logging.getLogger().level, list(logging.getLogger().handlers)
    with caplog.at_level(logging.WARNING, logger="handlers.ladder.proof"):
        result = ladder(Unconvertible().eval(), [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], batches)
    failed = next(a for a in result.attempts if a.rung == "openvino")
    assert failed.status is AttemptStatus.FAILED and "OpConversionFailure" in failed.reason
    assert result.active == "eager"
    assert "rung openvino (float32) failed" in caplog.text
    # OpenVINO's converter, failing, sets the root logger to ERROR: the worker's own logs must survive it
    assert logging.getLogger().level == root_level and logging.getLogger().handlers == root_handlers
    assert not (tmp_path / DIRECTORY).exists() or not any((tmp_path / DIRECTORY).glob(f"*/{MODEL}"))


def test_the_ir_is_kept_for_the_next_worker_and_a_broken_one_converted_again(tmp_path, caplog):
    batches = mixer_batches((2, 5), (3, 9))
    with caplog.at_level(logging.INFO, logger="handlers.rungs"):
        ladder(Mixer().eval(), [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], batches)
        assert "exported and converted" in caplog.text
        kept = list((tmp_path / DIRECTORY).glob(f"*/{MODEL}"))
        assert len(kept) == 1 and (tmp_path / DIRECTORY / BLOBS).is_dir()
        caplog.clear()
        ladder(Mixer().eval(), [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], batches)
        assert "read from the cache" in caplog.text
        # other weights: another IR
        other = Mixer().eval()
        with torch.no_grad():
            other.head.weight.add_(1.0)
        ladder(other, [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], batches)
        assert len(list((tmp_path / DIRECTORY).glob(f"*/{MODEL}"))) == 2
        kept[0].write_text("not an IR")
        caplog.clear()
        result = ladder(Mixer().eval(), [OpenVinoRung(CPU, str(tmp_path)), EagerRung()], batches)
    assert result.active == "openvino" and "cannot be read" in caplog.text and "exported and converted" in caplog.text


def test_the_example_keeps_the_batch_and_sequence_axes_dynamic():
    """An axis of size 1 in the example would be exported fixed: the largest warmup batch is the example."""
    batches = mixer_batches((1, 16), (4, 16), (4, 64), (1, 64))
    assert tuple(example_batch(batches)["ids"].shape) == (4, 64)
    assert example_batch(["a generation batch"]) is None
    rung = OpenVinoRung(CPU)
    rung.prepare(["a generation batch"])
    assert "named tensors" in rung.unavailable_reason()


def test_telemetry_is_off_before_anything_converts():
    openvino, reason = probe_openvino()
    assert reason is None
    import openvino.tools.ovc.convert_impl as convert_impl
    import openvino.tools.ovc.telemetry_stub as stub

    assert convert_impl.tm is stub


class Sleepy(torch.nn.Module):
    def __init__(self, model, ms):
        super().__init__()
        self.model, self.ms = model, ms

    def forward(self, **batch):
        import time

        time.sleep(self.ms / 1000)
        return self.model(**batch)


class SlowCompile(CompileRung):
    """A compile rung (it races openvino) whose forward is the eager model plus ``ms`` per call; no dynamo."""

    compiles = False

    def __init__(self, ms):
        super().__init__("compile", load_config({"pt2": {"compile": {"enable": True}}}).served_compile)
        self.ms = ms
        self.built = 0

    def without_module_guards(self):
        return self

    def apply(self, module, dtype):
        self.built += 1
        return Sleepy(module, self.ms)


@pytest.mark.parametrize("compile_ms", [0, 5])
def test_openvino_and_compile_race_and_the_faster_serves_kept_for_the_next_load(tmp_path, compile_ms):
    """compile must be 5 % faster to replace openvino; the race is kept, and the next load builds only the winner."""
    model, batches = Mixer().eval(), mixer_batches((2, 5), (3, 9))
    site = Site(DecisionStore(tmp_path / "memory"), machine="this one")
    # OpenVINO's forward of this tiny model takes microseconds: a compile with no sleep is as fast, within 5 %, only
    # where Python's overhead is alike; a compile that sleeps 5 ms per call always loses.
    first_compile = SlowCompile(compile_ms)
    first = ladder(model, [OpenVinoRung(CPU, str(tmp_path)), first_compile, EagerRung()], batches, site=site)
    race = first.rung_race
    assert race is not None and set(race["forward_ms"]) == {"openvino (float32)", "compile (float32)"}
    assert race["served"].startswith(first.active) and first_compile.built == 1
    if compile_ms:
        assert first.active == "openvino"
        assert next(a for a in first.attempts if a.rung == "compile").status is AttemptStatus.SLOWER
    reliable = "unreliable" not in race["measured"]
    again = SlowCompile(compile_ms)
    second = ladder(model, [OpenVinoRung(CPU, str(tmp_path)), again, EagerRung()], batches, site=site)
    assert second.active == first.active
    if reliable:  # the kept race is followed: the loser is not built
        loser = next(a for a in second.attempts if a.rung != second.active and a.status is AttemptStatus.SLOWER)
        assert loser.reason.startswith("not built:")
        assert again.built == (0 if second.active == "openvino" else 1)


def test_pick_first_serves_the_first_proven_rung_unraced(tmp_path):
    compile_rung = SlowCompile(0)
    result = ladder(Mixer().eval(), [OpenVinoRung(CPU, str(tmp_path)), compile_rung, EagerRung()],
                    mixer_batches((2, 5)), race_rungs=False)
    assert (result.active, result.rung_race, compile_rung.built) == ("openvino", None, 0)


def test_pt2_backend_openvino_is_served_by_the_openvino_rung(caplog):
    config = load_config({"pt2": {"compile": {"enable": True, "backend": "openvino"}}})
    assert any("served by the openvino rung" in warning for warning in config.warnings)
    with caplog.at_level(logging.INFO, logger="handlers.rungs"):
        rungs = build_rungs(config, CPU)
    assert SERVED_BY_OPENVINO in caplog.text
    assert [rung.name for rung in rungs] == ["openvino", "compile", "safe_compile", "ipex", "eager"]
    assert rungs[1].unavailable_reason() == SERVED_BY_OPENVINO
    # a ladder that does not list openvino gets it in the compile rung's place
    pinned = load_config({"pt2": {"compile": {"enable": True, "backend": "openvino"}},
                          "pt2_handlers": {"ladder": ["compile", "eager"]}})
    assert [rung.name for rung in build_rungs(pinned, CPU)] == ["openvino", "eager"]
    # the stock handler's failure mode, a 503 at the first request, cannot happen: the rung is proven at load
    result = ladder(Mixer().eval(), build_rungs(pinned, CPU), mixer_batches((2, 5), (3, 7)))
    assert result.active == "openvino"


class Timed(EagerRung):
    """A racing rung whose forward sleeps by the batch's shape: ``ms(shape)``; records the shapes it answers."""

    races = True

    def __init__(self, name, ms):
        self.name, self.ms, self.calls, self.built = name, ms, [], 0

    def apply(self, module, dtype):
        self.built += 1

        def forward(**batch):
            import time

            shape = tuple(next(iter(batch.values())).shape)
            self.calls.append(shape)
            time.sleep(self.ms(shape) / 1000)
            return module(**batch)

        return forward


def test_each_shape_goes_to_the_rung_that_is_faster_at_it(tmp_path):
    """openvino loses the race on the sum (the large batches), but is faster at two of the warmup shapes: the
    batches nearest those go to it, the others (and those as near one of each) to compile."""
    model, batches = Mixer().eval(), mixer_batches((1, 4), (8, 4), (8, 32), (1, 32))
    site = Site(DecisionStore(tmp_path / "memory"), machine="this one")
    openvino_ms = {(1, 4): 1, (8, 4): 2, (8, 32): 30, (1, 32): 5}
    compile_ms = {(1, 4): 5, (8, 4): 6, (8, 32): 10, (1, 32): 5}

    def load():
        openvino = Timed("openvino", lambda shape: openvino_ms.get(shape, 0))
        compile_rung = Timed("compile", lambda shape: compile_ms.get(shape, 0))
        return ladder(model, [openvino, compile_rung, EagerRung()], batches, site=site), openvino, compile_rung

    result, openvino, compile_rung = load()
    assert result.active == "compile"
    assert result.rung_race["routed"] == {"served_by": "openvino (float32)", "input": "'ids'",
                                          "nearest_warmup_shapes": ["1x4", "8x4"]}
    statuses = {a.rung: (a.status, a.reason) for a in result.attempts if a.rung in ("openvino", "compile")}
    assert statuses["openvino"][0] is AttemptStatus.ACCEPTED and "1x4, 8x4 of 'ids'" in statuses["openvino"][1]
    assert statuses["compile"][0] is AttemptStatus.ACCEPTED
    openvino.calls.clear(), compile_rung.calls.clear()
    for shape in ((1, 3), (4, 5), (16, 4), (8, 64), (2, 32), (1, 16)):
        result.forward(**mixer_batches(shape)[0])
    # (1, 16): as near 1x4 as 1x32 (log scale), so compile, the winner, serves it
    assert (openvino.calls, compile_rung.calls) == ([(1, 3), (4, 5), (16, 4)], [(8, 64), (2, 32), (1, 16)])
    # a later load follows the kept race, and builds both: each serves its shapes
    again, openvino, compile_rung = load()
    assert again.rung_race["routed"]["nearest_warmup_shapes"] == ["1x4", "8x4"]
    assert (openvino.built, compile_rung.built) == (1, 1)
