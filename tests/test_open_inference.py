"""Open Inference Protocol (KServe v2) bodies: the codec on its own, then every task answering a v2 request with
the same numbers as its own body, each request of a mixed batch in its own protocol, and bad v2 requests refused
alone with {"error": ...}. Through a real TorchServe (/v2/models/NAME/infer, gRPC ModelInfer): test_torchserve.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.errors import InvalidInput
from handlers.serving.engine import Engine
from handlers.tasks import open_inference
from handlers.tasks.open_inference import OpenInferenceError


def v2(*inputs: dict, **extra) -> dict:
    return {"inputs": list(inputs), **extra}


def text_input(name: str, *texts: str, **extra) -> dict:
    return {"name": name, "shape": [len(texts)], "datatype": "BYTES", "data": list(texts), **extra}


@pytest.mark.parametrize(("body", "message"), [
    (v2(text_input("text", "a"), model="x"), "unknown key(s) model in an inference request"),
    (v2({"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}), "datatype 'FP32'; this model reads text"),
    (v2({"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a", "b"]}), "shape [3] (3 elements) but 2"),
    (v2({"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a", 7]}), "element 1 of \"data\" is int"),
    (v2({"name": "text", "shape": "2", "datatype": "BYTES", "data": ["a"]}), '"shape" must be a non-empty list'),
    (v2({"name": "text", "datatype": "BYTES", "data": ["a"]}), "has no shape"),
    (v2(text_input("text", "a"), text_input("text", "b")), 'input "text" is given twice'),
    (v2(text_input("text", "a", parameters={"binary_data_size": 4})), "parameters binary_data_size are not"),
    (v2(text_input("text", "a"), id=5), '"id" must be a string'),
    (v2(text_input("text", "a"), parameters=[1]), '"parameters" must be an object'),
    (v2(text_input("text", "a"), outputs=["x"]), '"outputs" must be a list of {"name": ...} objects'),
])
def test_the_codec_refuses_what_the_protocol_does_not_allow(body, message):
    with pytest.raises(InvalidInput) as raised:
        open_inference.parse_request(body)
    assert message in raised.value.message


def test_the_codec_reads_nested_data_row_major_and_ignores_the_content_type():
    request = open_inference.parse_request({
        "id": "r1", "parameters": {"top_k": 2},
        "inputs": [{"name": "text", "shape": [2, 2], "datatype": "BYTES", "data": [["a", "b"], ["c", "d"]],
                    "parameters": {"content_type": "str"}}]})
    assert request == open_inference.InferRequest("r1", {"text": ["a", "b", "c", "d"]}, {"top_k": 2}, None)
    # TorchServe's gRPC bridge names the model in the body and sends BYTES as base64.
    bridged = open_inference.parse_request({"model_name": "m", "inputs": [
        {"name": "text", "shape": [2], "datatype": "BYTES", "data": ["aGVsbG8=", "w6lsYW4="]}]})
    assert bridged.texts == {"text": ["hello", "élan"]}
    with pytest.raises(InvalidInput, match="element 0 is not UTF-8 text"):
        open_inference.parse_request({"model_name": "m", "inputs": [text_input("text", "/w==")]})
    assert not open_inference.is_request({"inputs": ["a", "b"]})  # a task's own "inputs" stay the task's
    assert not open_inference.is_request({"inputs": [{"question": "q", "context": "c"}]})


def test_answers_become_tensors_whose_shape_never_depends_on_the_content():
    assert open_inference.to_tensors("embedding", [[0.5, 1.0], [2.0, 3.0]]) == [
        {"name": "embedding", "shape": [2, 2], "datatype": "FP32", "data": [0.5, 1.0, 2.0, 3.0]}]
    records = [{"answer": "a", "score": 0.5, "start": 0, "end": 1}, {"answer": "b", "score": 1, "start": 2, "end": 3}]
    assert open_inference.to_tensors("answers", records) == [
        {"name": "answer", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
        {"name": "score", "shape": [2], "datatype": "FP32", "data": [0.5, 1]},
        {"name": "start", "shape": [2], "datatype": "INT64", "data": [0, 2]},
        {"name": "end", "shape": [2], "datatype": "INT64", "data": [1, 3]}]
    ranked = [[{"label": "x", "score": 0.9}, {"label": "y", "score": 0.1}]] * 3
    assert open_inference.to_tensors("labels", ranked, record_lists=True)[0] == {
        "name": "label", "shape": [3, 2], "datatype": "BYTES", "data": ["x", "y"] * 3}
    assert open_inference.to_tensors("labels", ranked) == [  # without a fixed k: one JSON string per row
        {"name": "labels", "shape": [3], "datatype": "BYTES",
         "data": ['[{"label": "x", "score": 0.9}, {"label": "y", "score": 0.1}]'] * 3}]
    assert open_inference.to_tensors("g", [{"generated_text": "hi", "details": {"seed": None}}])[1] == {
        "name": "details", "shape": [1], "datatype": "BYTES", "data": ['{"seed": null}']}


def eager_engine(task: str, model_dir: Path) -> Engine:
    raw = {"pt2": {"compile": {"enable": False}},
           "pt2_handlers": {"task": task, "model_dir": str(model_dir), "ladder": ["eager"], "dtype": "float32",
                            "max_inputs_per_request": 4}}
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), model_dir.name, model_version="2.0")
    engine.load()
    return engine


TEXTS = ["I love this product, it works great!", "Ada Lovelace worked in London with Charles Babbage."]


def test_embeddings_answer_a_v2_request_with_the_same_vectors(tiny_bert_dir):
    engine = eager_engine("embeddings", tiny_bert_dir)
    native, answer, bad = engine.predict([
        {"inputs": TEXTS}, v2(text_input("text", *TEXTS), id="req-7"), v2(text_input("text", "a", "b"), extra=1)])
    assert answer["model_name"] == tiny_bert_dir.name and answer["model_version"] == "2.0" and answer["id"] == "req-7"
    (tensor,) = answer["outputs"]
    width = len(native["embeddings"][0])
    assert tensor["name"] == "embedding" and tensor["datatype"] == "FP32" and tensor["shape"] == [2, width]
    assert tensor["data"] == [value for row in native["embeddings"] for value in row]
    assert isinstance(bad, OpenInferenceError) and bad.status == 400
    assert bad.to_json()["error"].startswith("unknown key(s) extra")
    (selected,) = engine.predict([v2(text_input("t", "hello"), outputs=[{"name": "nope"}])])
    assert selected.status == 400 and "unknown output(s) nope; this answer has embedding" in selected.message


def test_every_task_answers_a_v2_request_like_its_own_body(task_model_dirs):
    sentiment = eager_engine("text-classification", task_model_dirs["minilm-sentiment"])
    native, answer = sentiment.predict([{"inputs": TEXTS, "top_k": 2},
                                        v2(text_input("text", *TEXTS), parameters={"top_k": 2})])
    label, score = answer["outputs"]
    assert label["shape"] == score["shape"] == [2, 2] and label["datatype"] == "BYTES"
    assert label["data"] == [row["label"] for ranked in native for row in ranked]
    assert score["data"] == [row["score"] for ranked in native for row in ranked]

    ner = eager_engine("token-classification", task_model_dirs["minilm-ner"])
    native, answer = ner.predict([{"inputs": TEXTS}, v2(text_input("text", *TEXTS))])
    (entities,) = answer["outputs"]
    assert entities["name"] == "entities" and entities["shape"] == [2]
    assert [open_inference.json.loads(row) for row in entities["data"]] == native

    qa = eager_engine("question-answering", task_model_dirs["minilm-qa"])
    pairs = [{"question": "Who worked with Babbage?", "context": TEXTS[1]},
             {"question": "What works great?", "context": TEXTS[0]}]
    native, answer, missing = qa.predict([
        {"inputs": pairs}, v2(text_input("question", *(p["question"] for p in pairs)),
                              text_input("context", *(p["context"] for p in pairs))),
        v2(text_input("question", "q?"))])
    columns = {tensor["name"]: tensor["data"] for tensor in answer["outputs"]}
    assert columns == {key: [pair[key] for pair in native] for key in ("answer", "score", "start", "end")}
    assert missing.status == 400 and 'reads two BYTES inputs, "question" and "context"' in missing.message

    llama = eager_engine("text-generation", task_model_dirs["tiny-llama"])
    native, answer, two, streamed = llama.predict([
        {"text": "Once upon a time", "max_new_tokens": 5},
        v2(text_input("prompt", "Once upon a time"), parameters={"max_new_tokens": 5}),
        v2(text_input("prompt", "a", "b")), v2(text_input("prompt", "a"), parameters={"stream": True})])
    assert answer["outputs"] == [{"name": "generated_text", "shape": [1], "datatype": "BYTES",
                                  "data": [native[0]["generated_text"]]}]
    assert two.status == 400 and "one prompt per request; the input holds 2" in two.message
    assert streamed.status == 400 and "not available over the Open Inference Protocol" in streamed.message
