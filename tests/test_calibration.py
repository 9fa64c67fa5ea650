"""What int8 is calibrated on and what it is judged on (handlers.tasks.calibration): never the same texts."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from handlers.config import ConfigError, load_config
from handlers.errors import ModelLoadError
from handlers.tasks import calibration
from handlers.tasks.embeddings import EmbeddingsTask

SHAPES = [(1, 16), (4, 16), (4, 64)]


@pytest.fixture(scope="module")
def task(minilm_dir):
    return EmbeddingsTask(AutoTokenizer.from_pretrained(minilm_dir), 256, 64, "minilm", None)


def rows(batch, tokenizer) -> list[str]:
    return [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def test_a_calibration_file_calibrates_on_three_texts_in_four_and_judges_on_the_fourth(task, tmp_path):
    topics = "cats rain bread trains tax songs maps ice".split()
    texts = [f"text number {number} about {topic}" for number, topic in enumerate(topics)]
    (tmp_path / "calibration.txt").write_text("\n".join(texts[:4] + ["", "   "] + texts[4:]) + "\n", encoding="utf-8")
    read = calibration.read_texts(tmp_path, "calibration.txt")
    assert read == texts  # blank lines are not texts
    found = calibration.from_texts(task, SHAPES, read, "calibration.txt")
    assert found.source == "6 texts of calibration.txt"
    assert found.held_out_source == "the other 2 texts of calibration.txt"
    calibrated = [row for batch in found.batches for row in rows(batch, task.tokenizer)]
    assert sorted(calibrated) == sorted(texts[i] for i in (0, 1, 2, 4, 5, 6))
    assert [tuple(batch["input_ids"].shape) for batch in found.held_out] == SHAPES  # compiled already: no new graph
    judged = {row for batch in found.held_out for row in rows(batch, task.tokenizer)}
    assert judged and all(texts[3].startswith(row) or texts[7].startswith(row) for row in judged), judged
    assert not judged & set(calibrated)


@pytest.mark.parametrize(("content", "problem"), [
    (b"only\ntwo\n", "holds 2 text(s); int8 needs at least 4, one per line"),
    (b"\xff\xfe not utf-8\n" * 4, "cannot be read as UTF-8 text"),
])
def test_a_calibration_file_too_short_or_not_text_fails_the_load_naming_it(tmp_path, content, problem):
    (tmp_path / "calibration.txt").write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(problem)) as caught:
        calibration.read_texts(tmp_path, "calibration.txt")
    assert "pt2_handlers.int8_calibration 'calibration.txt'" in str(caught.value)


def test_a_calibration_file_outside_the_archive_or_missing_fails_the_load(tmp_path):
    archive = tmp_path / "archive"
    archive.mkdir()
    (tmp_path / "secret.txt").write_text("a\nb\nc\nd\n", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="leads outside the model archive"):
        calibration.read_texts(archive, "../secret.txt")
    with pytest.raises(ModelLoadError, match="cannot be read"):
        calibration.read_texts(archive, "missing.txt")


def test_without_a_file_int8_calibrates_on_the_warmup_and_is_judged_on_a_seeded_vocabulary_sample(task):
    """The held-out texts are the same on every load (the same gate value), other than the warmup's, and at the
    warmup shapes, each row as long as the warmup row it stands for."""
    warmup = task.warmup_batches(SHAPES)
    first, again = (calibration.held_out_sample(task, SHAPES, warmup) for _ in range(2))
    assert first.batches == warmup
    assert first.source == "the warmup batches"
    assert first.held_out_source.startswith("9 texts of the vocabulary's") and first.held_out_source.endswith(
        "whole words (seed 0)")
    for one, other, at in zip(first.held_out, again.held_out, warmup, strict=True):
        assert torch.equal(one["input_ids"], other["input_ids"])
        assert torch.equal(one["attention_mask"], at["attention_mask"])
    warmup_words = {word for batch in warmup for row in rows(batch, task.tokenizer) for word in row.split()}
    judged = [word for batch in first.held_out for row in rows(batch, task.tokenizer) for word in row.split()]
    assert len(set(judged) - warmup_words) > 0.9 * len(set(judged)) > 100


def test_calibration_batches_hold_texts_of_about_one_length(task):
    """Padded rows widen static int8's scales: calibration batches are length-sorted."""
    texts = [" ".join(["word"] * count) for count in (50, 3, 120, 7, 60, 2, 118, 9)]
    batches = task.text_batches(texts, 2)
    assert [batch["attention_mask"].sum(dim=1).tolist() for batch in batches] == [[4, 5], [9, 11], [52, 62],
                                                                                   [120, 122]]


def test_whole_words_take_each_vocabulary_s_word_starts_and_leave_pieces(task):
    words = calibration.whole_words(task.tokenizer)
    assert {"the", "window"} <= set(words) and "##ing" in task.tokenizer.get_vocab()
    assert not [word for word in words if not word.isalpha()]  # no "##ing", "[CLS]", "[unused0]", digits
    assert words == sorted(words)


def test_int8_calibration_is_read_only_with_int8_in_dtype():
    config = load_config({"pt2_handlers": {"dtype": ["int8", "auto"], "int8_calibration": "calibration.txt"}})
    assert config.settings.int8_calibration == "calibration.txt"
    with pytest.raises(ConfigError, match=r"int8_calibration: only int8 is calibrated, and dtype \[auto\] has no int8"):
        load_config({"pt2_handlers": {"int8_calibration": "calibration.txt"}})
