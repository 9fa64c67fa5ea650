"""token-classification: every answer equal to transformers.pipeline("token-classification") run eagerly, for
each aggregation strategy; over-long texts rejected (default) or truncated as configured; bad inputs get a 400
naming the problem while their neighbours are answered. The compiled rung through TorchServe is in
test_torchserve.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.errors import InvalidInput
from handlers.serving.engine import Engine

TEXTS = [
    "Angela Merkel visited the Élysée in Paris with Apple's Tim Cook on Tuesday.",
    "short",
    "Naïve café owners in 東京 and São Paulo — ünïcödé everywhere",
    "Serving models in production with TorchServe in Berlin and New York. " * 25,  # ~400 tokens
]
STRATEGIES = ["none", "simple", "first", "average", "max"]


def eager_engine(model_dir: Path, **settings) -> Engine:
    raw = {"pt2": {"compile": {"enable": False}},
           "pt2_handlers": {"task": "token-classification", "model_dir": str(model_dir), "ladder": ["eager"],
                            "dtype": "float32", "max_inputs_per_request": 4, **settings}}
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), model_dir.name)
    engine.load()
    return engine


def assert_same_entities(got: list[dict], want: list[dict], tolerance: float = 1e-4) -> None:
    """Labels, words and character spans identical; scores within ``tolerance``."""
    assert len(got) == len(want), (got, want)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.keys() == theirs.keys(), (ours, theirs)
        assert {k: v for k, v in ours.items() if k != "score"} == {
            k: (v.item() if hasattr(v, "item") else v) for k, v in theirs.items() if k != "score"}, (ours, theirs)
        assert abs(ours["score"] - float(theirs["score"])) <= tolerance, (ours, theirs)


@pytest.fixture(scope="module")
def ner(task_model_dirs):
    import transformers

    model_dir = task_model_dirs["minilm-ner"]
    return eager_engine(model_dir), transformers.pipeline("token-classification", model=str(model_dir), device="cpu")


def test_every_answer_equals_the_pipeline(ner):
    engine, pipe = ner
    assert engine.task._encoder is not None  # the serving path under test: the Rust backend (BatchEncoder)
    for text in TEXTS:
        (default,) = engine.predict([text])  # aggregation none, "O" ignored: the pipeline's defaults
        assert_same_entities(default, pipe(text))
        for strategy in STRATEGIES:
            (got,) = engine.predict([{"text": text, "aggregation_strategy": strategy}])
            assert_same_entities(got, pipe(text, aggregation_strategy=strategy))
    (everything,) = engine.predict([{"text": TEXTS[0], "ignore_labels": []}])
    assert_same_entities(everything, pipe(TEXTS[0], ignore_labels=[]))
    assert any(entity["entity"] == "O" for entity in everything)
    # One server-side batch of mixed lengths and body shapes: each answer as if it came alone.
    answers = engine.predict([TEXTS[3], {"inputs": TEXTS[:3], "aggregation_strategy": "simple"}, {"text": TEXTS[1]}])
    assert_same_entities(answers[0], pipe(TEXTS[3]))
    for got, want in zip(answers[1], pipe(TEXTS[:3], aggregation_strategy="simple"), strict=True):
        assert_same_entities(got, want)
    assert_same_entities(answers[2], pipe(TEXTS[1]))


def test_a_tokenizer_the_rust_path_cannot_take_gives_the_same_answers_through_transformers(ner):
    engine, _ = ner
    bodies = [{"inputs": TEXTS[:3], "aggregation_strategy": "simple"}, TEXTS[1], {"text": TEXTS[0]}]
    through_rust = engine.predict(bodies)
    encoder, engine.task._encoder = engine.task._encoder, None  # as BatchEncoder.of answers for such a tokenizer
    try:
        assert engine.predict(bodies) == through_rust
    finally:
        engine.task._encoder = encoder


def test_offsets_point_into_the_text_as_sent(ner):
    engine, pipe = ner
    normalize = pipe.tokenizer.backend_tokenizer.normalizer.normalize_str  # lower case, accents stripped
    (entities,) = engine.predict([{"text": TEXTS[2], "aggregation_strategy": "simple"}])
    assert len(entities) >= 3
    for entity in entities:
        sent = TEXTS[2][entity["start"] : entity["end"]]
        assert normalize(sent).replace(" ", "") == entity["word"].replace(" ", ""), (sent, entity)


def test_over_long_texts_are_refused_by_default_and_truncated_when_configured(task_model_dirs):
    long_text = " ".join(["Paris"] * 40)  # 42 tokens with [CLS] and [SEP]
    strict = eager_engine(task_model_dirs["minilm-ner"], max_length=16)
    good, bad = strict.predict(["Tim Cook in Paris", {"inputs": ["fine", long_text]}])
    assert isinstance(bad, InvalidInput) and bad.status == 400, bad
    assert '"inputs"[1] is 42 tokens long; this model reads at most 16' in bad.message
    assert "too_long: truncate" in bad.message and isinstance(good, list)
    assert strict.describe()["inputs"] == {"max_length": 16, "too_long": "reject", "max_per_request": 4}
    lenient = eager_engine(task_model_dirs["minilm-ner"], max_length=16, too_long="truncate")
    (entities,) = lenient.predict([{"text": long_text, "ignore_labels": []}])
    assert len(entities) == 14 and entities[-1]["index"] == 14  # the first 16 tokens, less [CLS] and [SEP]


@pytest.mark.parametrize(("body", "message"), [
    ({"text": "hi", "aggregation_strategy": "best"}, '"aggregation_strategy" must be one of: none, simple, first'),
    ({"text": "hi", "ignore_labels": "O"}, '"ignore_labels" must be a list of label names'),
    ({"text": ["a"]}, '"text" must be a string'),
    ({"inputs": []}, '"inputs" must be a string or a non-empty list'),
    ({"inputs": ["a"] * 5}, "at most 4 per request"),
    ({"text": "hi", "stride": 8}, "unknown key(s) stride"),
    ({"question": "hi"}, 'send exactly one of "text" or "inputs"'),
    (b"\xff\xfe", "request body is not valid UTF-8"),
])
def test_bad_input_is_refused_and_its_neighbours_answered(ner, body, message):
    engine, pipe = ner
    good, bad = engine.predict([TEXTS[0], body])
    assert isinstance(bad, InvalidInput) and bad.status == 400 and message in bad.message, bad
    assert_same_entities(good, pipe(TEXTS[0]))


def test_a_cpu_worker_on_a_machine_with_a_gpu_keeps_its_model_on_the_cpu(task_model_dirs, monkeypatch):
    """transformers' pipeline moves the model to the first GPU it sees unless told its device: on a GPU machine a
    CPU worker's model went to cuda:0 and its load failed (found on an H100, tests/test_gpu.py). The GPU cannot exist
    here, so transformers is told there is one: the pipeline must not try to move the model to it."""
    import transformers.pipelines.base

    monkeypatch.setattr(transformers.pipelines.base, "is_torch_cuda_available", lambda: True)
    engine = eager_engine(task_model_dirs["minilm-ner"])
    assert engine.task._pipeline.device == torch.device("cpu")
    (entities,) = engine.predict([{"text": TEXTS[0], "ignore_labels": []}])
    assert entities and all(entity["entity"] for entity in entities)


def left_padded_copy(model_dir: Path, tmp_path: Path) -> Path:
    """``model_dir`` with its tokenizer set to pad on the left, as some models' tokenizers are."""
    import shutil

    import transformers

    copy = tmp_path / f"{model_dir.name}-left"
    shutil.copytree(model_dir, copy)
    transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left").save_pretrained(copy)
    return copy


def test_texts_padded_on_the_left_keep_their_entities(task_model_dirs, tmp_path):
    """A tokenizer that pads on the left: each text's logits are read at its own tokens. Each text's logits alone are
    placed where the left-padded batch holds its tokens, so this checks where answers are read, not the model
    (whose absolute positions shift under left padding: BERT's answers are the model's, padded as configured)."""
    engine = eager_engine(left_padded_copy(task_model_dirs["minilm-ner"], tmp_path))
    task = engine.task
    requests = [task.parse({"text": text, "aggregation_strategy": strategy})
                for text in (TEXTS[1], TEXTS[0]) for strategy in ("none", "simple")]
    batch = task.preprocess(requests)
    mask = batch.inputs["attention_mask"].bool()
    assert not mask[0, 0] and mask[0, -1] and mask[2].all()  # "short" padded on the left
    alone = [task.preprocess([request]) for request in requests]
    logits = [engine.forward_step(**one.inputs) for one in alone]
    placed = torch.zeros(len(requests), mask.shape[1] + 3, logits[0].shape[-1])  # + the shape policy's columns
    for row, one in enumerate(logits):
        placed[row, : mask.shape[1]][mask[row]] = one[0]
    want = [task.postprocess(one, encoded, [request])[0]
            for one, encoded, request in zip(logits, alone, requests, strict=True)]
    assert task.postprocess(placed, batch, requests) == want
    assert [entity["word"] for entity in want[3]] and want[2] != want[3]
