"""text-classification: every answer equal to transformers.pipeline("text-classification") run eagerly,
for a single-label (softmax) and a multi-label (sigmoid) model; bad inputs get a 400 naming the problem
while their neighbours are answered. The compiled rung through TorchServe is in test_torchserve.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.errors import ConfigError, InvalidInput
from handlers.serving.engine import Engine
from handlers.tasks.base import ScoreGate

TEXTS = [
    "I love this product, it works great!",
    "short",
    "Élan vital — naïve café ☕ in 東京, ünïcödé everywhere",
    "a much longer text about serving models in production " * 40,  # ~330 tokens: past the largest warmed 256
]


def eager_engine(model_dir: Path, **settings) -> Engine:
    raw = {"pt2": {"compile": {"enable": False}},
           "pt2_handlers": {"task": "text-classification", "model_dir": str(model_dir), "ladder": ["eager"],
                            "dtype": "float32", "max_inputs_per_request": 4, **settings}}
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), model_dir.name)
    engine.load()
    return engine


def assert_same_labels(got: list[dict], want: list[dict], tolerance: float = 1e-4) -> None:
    assert [row["label"] for row in got] == [row["label"] for row in want], (got, want)
    for ours, theirs in zip(got, want, strict=True):
        assert abs(ours["score"] - theirs["score"]) <= tolerance, (got, want)


@pytest.fixture(scope="module", params=["minilm-sentiment", "minilm-topics"])
def model_and_pipeline(request, task_model_dirs):
    import transformers

    model_dir = task_model_dirs[request.param]
    pipe = transformers.pipeline("text-classification", model=str(model_dir), device="cpu")
    return request.param, eager_engine(model_dir), pipe


@pytest.fixture(scope="module")
def sentiment(task_model_dirs):
    return eager_engine(task_model_dirs["minilm-sentiment"])


def test_every_answer_equals_the_pipeline(model_and_pipeline):
    _, engine, pipe = model_and_pipeline
    for text in TEXTS:
        (default,) = engine.predict([{"text": text}])
        assert_same_labels(default, pipe(text))  # top_k 1 by default, as the pipeline
        (every,) = engine.predict([{"text": text, "top_k": None}])
        assert_same_labels(every, pipe(text, top_k=None))
        (two,) = engine.predict([{"text": text, "top_k": 2}])
        assert_same_labels(two, pipe(text, top_k=2))
    # One server-side batch of mixed lengths and body shapes: each answer as if it came alone.
    answers = engine.predict([TEXTS[0], {"inputs": TEXTS[1:], "top_k": None}, {"text": TEXTS[3], "top_k": 1}])
    assert_same_labels(answers[0], pipe(TEXTS[0]))
    for got, want in zip(answers[1], pipe(TEXTS[1:], top_k=None), strict=True):
        assert_same_labels(got, want)
    assert_same_labels(answers[2], pipe(TEXTS[3], top_k=1))


def test_scores_follow_the_model_config(model_and_pipeline):
    name, engine, _ = model_and_pipeline
    (every,) = engine.predict([{"text": TEXTS[0], "top_k": None}])
    total = sum(row["score"] for row in every)
    if name == "minilm-sentiment":
        assert sorted(row["label"] for row in every) == ["negative", "neutral", "positive"]
        assert abs(total - 1.0) < 1e-5  # single label: softmax
    else:
        assert sorted(row["label"] for row in every) == ["music", "politics", "science", "sports"]
        assert total > 1.0  # multi-label: a sigmoid per label, not a distribution


def test_over_long_texts_are_refused_by_default_and_truncated_when_configured(task_model_dirs, sentiment):
    import transformers

    model_dir = task_model_dirs["minilm-sentiment"]
    long_text = "a much longer text about serving models in production " * 80  # 722 tokens, past 512
    good, bad, too = sentiment.predict([TEXTS[0], {"text": long_text}, long_text])
    assert isinstance(bad, InvalidInput) and bad.status == 400, bad
    assert bad.message.startswith('"text" is 722 tokens long; this model reads at most 512')
    assert isinstance(too, InvalidInput) and too.message.startswith("the text is 722 tokens long")
    assert good[0]["label"]
    lenient = eager_engine(model_dir, too_long="truncate")
    (answer,) = lenient.predict([{"text": long_text, "top_k": None}])
    pipe = transformers.pipeline("text-classification", model=str(model_dir), device="cpu")
    assert_same_labels(answer, pipe(long_text, top_k=None, truncation=True, max_length=512))
    assert lenient.describe()["inputs"]["too_long"] == "truncate"


@pytest.mark.parametrize(("body", "message"), [
    ({"text": "hi", "top_k": "2"}, '"top_k" must be a positive integer or null'),
    ({"text": "hi", "top_k": 0}, '"top_k" must be a positive integer or null'),
    ({"text": "hi", "top_k": True}, '"top_k" must be a positive integer or null'),
    ({"text": ["a"]}, '"text" must be a string'),
    ({"inputs": []}, '"inputs" must be a string or a non-empty list'),
    ({"inputs": ["a", 3]}, '"inputs"[1] must be a string'),
    ({"inputs": ["a"] * 5}, "at most 4 per request"),
    ({"text": "hi", "labels": ["x"]}, "unknown key(s) labels"),
    ({"question": "hi"}, 'send exactly one of "text" or "inputs"'),
    ([1, 2], "expected text or a JSON object"),
])
def test_bad_input_is_refused_and_its_neighbours_answered(sentiment, body, message):
    good, bad, also_good = sentiment.predict(["fine", body, {"text": "also fine"}])
    assert isinstance(bad, InvalidInput) and bad.status == 400 and message in bad.message, bad
    assert good[0]["label"] and also_good[0]["label"]


def test_score_gate_and_its_config():
    gate = ScoreGate(1e-4)
    scores = torch.tensor([[0.7, 0.2, 0.1]])
    assert gate.measure(scores + 5e-5, scores) >= gate.threshold
    assert gate.measure(torch.tensor([[0.2, 0.7, 0.1]]), scores) < gate.threshold  # labels swapped
    raw = {"pt2_handlers": {"task": "text-classification", "quality_gate": {"max_score_error": 2}}}
    with pytest.raises(ConfigError, match=r"max_score_error is a probability difference in \[0, 1\]"):
        load_config(raw)
    raw["pt2_handlers"]["quality_gate"] = {"min_cosine": 0.9}
    with pytest.raises(ConfigError, match="min_cosine"):
        load_config(raw)
