"""handlers.tasks.batch_encoder: the serving path's tokenizing through the Rust backend gives exactly what
transformers' ``tokenizer(texts, truncation=True, max_length=..., padding=True)`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from handlers.tasks.batch_encoder import BatchEncoder, WindowEncoder
from tests.test_embeddings import make_engine

TEXTS = [
    "the quick brown fox",
    "Naïve café owners in 東京 and São Paulo — ünïcödé everywhere, emoji 🚀",
    "[CLS] special [SEP] tokens <s> </s> [PAD] [UNK] written as text",
    "  spaced\tout\n  ",
    "Serving models in production with TorchServe in Berlin and New York. " * 40,  # past every max_length below
    "a",
]


def transformers_encoding(tokenizer, texts: list[str], max_length: int) -> dict[str, np.ndarray]:
    encoded = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="np")
    return {name: encoded[name] for name in tokenizer.model_input_names if name in encoded}


@pytest.fixture(scope="module", params=["minilm", "tiny-llama"])
def tokenizer(request, minilm_dir, task_model_dirs):
    """A WordPiece tokenizer with token types (MiniLM's) and a byte-level BPE one (tiny-llama's)."""
    path = minilm_dir if request.param == "minilm" else task_model_dirs["tiny-llama"]
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("max_length", [8, 64, 256])
def test_every_batch_is_encoded_as_transformers_encodes_it(tokenizer, max_length):
    encoder = BatchEncoder.of(tokenizer, max_length)
    assert encoder is not None
    batches = [TEXTS, TEXTS[:1], TEXTS[4:], [TEXTS[1], TEXTS[5], TEXTS[0]]]
    for texts in batches:
        want = transformers_encoding(tokenizer, texts, max_length)
        got = encoder(texts)
        assert list(got) == list(want)
        for name, array in want.items():
            assert got[name].numpy().dtype == np.int64 and np.array_equal(got[name].numpy(), array), (name, texts)


@pytest.mark.parametrize("max_length", [8, 256])
def test_offsets_and_special_tokens_are_those_transformers_gives_token_classification(tokenizer, max_length):
    """What token classification reads besides the inputs (``return_offsets_mapping``, ``return_special_tokens_mask``),
    truncated and padded: the same arrays, so the pipeline's entity grouping sees the same spans."""
    encoder = BatchEncoder.of(tokenizer, max_length)
    for texts in (TEXTS, TEXTS[:1], [TEXTS[1], TEXTS[5]]):
        want = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_offsets_mapping=True,
                         return_special_tokens_mask=True, return_tensors="np")
        inputs, offsets, special = encoder.with_offsets(texts)
        assert all(np.array_equal(inputs[name].numpy(), want[name]) for name in inputs), texts
        assert offsets.numpy().dtype == special.numpy().dtype == np.int64
        assert np.array_equal(offsets.numpy(), want["offset_mapping"]), texts
        assert np.array_equal(special.numpy(), want["special_tokens_mask"]), texts


@pytest.mark.parametrize("setting", [{"padding_side": "left"}, {"truncation_side": "left"},
                                     {"split_special_tokens": True}])
def test_the_tokenizers_own_settings_are_followed(minilm_dir, task_model_dirs, setting):
    for path in (minilm_dir, task_model_dirs["tiny-llama"]):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, **setting)
        assert all(getattr(tokenizer, name) == value for name, value in setting.items())
        encoder = BatchEncoder.of(tokenizer, 8)
        for texts in (TEXTS, TEXTS[2:3]):
            want = transformers_encoding(tokenizer, texts, 8)
            got = encoder(texts)
            assert all(np.array_equal(got[name].numpy(), want[name]) for name in want), (path.name, setting, texts)


def test_a_tokenizer_class_that_changes_the_call_keeps_transformers_path(minilm_dir):
    class Infilling(transformers.BertTokenizer):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    assert BatchEncoder.of(Infilling.from_pretrained(minilm_dir), 64) is None
    assert BatchEncoder.of(transformers.BertTokenizer.from_pretrained(minilm_dir), 64) is not None


def test_the_first_text_past_max_length_is_the_one_transformers_counts_past_it(tokenizer):
    """``first_too_long`` stands in for transformers' lengths in the too_long: reject check: texts of max_length - 1,
    max_length and max_length + 1 tokens, special tokens included."""
    max_length = 16
    encoder = BatchEncoder.of(tokenizer, max_length)
    by_length = {}
    for count in range(1, 40):
        for text in ("a " * count, "serving " + "a " * count):
            by_length.setdefault(len(tokenizer(text)["input_ids"]), text)
    fits, full, over = by_length[max_length - 1], by_length[max_length], by_length[max_length + 1]
    assert encoder.first_too_long([fits, full]) is None
    assert encoder.first_too_long([fits, over, full, over]) == 1
    assert encoder.first_too_long([over]) == 0


def test_transformers_calls_between_leave_the_encoder_as_it_was(tokenizer):
    """transformers reconfigures its tokenizer's backend on each call (here: no truncation, no padding, as the
    length check before a 400 does); the encoder has its own copy."""
    encoder = BatchEncoder.of(tokenizer, 16)
    lengths = tokenizer(TEXTS, return_length=True)["length"]
    assert max(lengths) > 16
    want = transformers_encoding(tokenizer, TEXTS, 16)
    tokenizer(TEXTS, return_length=True)
    got = encoder(TEXTS)
    assert all(np.array_equal(got[name].numpy(), want[name]) for name in want)


def test_a_tokenizer_without_a_padding_token_keeps_transformers_path(task_model_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(task_model_dirs["tiny-llama"])
    tokenizer.pad_token = None
    assert BatchEncoder.of(tokenizer, 64) is None


def test_an_embeddings_request_is_answered_through_the_encoder(tiny_bert_dir):
    engine = make_engine(tiny_bert_dir)
    engine.load()
    assert engine.task._encoder is not None
    calls = []
    encoder = engine.task._encoder
    engine.task._encoder = lambda texts: calls.append(texts) or encoder(texts)
    (answer,) = engine.predict([{"inputs": ["alpha beta", "gamma"]}])
    assert calls == [["alpha beta", "gamma"]] and len(answer["embeddings"]) == 2


QUESTION = "Where is the café near 東京?"
CONTEXT = " ".join(f"In {1800 + year} the café at São Paulo opened branch {year} near 東京." for year in range(40))


@pytest.mark.parametrize(("window", "stride"), [(384, 128), (64, 16), (32, 8)])
def test_question_answering_windows_are_those_transformers_gives(tokenizer, window, stride):
    """``WindowEncoder``: a question and a long context in windows of ``window`` tokens overlapping by ``stride``,
    the same encodings (ids, token types, mask, offsets, which sequence each token is from) as transformers'
    ``return_overflowing_tokens`` call, whatever window the call before used; and a batch of them padded as
    ``tokenizer.pad`` pads it."""
    encoder = WindowEncoder.of(tokenizer)
    assert encoder is not None
    encoder.windows("warm", "up", 48, 4)  # another request's options before
    want = tokenizer(QUESTION, CONTEXT, truncation="only_second", max_length=window, stride=stride,
                     return_overflowing_tokens=True).encodings
    got = encoder.windows(QUESTION, CONTEXT, window, stride)
    assert len(got) == len(want) > (1 if window < 384 else 0)
    for ours, theirs in zip(got, want, strict=True):
        for field in ("ids", "type_ids", "attention_mask", "offsets", "sequence_ids"):
            assert getattr(ours, field) == getattr(theirs, field), field
    short = encoder.windows("Who?", "Gustave Eiffel.", window, stride)
    batch = got + short
    names = tokenizer.model_input_names
    fields = {"input_ids": "ids", "token_type_ids": "type_ids", "attention_mask": "attention_mask"}
    padded = tokenizer.pad([{name: getattr(encoding, fields[name]) for name in names} for encoding in batch],
                           padding=True, return_tensors="np")
    inputs = encoder.pad(batch)
    assert list(inputs) == list(names)
    assert all(inputs[name].numpy().dtype == np.int64 and np.array_equal(inputs[name].numpy(), padded[name])
               for name in names)


def test_a_question_longer_than_the_window_is_the_backends_error(tokenizer):
    encoder = WindowEncoder.of(tokenizer)
    with pytest.raises(Exception, match="too short to respect the provided max_length"):
        encoder.windows("why " * 100, CONTEXT, 64, 16)
    assert len(encoder.windows(QUESTION, CONTEXT, 64, 16)) > 1  # and the next request is windowed as ever


@pytest.mark.parametrize("setting", [{"truncation_side": "left"}, {"split_special_tokens": True},
                                     {"pad_token_type_id": 1}])
def test_question_answering_windows_follow_the_tokenizers_own_settings(minilm_dir, setting):
    """Truncating the context from the left, splitting special tokens written in the text, and padding token types
    with 1: the windows and their padded batch as transformers makes them."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir, **{k: v for k, v in setting.items()
                                                                          if k != "pad_token_type_id"})
    if "pad_token_type_id" in setting:
        tokenizer._pad_token_type_id = setting["pad_token_type_id"]  # no from_pretrained argument sets it
    assert all(getattr(tokenizer, name) == value for name, value in setting.items())
    encoder = WindowEncoder.of(tokenizer)
    question = "What is [SEP] doing in [CLS] a question?"
    want = tokenizer(question, CONTEXT, truncation="only_second", max_length=48, stride=12,
                     return_overflowing_tokens=True).encodings
    got = encoder.windows(question, CONTEXT, 48, 12)
    assert [(e.ids, e.type_ids, e.offsets) for e in got] == [(e.ids, e.type_ids, e.offsets) for e in want]
    batch = got + encoder.windows("Who?", "Gustave Eiffel.", 48, 12)
    padded = tokenizer.pad([{"input_ids": e.ids, "token_type_ids": e.type_ids, "attention_mask": e.attention_mask}
                            for e in batch], padding=True, return_tensors="np")
    inputs = encoder.pad(batch)
    assert all(np.array_equal(inputs[name].numpy(), padded[name]) for name in padded)
    if "pad_token_type_id" in setting:
        assert inputs["token_type_ids"].numpy()[-1, -1] == 1  # the short pair's padding
