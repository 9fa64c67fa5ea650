"""The embeddings task and the engine around it, on a tiny random BERT (eager-only ladder: fast)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from handlers.config import load_config
from handlers.errors import InferenceError, InvalidInput, ModelLoadError, ModelNotReady
from handlers.serving.engine import Engine, State

EAGER_ONLY = {"pt2_handlers": {"ladder": ["eager"], "dtype": "float32",
                               "shapes": {"batch_sizes": [1, 2], "seq_lengths": [8]}, "max_inputs_per_request": 4}}


def make_engine(model_dir: Path, raw=None, name="tiny") -> Engine:
    raw = json.loads(json.dumps(raw or EAGER_ONLY))
    raw.setdefault("pt2_handlers", {})["model_dir"] = str(model_dir)
    return Engine(load_config(raw), Path("/"), torch.device("cpu"), name)


@pytest.fixture(scope="module")
def engine(tiny_bert_dir):
    engine = make_engine(tiny_bert_dir)
    engine.load()
    return engine


def reference(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """Independent mean pooling + L2 norm on the plain transformers model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


def test_every_body_shape_gets_its_own_answer_shape(engine, tiny_bert_dir):
    texts = ["a short one", "a rather longer sentence about serving models", "third"]
    answers = engine.predict([
        b"a short one",
        "a short one",
        {"text": "a short one"},
        {"inputs": texts[:2]},
        {"input": texts, "model": "whatever", "encoding_format": "float"},
        json.dumps({"inputs": "third"}).encode(),
        texts[1:],
    ])
    want = reference(tiny_bert_dir, texts)
    for answer in answers[:3]:
        torch.testing.assert_close(torch.tensor(answer["embedding"]), want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(answers[3]["embeddings"]), want[:2], atol=1e-5, rtol=1e-4)
    openai = answers[4]
    assert openai["object"] == "list" and openai["model"] == "tiny"
    assert [d["index"] for d in openai["data"]] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in openai["data"]]), want, atol=1e-5, rtol=1e-4)
    assert openai["usage"]["prompt_tokens"] == openai["usage"]["total_tokens"] > 3
    torch.testing.assert_close(torch.tensor(answers[5]["embeddings"]), want[2:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(answers[6]["embeddings"]), want[1:], atol=1e-5, rtol=1e-4)


def test_openai_base64_answers_are_the_float_answers_float32_bytes(engine):
    """encoding_format "base64" (what the OpenAI SDK asks for unless told otherwise): each embedding is the base64 of
    its float32 values, little-endian, as OpenAI's API answers; the same values as the float answer, to the bit, in a
    batch beside other shapes and in a batch of base64 answers alone."""
    texts = ["a short one", "a rather longer sentence about serving models"]
    floats, encoded, single = engine.predict([{"input": texts}, {"input": texts, "encoding_format": "base64"},
                                              {"text": texts[0]}])
    (alone,) = engine.predict([{"input": texts[1], "encoding_format": "base64", "model": "m"}])
    decoded = [np.frombuffer(base64.b64decode(item["embedding"], validate=True), dtype="<f4")
               for item in encoded["data"] + alone["data"]]
    want = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
    assert [d.shape for d in decoded] == [(want.shape[1],)] * 3
    np.testing.assert_array_equal(np.stack(decoded), want[[0, 1, 1]])
    np.testing.assert_array_equal(want[0], np.array(single["embedding"], dtype=np.float32))
    assert {key: value for key, value in encoded.items() if key != "data"} == \
        {key: value for key, value in floats.items() if key != "data"}
    assert [(item["object"], item["index"]) for item in encoded["data"]] == [("embedding", 0), ("embedding", 1)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (None, "request body is empty"),
        (b"", "the text is empty; send some text"),
        (" \n\t ", "the text is empty; send some text"),
        ({"text": ""}, '"text" is empty; send some text'),
        ({"inputs": ["fine", "  "]}, '"inputs"[1] is empty; send some text'),
        ({"input": [""]}, '"input"[0] is empty'),
        (b"\xff\xfe", "not valid UTF-8"),
        (b'{"text": ', "looks like JSON but does not parse"),
        ({"texts": "x"}, 'send exactly one of "text", "inputs" or "input"'),
        ({"text": "x", "inputs": ["y"]}, 'send exactly one of "text", "inputs" or "input"'),
        ({"text": ["x"]}, '"text" must be a string, got list; send a list as "inputs"'),
        ({"inputs": []}, '"inputs" must be a string or a non-empty list of strings'),
        ({"inputs": ["ok", 3]}, r'"inputs"[1] must be a string, got int'),
        ({"inputs": ["x"] * 5}, '"inputs" has 5 texts; at most 4 per request'),
        ({"inputs": ["x"], "model": "m"}, "unknown key(s) model; allowed here: inputs"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format 'int8' is not supported; use \"float\" or"),
        ({"input": "x", "encoding_format": None}, "encoding_format None is not supported"),
        (42, "expected text or a JSON object, got JSON int"),
        ({"inputs": ["ok", "a\ud800b"]}, "holds a lone surrogate ('\\ud800' at character 1)"),
        (b'{"text": "\\udfff"}', "holds a lone surrogate"),
        (b"[" * 100_000, "nested more than 32 levels deep"),  # too deep for json.loads itself
        (json.loads("[" * 40 + "]" * 40), "nested more than 32 levels deep"),
    ],
)
def test_bad_bodies_fail_alone_with_a_clear_400(engine, body, message):
    answers = engine.predict(["fine", body, {"text": "also fine"}])
    assert "embedding" in answers[0] and "embedding" in answers[2]
    error = answers[1]
    assert isinstance(error, InvalidInput) and error.status == 400
    assert message in error.message
    assert error.to_json() == {"code": 400, "type": "InvalidInput", "message": error.message}


def test_a_bug_reading_one_request_fails_that_request_alone(engine, monkeypatch):
    """Whatever breaks in parse or preprocess for one body (here: a tokenizer that chokes on one word) is a
    500 for that body; its neighbours in the batch are answered."""
    task = engine.task
    encode = task.encode

    def choke(texts):
        if any("choke" in text for text in texts):
            raise TypeError("the tokenizer choked")
        return encode(texts)

    monkeypatch.setattr(task, "encode", choke)
    good, bad, also_good = engine.predict(["fine", "please choke", {"inputs": ["also", "fine"]}])
    assert len(good["embedding"]) == len(also_good["embeddings"][1]) == 32
    assert isinstance(bad, InferenceError) and bad.status == 500
    assert bad.message == "the server failed to preprocess this request (TypeError); it is logged"


def rust_panic() -> BaseException:
    """A real panic of the tokenizers library, as pyo3 raises it (``PanicException``, a BaseException): a window's
    stride not below the room left for the second text."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.enable_truncation(max_length=3, stride=2, strategy="only_second")
    try:
        backend.encode("a", "a a a a a a")
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no panic")


@pytest.mark.parametrize("stage", ["parse", "preprocess"])
def test_a_tokenizer_panic_on_one_request_fails_that_request_alone(engine, monkeypatch, stage):
    """A Rust panic is no ``Exception``: it used to pass every guard and fail the whole batch."""
    panic = rust_panic()
    assert not isinstance(panic, Exception) and type(panic).__name__ == "PanicException"
    task = engine.task
    original = getattr(task, "parse" if stage == "parse" else "encode")

    def panicking(value):
        if "panic" in str(value):
            raise panic
        return original(value)

    monkeypatch.setattr(task, "parse" if stage == "parse" else "encode", panicking)
    good, bad, also_good = engine.predict(["fine", "please panic", {"inputs": ["also", "fine"]}])
    assert len(good["embedding"]) == len(also_good["embeddings"][1]) == 32
    assert isinstance(bad, InferenceError) and bad.message == (
        f"the server failed to {stage} this request (PanicException); it is logged")


def test_a_batch_of_only_bad_bodies_runs_no_forward(engine):
    batches = engine.batches
    answers = engine.predict([{"nope": 1}, None])
    assert all(isinstance(a, InvalidInput) for a in answers)
    assert engine.batches == batches + 1


def test_describe_reports_the_ladder(engine):
    described = engine.describe()
    assert described["state"] == "ready" and described["task"] == "embeddings"
    optimization = described["optimization"]
    assert optimization["active"] == "eager"
    assert optimization["attempts"][0]["rung"] == "eager" and optimization["attempts"][0]["status"] == "accepted"
    assert optimization["device"] == "cpu" and optimization["dtype"] == "float32"
    assert optimization["torch"] == torch.__version__
    json.dumps(described)  # must be JSON-serializable as is


def test_requests_before_ready_get_503(tiny_bert_dir):
    engine = make_engine(tiny_bert_dir)
    assert engine.state is State.LOADING
    with pytest.raises(ModelNotReady) as info:
        engine.predict(["hello"])
    assert info.value.status == 503


def test_a_failed_load_is_reported_and_refuses_requests(tmp_path, tiny_bert_dir):
    shutil.copytree(tiny_bert_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    engine = make_engine(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="has no .safetensors weights; pt2-handlers loads safetensors only"):
        engine.load()
    assert engine.state is State.FAILED and "safetensors" in engine.describe()["failure"]
    with pytest.raises(ModelNotReady):
        engine.predict(["hello"])


@pytest.mark.parametrize("model_dir", ["../outside", "model/../../outside", "/etc"])
def test_a_model_dir_leading_out_of_the_archive_is_refused(tmp_path, tiny_bert_dir, model_dir):
    archive = tmp_path / "archive"
    archive.mkdir()
    shutil.copytree(tiny_bert_dir, tmp_path / "outside")  # a real model, so only the path can be the reason
    raw = json.loads(json.dumps(EAGER_ONLY))
    raw.setdefault("pt2_handlers", {})["model_dir"] = model_dir
    engine = Engine(load_config(raw), archive, torch.device("cpu"), "escape")
    with pytest.raises(ModelLoadError, match=f"pt2_handlers.model_dir '{model_dir}' leads outside the model archive"):
        engine.load()
    assert engine.state is State.FAILED


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        make_engine(tmp_path).load()


def test_buckets_are_fitted_to_max_length(tiny_bert_dir):
    raw = {"pt2_handlers": {"ladder": ["eager"], "dtype": "float32", "max_length": 16,
                            "shapes": {"batch_sizes": [2, 1], "seq_lengths": [8, 32]}}}
    engine = make_engine(tiny_bert_dir, raw)
    engine.load()
    assert engine.describe()["optimization"]["shapes"]["seq_lengths"] == [8, 16]
    assert engine.describe()["optimization"]["shapes"]["batch_sizes"] == [1, 2]


def test_max_length_beyond_the_model_is_refused(tiny_bert_dir):
    with pytest.raises(ModelLoadError, match="exceeds the model's 128 positions"):
        make_engine(tiny_bert_dir, {"pt2_handlers": {"ladder": ["eager"], "max_length": 4096}}).load()


def test_long_texts_are_truncated_to_max_length(tiny_bert_dir):
    engine = make_engine(tiny_bert_dir, {"pt2_handlers": {"ladder": ["eager"], "max_length": 16,
                                                          "shapes": {"seq_lengths": [16]}}})
    engine.load()
    answer = engine.predict([{"input": "word " * 500}])[0]
    assert answer["usage"]["prompt_tokens"] == 16


def test_compiled_tiny_model_with_live_fallback(tiny_bert_dir):
    """A compile rung whose forward starts failing on live traffic: answers stay right, then it demotes."""
    raw = {"pt2": {"compile": {"enable": True, "backend": "aot_eager"}},
           "pt2_handlers": {"ladder": ["compile"], "max_runtime_failures": 1, "dtype": "float32",
                            "shapes": {"batch_sizes": [1], "seq_lengths": [8, 128]}}}
    engine = make_engine(tiny_bert_dir, raw)
    engine.load()
    assert engine.active_rung == "compile"
    good = engine.predict([{"text": "hello"}])[0]["embedding"]
    engine.guard._optimized = lambda **batch: (_ for _ in ()).throw(RuntimeError("device lost"))
    again = engine.predict([{"text": "hello"}])[0]["embedding"]
    torch.testing.assert_close(torch.tensor(again), torch.tensor(good), atol=1e-5, rtol=1e-4)
    assert engine.active_rung == "eager" and engine.runtime_failures == 1
    assert engine.describe()["optimization"]["runtime"]["demoted"] is True


# One thread count: with shared cores (threads: auto) each of the 9 graphs would be proven at a second count too,
# which tests/test_ladder.py and tests/test_core_share.py cover; this is about padding.
BUCKETS = {"pt2": {"compile": {"enable": True, "backend": "aot_eager"}},
           "pt2_handlers": {"ladder": ["compile"], "dtype": "float32", "max_inputs_per_request": 8, "threads": 1,
                            "shapes": {"policy": "buckets", "batch_sizes": [1, 2, 4], "seq_lengths": [8, 16, 32],
                                       "after_ready": "fail"}}}


def test_bucket_padding_never_changes_an_answer(tiny_bert_dir):
    """Every batch size 1..6 (chunked past the largest bucket) and lengths across every bucket, served by a
    compiled rung that refuses any unwarmed shape: each answer equals the unpadded reference."""
    # 9 graphs of BertModel.forward: graphs other tests left on the same code would count against dynamo's
    # recompile limit, as they never would in a worker, which loads one model.
    torch._dynamo.reset()
    engine = make_engine(tiny_bert_dir, BUCKETS)
    engine.load()
    assert engine.active_rung == "compile", engine.describe()["optimization"]["attempts"]
    texts = ["hi", "a few more words here", "word " * 12, "a sentence of medium length about trains", "x " * 40,
             "the last one"]  # 3 to 42 tokens: buckets 8, 16, 32 and max_length (128)
    want = reference(tiny_bert_dir, texts)
    for rows in range(1, len(texts) + 1):
        answer = engine.predict([{"inputs": texts[:rows]}])[0]
        torch.testing.assert_close(torch.tensor(answer["embeddings"]), want[:rows], atol=1e-5, rtol=1e-4)
    runtime = engine.describe()["optimization"]["runtime"]
    assert (runtime["compiles_after_ready"], runtime["eager_batches"], runtime["runtime_failures"]) == (0, 0, 0)


def test_bf16_serving_is_gated_against_fp32(tiny_bert_dir):
    raw = {"pt2_handlers": {"ladder": ["eager"], "dtype": "bfloat16",
                            "shapes": {"batch_sizes": [1, 2], "seq_lengths": [8]}}}
    engine = make_engine(tiny_bert_dir, raw)
    engine.load()
    optimization = engine.describe()["optimization"]
    attempt = optimization["attempts"][0]
    assert (optimization["active"], optimization["dtype"]) == ("eager", "bfloat16")
    assert attempt["quality"]["metric"] == "min_cosine" and attempt["quality"]["value"] >= 0.999
    want = reference(tiny_bert_dir, ["hello there"])
    got = torch.tensor(engine.predict([{"text": "hello there"}])[0]["embedding"])
    assert torch.nn.functional.cosine_similarity(got, want[0], dim=0) >= 0.999
