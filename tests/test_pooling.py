"""handlers/tasks/pooling.py: an embeddings model is served with its own sentence-transformers pooling and
normalisation, read from its directory, and its answers equal sentence-transformers' for that directory; a module
pt2-handlers does not compute is refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from handlers.errors import ModelLoadError
from handlers.tasks import pooling
from tests.test_embeddings import make_engine

TEXTS = ["a short one", "a rather longer sentence about serving models and their pooling", "third"]
FROM_FILES = "1_Pooling/config.json and modules.json (sentence-transformers)"


def saved_by_sentence_transformers(model_dir: Path, out: Path, mode: str | list[str], normalize: bool) -> Path:
    """The tiny BERT saved by sentence-transformers itself with this pooling: its own files, in its own format."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(model_dir))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=mode)]
    SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(out))
    return out


def sentence_transformers_answer(model_dir: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)


def served(model_dir: Path, raw: dict | None = None) -> tuple[torch.Tensor, dict]:
    engine = make_engine(model_dir, raw)
    engine.load()
    (answer,) = engine.predict([{"inputs": TEXTS}])
    return torch.tensor(answer["embeddings"]), engine.describe()["outputs"]["pooling"]


@pytest.mark.parametrize(("mode", "normalize"), [
    ("cls", True),  # BGE, arctic-embed
    ("max", False),
    ("mean_sqrt_len_tokens", True),
    ("weightedmean", False),
    ("lasttoken", True),  # decoder embedders
    (["cls", "mean"], False),  # several: concatenated
])
def test_each_pooling_answers_what_sentence_transformers_does(tiny_bert_dir, tmp_path, mode, normalize):
    directory = saved_by_sentence_transformers(tiny_bert_dir, tmp_path / "model", mode, normalize)
    got, described = served(directory)
    want = sentence_transformers_answer(directory)
    assert got.shape == want.shape == (len(TEXTS), 32 * (len(mode) if isinstance(mode, list) else 1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert described == {"modes": mode if isinstance(mode, list) else [mode], "normalize": normalize,
                         "from": FROM_FILES}


def test_the_older_format_of_the_hub_is_read_too(tiny_bert_dir, tmp_path):
    """Most models on the Hub carry the flags format and the older module paths: CLS and mean concatenated, no
    Normalize module, read as sentence-transformers reads them."""
    directory = shutil.copytree(tiny_bert_dir, tmp_path / "model")
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    got, described = served(directory)
    torch.testing.assert_close(got, sentence_transformers_answer(directory), atol=1e-5, rtol=1e-4)
    assert described == {"modes": ["cls", "mean"], "normalize": False, "from": FROM_FILES}


def test_a_compiled_rung_pools_as_the_model_does(tiny_bert_dir, tmp_path):
    """The pooling is inside the module the ladder compiles: one dynamic inductor graph, proven against fp32 eager,
    serves CLS pooling as sentence-transformers computes it."""
    torch._dynamo.reset()
    directory = saved_by_sentence_transformers(tiny_bert_dir, tmp_path / "model", "cls", True)
    raw = {"pt2": {"compile": {"enable": True, "backend": "inductor"}},
           "pt2_handlers": {"ladder": ["compile", "eager"], "dtype": "float32", "threads": 1,
                            "shapes": {"policy": "dynamic", "batch_sizes": [1, 2], "seq_lengths": [8, 16]}}}
    engine = make_engine(directory, raw)
    engine.load()
    assert engine.active_rung == "compile"
    (answer,) = engine.predict([{"inputs": TEXTS}])
    torch.testing.assert_close(torch.tensor(answer["embeddings"]), sentence_transformers_answer(directory),
                               atol=1e-5, rtol=1e-4)


def test_a_directory_without_modules_json_is_mean_pooled_and_normalised(tiny_bert_dir):
    assert pooling.read(tiny_bert_dir) == pooling.MEAN_NORMALIZED
    got, described = served(tiny_bert_dir)
    assert described["modes"] == ["mean"] and described["normalize"] is True and "no modules.json" in described["from"]
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(TEXTS)))


def write_modules(directory: Path, modules: list[dict], pooling_config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return directory


TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


@pytest.mark.parametrize(("modules", "config", "says"), [
    ([TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode": "mean"}, "lists sentence_transformers.models.Dense (2_Dense): pt2-handlers computes a "
                               "Transformer, Pooling and Normalize only"),
    ([TRANSFORMER], None, "lists 0 Pooling modules"),
    ([TRANSFORMER, POOLING], None, "which has no config.json"),
    ([TRANSFORMER, {"path": "../elsewhere", "type": "Pooling"}], None, "which has no config.json"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "median"}, "pooling_mode 'median' is not one of cls, max, mean"),
    ([TRANSFORMER, POOLING], ["mean"], "is not a JSON object"),
    ({"0": TRANSFORMER}, None, "is not a list of modules"),
])
def test_what_pooling_cannot_serve_as_sentence_transformers_would_is_refused(tmp_path, modules, config, says):
    with pytest.raises(ModelLoadError) as refused:
        pooling.read(write_modules(tmp_path / "model", modules, config))
    assert says in refused.value.message


def test_a_model_with_a_dense_module_fails_to_load_and_says_why(tiny_bert_dir, tmp_path):
    directory = shutil.copytree(tiny_bert_dir, tmp_path / "model")
    write_modules(directory, [TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
                  {"pooling_mode": "cls"})
    engine = make_engine(directory)
    with pytest.raises(ModelLoadError, match="Dense"):
        engine.load()
    assert "Dense" in engine.describe()["failure"]
