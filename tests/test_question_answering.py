"""question-answering: every answer equal to transformers 4.57.1's question-answering pipeline run eagerly (the
last release that has it; tests/pipeline_reference.py), including contexts of many windows and the pipeline's
options; bad inputs get a 400 naming the problem while their neighbours are answered. The compiled rung through
TorchServe is in test_torchserve.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from handlers.config import load_config
from handlers.errors import InvalidInput, ModelLoadError
from handlers.serving.engine import Engine
from tests import pipeline_reference

SHIPPED_YAML = Path(__file__).resolve().parent.parent / "model_configs" / "minilm-question-answering.yaml"

CONTEXT = "The Eiffel Tower was completed in 1889 in Paris, for the World's Fair, by Gustave Eiffel's company."
LONG_CONTEXT = " ".join(f"In {1800 + year} the city of Lyon built bridge number {year} over the Rhône."
                        for year in range(60))  # ~1,100 tokens: several windows
CALLS = [
    {"question": "When was the tower completed?", "context": CONTEXT},
    {"question": "Who built it?", "context": CONTEXT, "top_k": 3},
    {"question": "Wo liegt 東京?", "context": "東京 ist die Hauptstadt Japans; São Paulo liegt in Brasilien."},
    {"question": "Which bridge?", "context": LONG_CONTEXT},
    {"question": "Which bridge?", "context": LONG_CONTEXT, "top_k": 4, "doc_stride": 32, "max_seq_len": 96},
    {"question": "Which year?", "context": CONTEXT, "handle_impossible_answer": True, "top_k": 2},
    {"question": "Which year?", "context": CONTEXT, "align_to_words": False, "max_answer_len": 3},
]


def eager_engine(model_dir: Path) -> Engine:
    raw = {"pt2": {"compile": {"enable": False}},
           "pt2_handlers": {"task": "question-answering", "model_dir": str(model_dir), "ladder": ["eager"],
                            "dtype": "float32", "max_inputs_per_request": 16}}
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), model_dir.name)
    engine.load()
    return engine


def assert_same_answer(got, want, tolerance: float = 1e-4) -> None:
    """Answer texts and character spans identical, in the same order; scores within ``tolerance``."""
    got, want = (answer if isinstance(answer, list) else [answer] for answer in (got, want))
    assert [(a["answer"], a["start"], a["end"]) for a in got] == [(a["answer"], a["start"], a["end"]) for a in want]
    assert all(abs(ours["score"] - theirs["score"]) <= tolerance for ours, theirs in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def qa(task_model_dirs):
    return eager_engine(task_model_dirs["minilm-qa"])


@pytest.mark.qa_reference
def test_every_answer_equals_the_pipeline(qa, task_model_dirs):
    want = pipeline_reference.answers(task_model_dirs["minilm-qa"], CALLS)
    for call, answer in zip(CALLS, want, strict=True):
        (got,) = qa.predict([call])
        assert_same_answer(got, answer)
    assert isinstance(want[1], list) and len(want[1]) == 3
    assert len({(a["start"], a["end"]) for a in want[4]}) == 4  # four distinct spans, from a context of many windows
    # One server-side batch: single pairs, a list of pairs, a many-window context, each as if it came alone.
    pairs = [{"question": call["question"], "context": call["context"]} for call in CALLS[:4]]
    answers = qa.predict([CALLS[3], {"inputs": pairs, "top_k": 3}, CALLS[0]])
    assert_same_answer(answers[0], want[3])
    for got, answer in zip(answers[1], pipeline_reference.answers(
            task_model_dirs["minilm-qa"], [{**pair, "top_k": 3} for pair in pairs]), strict=True):
        assert_same_answer(got, answer)
    assert_same_answer(answers[2], want[0])


def test_answers_are_spans_of_the_context(qa):
    for call in CALLS:
        (answer,) = qa.predict([call])
        for span in answer if isinstance(answer, list) else [answer]:
            assert call["context"][span["start"] : span["end"]] == span["answer"]
            assert 0.0 <= span["score"] <= 1.0


@pytest.mark.parametrize(("body", "message"), [
    ({"question": "Who?"}, 'the request has no "context"'),
    ({"context": CONTEXT}, 'the request has no "question"'),
    ({"question": "  ", "context": CONTEXT}, '"question" must be a non-empty string'),
    ({"question": "Who?", "context": 3}, '"context" must be a non-empty string'),
    ({"question": "Who?", "context": CONTEXT, "top_k": 0}, '"top_k" must be a positive integer'),
    ({"question": "Who?", "context": CONTEXT, "max_answer_len": "5"}, '"max_answer_len" must be a positive integer'),
    ({"question": "Who?", "context": CONTEXT, "align_to_words": "yes"}, '"align_to_words" must be true or false'),
    ({"question": "Who?", "context": CONTEXT, "max_seq_len": 1000}, '"max_seq_len" 1000 exceeds this model'),
    ({"question": "Who?", "context": CONTEXT, "doc_stride": 384}, '"doc_stride" 384 must be smaller than the window'),
    ({"question": "Who? " * 400, "context": CONTEXT}, "the question is too long for a 384-token window"),
    # Room for the context, but not more than the stride: the Rust tokenizer panics (as the pipeline's did)
    ({"question": "why " * 300, "context": LONG_CONTEXT}, "the question leaves 81 tokens of each 384-token window"),
    ({"question": "why " * 70, "context": LONG_CONTEXT, "max_seq_len": 96, "doc_stride": 32},
     "the question leaves 23 tokens of each 96-token window to the context, not more than the stride (32)"),
    ({"question": "Who?", "context": CONTEXT, "max_seq_len": 96, "doc_stride": 93},
     '"doc_stride" 93 must be smaller than the window (96 tokens, 3 of them special)'),
    ({"question": "Who?", "context": LONG_CONTEXT * 8}, "at most 16 per request"),
    ({"question": "Who?", "context": CONTEXT, "temperature": 1}, "unknown key(s) temperature"),
    ({"inputs": []}, '"inputs" must be a non-empty list'),
    ({"inputs": [{"question": "Who?", "context": CONTEXT, "x": 1}]}, 'unknown key(s) x in "inputs"'),
    ({"inputs": ["Who?"]}, '"inputs"[0] must be a JSON object'),
    ("Who built the tower?", 'send a JSON object with "question" and "context"'),
])
def test_bad_input_is_refused_and_its_neighbours_answered(qa, body, message):
    good, bad, also_good = qa.predict([CALLS[0], body, CALLS[2]])
    assert isinstance(bad, InvalidInput) and bad.status == 400 and message in bad.message, bad
    assert good["answer"] and also_good["answer"]


def test_a_tokenizer_that_pads_on_the_left_is_refused_at_load(task_model_dirs, tmp_path):
    """The span search reads each window from its first column: a left-padding tokenizer fails the load, saying why."""
    from tests.test_token_classification import left_padded_copy

    with pytest.raises(ModelLoadError, match="expects a tokenizer that pads on the right"):
        eager_engine(left_padded_copy(task_model_dirs["minilm-qa"], tmp_path))


@pytest.mark.default_profile  # the tokenizer windows the pairs: torch's version changes nothing here
def test_the_windows_come_from_the_rust_backend_and_transformers_path_answers_the_same(task_model_dirs):
    """The serving path windows each pair through the tokenizer's backend directly (``WindowEncoder``); a tokenizer
    it cannot copy goes through transformers' call, with the same answers."""
    direct, through_transformers = (eager_engine(task_model_dirs["minilm-qa"]) for _ in range(2))
    assert direct.task._window_encoder is not None
    through_transformers.task._window_encoder = None
    batch = [CALLS[0], CALLS[4], {"inputs": [CALLS[2], CALLS[3]], "top_k": 2}, CALLS[6]]
    for got, want in zip(direct.predict(batch), through_transformers.predict(batch), strict=True):
        for ours, theirs in zip(got, want, strict=True) if isinstance(got, list) else [(got, want)]:
            assert_same_answer(ours, theirs, tolerance=0.0)


@pytest.mark.default_profile  # torch 2.13's unbacked sizes (handlers.rungs.unbacked_batch); torch 2.8 traces as before
def test_the_shipped_compile_serves_batch_1_and_larger_batches_with_one_graph(qa, task_model_dirs):
    """The QA head's squeezed logits made inductor guard the batch on 1, so batch 4 compiled a second graph (two
    cold compiles per load); traced with unbacked rows, the one graph serves both, with the eager engine's answers."""
    raw = yaml.safe_load(SHIPPED_YAML.read_text())
    # the compile rung alone: what it traces is the point here (the shipped ladder races openvino against it)
    raw["pt2_handlers"].update(model_dir=str(task_model_dirs["minilm-qa"]), dtype="float32",
                               ladder=["compile", "eager"])
    torch._dynamo.reset()  # a worker's process: no graphs of earlier tests on the same code
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), "qa")
    engine.load()
    optimization = engine.describe()["optimization"]
    (accepted,) = [a for a in optimization["attempts"] if a["status"] == "accepted"]
    assert (accepted["rung"], optimization["shapes"]["batch_sizes"]) == ("compile", [1, 4]), optimization
    assert accepted["dynamo"]["graphs"] == 1, accepted["dynamo"]  # two before: batch 1, then batch 4
    answers = engine.predict(CALLS[:4]) + engine.predict([CALLS[0]])  # four rows, then one
    assert all(isinstance(answer, (dict, list)) for answer in answers), answers
    for got, call in zip(answers, CALLS[:4] + [CALLS[0]], strict=True):
        assert_same_answer(got, qa.predict([call])[0])
    assert engine.describe()["optimization"]["runtime"]["compiles_after_ready"] == 0
