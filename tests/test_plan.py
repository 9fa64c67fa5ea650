"""The ladder's order of attempts (handlers.ladder.plan), as a value: no model, no torch. Each case gives the outcome
of every step the plan may ask for, and checks which steps it asked for, in order, and which one serves."""

from __future__ import annotations

import pytest

from handlers.ladder.plan import REFERENCE, Outcome, Step, walk

RUNGS = ("compile", "safe_compile", "ipex", "eager")
BF16_FP32 = ("bfloat16", "float32")
INT8_BF16_FP32 = ("int8", "bfloat16", "float32")
A, G, R, S = Outcome.ACCEPTED, Outcome.GATE_FAILED, Outcome.RAISED, Outcome.SKIPPED


def run(precisions, outcomes, rungs=RUNGS):
    """``outcomes``: {"rung@precision": Outcome}, the screen as "screen@precision"; unlisted steps raise."""
    asked = []

    def attempt(step: Step) -> Outcome:
        key = f"{'screen' if step.screen else step.rung}@{step.precision}"
        asked.append(key)
        return outcomes.get(key, R)

    served = walk(rungs, precisions, attempt, runs_in=compile_only_int8)
    return asked, f"{served.rung}@{served.precision}"


def compile_only_int8(rung: str, precision: str) -> bool:
    """As handlers.rungs says: int8 runs on the compile rungs alone."""
    return precision != "int8" or rung in ("compile", "safe_compile")


@pytest.mark.parametrize(("precisions", "outcomes", "asked", "served"), [
    # bf16 keeps the answers: compile serves bf16 after a screen.
    (BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": A}, ["screen@bfloat16", "compile@bfloat16"],
     "compile@bfloat16"),
    # NER on a bf16 CPU: bf16 loses the answers even eagerly, so compile runs in fp32 at once (one compile).
    (BF16_FP32, {"screen@bfloat16": G, "compile@float32": A}, ["screen@bfloat16", "compile@float32"],
     "compile@float32"),
    # The compile's own bf16 numbers fail the gate: the same compile in fp32, before any lower rung.
    (BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": G, "compile@float32": A},
     ["screen@bfloat16", "compile@bfloat16", "compile@float32"], "compile@float32"),
    # A compile that raises: the next rung, at the fastest precision again.
    (BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": R, "safe_compile@bfloat16": A},
     ["screen@bfloat16", "compile@bfloat16", "safe_compile@bfloat16"], "safe_compile@bfloat16"),
    # Nothing compiles, IPEX is absent: eager bf16, proven by its screen.
    (BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": S, "safe_compile@bfloat16": S, "ipex@bfloat16": S,
                 "eager@bfloat16": A},
     ["screen@bfloat16", "compile@bfloat16", "safe_compile@bfloat16", "ipex@bfloat16", "eager@bfloat16"],
     "eager@bfloat16"),
    # Everything fails in both precisions: fp32 eager, the reference, without being asked.
    (BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": G, "compile@float32": G, "safe_compile@bfloat16": G,
                 "safe_compile@float32": R, "ipex@bfloat16": S, "eager@bfloat16": A},
     ["screen@bfloat16", "compile@bfloat16", "compile@float32", "safe_compile@bfloat16", "safe_compile@float32",
      "ipex@bfloat16", "eager@bfloat16"], "eager@bfloat16"),
    # bf16 keeps the answers but its screen is slower than fp32 eager (auto's, on a CPU whose bf16 does not pay):
    # no rung runs in it, not even eager; fp32 compiles.
    (BF16_FP32, {"screen@bfloat16": Outcome.SLOWER, "compile@float32": A}, ["screen@bfloat16", "compile@float32"],
     "compile@float32"),
    (BF16_FP32, {"screen@bfloat16": Outcome.SLOWER, "compile@float32": R, "safe_compile@float32": R},
     ["screen@bfloat16", "compile@float32", "safe_compile@float32", "ipex@float32"], "eager@float32"),
    # An AVX2 CPU: fp32 only, no screen, today's ladder.
    (("float32",), {"compile@float32": R, "safe_compile@float32": A},
     ["compile@float32", "safe_compile@float32"], "safe_compile@float32"),
    (("float32",), {}, ["compile@float32", "safe_compile@float32", "ipex@float32"], "eager@float32"),
    # bf16 alone, configured, and it loses the answers: no compile at all, fp32 eager.
    (("bfloat16",), {"screen@bfloat16": G}, ["screen@bfloat16"], "eager@float32"),
    # Three precisions: a failed screen skips fp16 everywhere; bf16 is screened only when reached.
    (("float16", "bfloat16", "float32"), {"screen@float16": G, "screen@bfloat16": A, "compile@bfloat16": A},
     ["screen@float16", "screen@bfloat16", "compile@bfloat16"], "compile@bfloat16"),
    # int8 first: screened eagerly, then compiled; its gate failing tries the same compile in bf16.
    (INT8_BF16_FP32, {"screen@int8": A, "compile@int8": G, "screen@bfloat16": A, "compile@bfloat16": A},
     ["screen@int8", "compile@int8", "screen@bfloat16", "compile@bfloat16"], "compile@bfloat16"),
    # int8 loses the answers even eagerly: no compile runs in int8.
    (INT8_BF16_FP32, {"screen@int8": G, "screen@bfloat16": A, "compile@bfloat16": A},
     ["screen@int8", "screen@bfloat16", "compile@bfloat16"], "compile@bfloat16"),
    # Nothing compiles: IPEX and eager never run int8 (slower than their bf16), so they start at bf16; int8's
    # passed screen does not make eager int8 a candidate.
    (INT8_BF16_FP32, {"screen@int8": A, "compile@int8": S, "safe_compile@int8": S, "screen@bfloat16": A,
                      "ipex@bfloat16": S, "eager@bfloat16": A},
     ["screen@int8", "compile@int8", "safe_compile@int8", "screen@bfloat16", "ipex@bfloat16", "eager@bfloat16"],
     "eager@bfloat16"),
])
def test_the_order_of_attempts(precisions, outcomes, asked, served):
    assert run(precisions, outcomes) == (asked, served)


def test_no_step_is_asked_twice():
    asked, _ = run(BF16_FP32, {"screen@bfloat16": A, "compile@bfloat16": G, "compile@float32": G,
                               "safe_compile@bfloat16": G, "safe_compile@float32": G, "ipex@bfloat16": G,
                               "ipex@float32": G, "eager@bfloat16": G})
    assert len(asked) == len(set(asked))


def test_the_reference_is_never_run():
    asked, served = run(("float32",), {}, rungs=("eager",))
    assert (asked, served) == ([], "eager@float32") and REFERENCE.is_reference


def test_a_ladder_without_compile_rungs_never_screens_int8():
    assert run(("int8", "float32"), {"ipex@float32": S}, rungs=("ipex", "eager")) == (["ipex@float32"],
                                                                                        "eager@float32")


def race(outcomes, winner, settled=lambda step, rival: False):
    """The walk with int8 bound to pay its way: ``winner`` ("challenger" or "rival") is what ``faster`` says."""
    asked, raced = [], []

    def attempt(step: Step) -> Outcome:
        key = f"{'screen' if step.screen else step.rung}@{step.precision}"
        asked.append(key)
        return outcomes.get(key, R)

    def faster(challenger: Step, rival: Step) -> Step:
        raced.append((f"{challenger.rung}@{challenger.precision}", f"{rival.rung}@{rival.precision}"))
        return challenger if winner == "challenger" else rival

    served = walk(RUNGS, INT8_BF16_FP32, attempt, runs_in=compile_only_int8, must_pay=["int8"], faster=faster,
                  settled=settled)
    return asked, raced, f"{served.rung}@{served.precision}"


@pytest.mark.parametrize("winner", ["challenger", "rival"])
def test_accepted_int8_is_raced_against_the_same_rung_in_the_next_precision(winner):
    asked, raced, served = race({"screen@int8": A, "compile@int8": A, "screen@bfloat16": A, "compile@bfloat16": A},
                                winner)
    assert asked == ["screen@int8", "compile@int8", "screen@bfloat16", "compile@bfloat16"]
    assert raced == [("compile@int8", "compile@bfloat16")]
    assert served == ("compile@int8" if winner == "challenger" else "compile@bfloat16")


@pytest.mark.parametrize(("outcomes", "rival"), [
    # bf16 fails the gate on this rung: the rival is the same compile in fp32.
    ({"screen@int8": A, "compile@int8": A, "screen@bfloat16": A, "compile@bfloat16": G, "compile@float32": A},
     "compile@float32"),
    # bf16 loses the answers even eagerly: no compile in bf16, the rival is fp32.
    ({"screen@int8": A, "compile@int8": A, "screen@bfloat16": G, "compile@float32": A}, "compile@float32"),
    # int8 compiled only on safe_compile: its rival is safe_compile too.
    ({"screen@int8": A, "compile@int8": R, "safe_compile@int8": A, "screen@bfloat16": A,
      "safe_compile@bfloat16": A}, "safe_compile@bfloat16"),
])
def test_the_rival_is_the_first_later_precision_that_passes_on_that_rung(outcomes, rival):
    _, raced, served = race(outcomes, "rival")
    assert [r for _, r in raced] == [rival] and served == rival


@pytest.mark.parametrize("won_before", [True, False])
def test_int8_that_won_the_race_before_serves_without_its_rival_being_built(won_before):
    """An earlier load's race that int8 won (``settled``, asked with the rival it would race): the rival's compile
    would only lose, so it is not tried. Where it did not, the race is run as always."""
    told = []

    def settled(step, rival):
        told.append((f"{step.rung}@{step.precision}", f"{rival.rung}@{rival.precision}"))
        return won_before

    asked, raced, served = race({"screen@int8": A, "compile@int8": A, "screen@bfloat16": A, "compile@bfloat16": A},
                                "rival", settled)
    assert told == [("compile@int8", "compile@bfloat16")]
    if won_before:
        assert (asked, raced, served) == (["screen@int8", "compile@int8", "screen@bfloat16"], [], "compile@int8")
    else:
        assert (asked[-1], raced, served) == ("compile@bfloat16", [told[0]], "compile@bfloat16")


def test_int8_serves_unraced_where_the_rung_raises_in_the_next_precision():
    asked, raced, served = race({"screen@int8": A, "compile@int8": A, "screen@bfloat16": A, "compile@bfloat16": R},
                                "rival")
    assert (asked[-1], raced, served) == ("compile@bfloat16", [], "compile@int8")


def test_int8_that_fails_its_gate_is_not_raced():
    _, raced, served = race({"screen@int8": A, "compile@int8": G, "screen@bfloat16": A, "compile@bfloat16": A},
                            "challenger")
    assert (raced, served) == ([], "compile@bfloat16")


def test_a_precision_that_must_pay_needs_a_judge():
    with pytest.raises(ValueError, match="int8 must pay its way"):
        walk(RUNGS, INT8_BF16_FP32, lambda step: A, runs_in=compile_only_int8, must_pay=["int8"])


RACING = ("openvino", "compile", "safe_compile", "ipex", "eager")


def rung_race(outcomes, winner, settled_rungs=(), precisions=BF16_FP32):
    """A ladder whose openvino and compile rungs race each other (rule 7); ``winner``: which side ``faster`` picks."""
    asked, raced = [], []

    def attempt(step: Step) -> Outcome:
        key = f"{'screen' if step.screen else step.rung}@{step.precision}"
        asked.append(key)
        return outcomes.get(key, R)

    def faster(first, second):
        raced.append((f"{first.rung}@{first.precision}", f"{second.rung}@{second.precision}"))
        return first if winner == "first" else second

    def runs_in(rung, precision):
        return precision != "int8" or rung in ("compile", "safe_compile")

    served = walk(RACING, precisions, attempt, runs_in=runs_in, must_pay=["int8"], faster=faster,
                  settled=lambda step, rival: False,
                  rival_of=lambda rung: {"openvino": "compile", "compile": "openvino"}.get(rung),
                  rung_settled=lambda step, rival: (step.rung, rival) in settled_rungs)
    return asked, raced, f"{served.rung}@{served.precision}"


@pytest.mark.parametrize("winner", ["first", "second"])
def test_an_accepted_rung_races_the_next_racing_rung_and_the_faster_serves(winner):
    asked, raced, served = rung_race({"screen@bfloat16": A, "openvino@bfloat16": A, "compile@bfloat16": A}, winner)
    assert asked == ["screen@bfloat16", "openvino@bfloat16", "compile@bfloat16"]
    assert raced == [("openvino@bfloat16", "compile@bfloat16")]
    assert served == ("openvino@bfloat16" if winner == "first" else "compile@bfloat16")


def test_the_rival_rung_walks_its_own_precisions_int8_race_included():
    """compile runs int8, which openvino does not: compile's own int8 race settles its step, which then races."""
    asked, raced, served = rung_race(
        {"screen@int8": A, "screen@bfloat16": A, "openvino@bfloat16": A, "compile@int8": A, "compile@bfloat16": A},
        "second", precisions=INT8_BF16_FP32)
    assert asked == ["screen@bfloat16", "openvino@bfloat16", "screen@int8", "compile@int8", "compile@bfloat16"]
    # the int8 race on compile (int8 against bf16), then openvino against what it left
    assert raced == [("compile@int8", "compile@bfloat16"), ("openvino@bfloat16", "compile@bfloat16")]
    assert served == "compile@bfloat16"


def test_a_rival_that_fails_or_an_earlier_race_leaves_the_accepted_rung_serving():
    asked, raced, served = rung_race({"screen@bfloat16": A, "openvino@bfloat16": A, "compile@bfloat16": R}, "second")
    assert (asked[-1], raced, served) == ("compile@bfloat16", [], "openvino@bfloat16")
    asked, raced, served = rung_race({"screen@bfloat16": A, "openvino@bfloat16": A, "compile@bfloat16": A}, "second",
                                     settled_rungs=[("openvino", "compile")])
    assert (asked, raced, served) == (["screen@bfloat16", "openvino@bfloat16"], [], "openvino@bfloat16")


def test_a_rung_that_falls_through_to_its_rival_is_not_raced_again():
    """openvino cannot convert the model: compile serves, and races nothing (its rival came before it)."""
    asked, raced, served = rung_race({"screen@bfloat16": A, "openvino@bfloat16": R, "compile@bfloat16": A}, "first")
    assert (asked, raced, served) == (["screen@bfloat16", "openvino@bfloat16", "compile@bfloat16"], [],
                                      "compile@bfloat16")
