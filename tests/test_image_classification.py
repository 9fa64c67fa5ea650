"""image-classification through the Engine: TorchServe's image_classifier contract (raw bytes, base64, {"data"}, a
list of images, a preprocessed tensor, Open Inference BYTES / UINT8 pixels / FP32) answered as {label: probability};
MobileNetV2 with torchvision's ImageNet weights equal to eager fp32 on real photographs and synthetic images; a zoo of
Hugging Face architectures each equal to transformers eager with its image processor, each on an optimized rung or on
a lower one with the reason; bad images refused alone, their neighbours answered. Through TorchServe in
test_torchserve.py."""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.hostile_images import encoded
from handlers.config import load_config
from handlers.config.image import ImageSpec
from handlers.errors import HandlerError
from handlers.models.files import ModelFiles
from handlers.serving.engine import Engine
from handlers.tasks import images
from tests import vision_models

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "examples" / "mobilenet_v2"
SHIPPED = REPO / "model_configs" / "mobilenet-image-classification.yaml"
PHOTOS = sorted((Path(__import__("sklearn").__file__).parent / "datasets" / "images").glob("*.jpg"))  # china, flower
STATE_DICT = ModelFiles("model.py", "model.pth")


def engine(root: Path, settings: dict, files: ModelFiles | None = None, shipped: bool = False) -> Engine:
    raw = copy.deepcopy(yaml.safe_load(SHIPPED.read_text())) if shipped else {"pt2": {"compile": {"enable": True}}}
    raw.setdefault("pt2_handlers", {}).update({"task": "image-classification", **settings})
    torch._dynamo.reset()  # one worker serves one model: each load here starts as a worker does
    loaded = Engine(load_config(raw), root, torch.device("cpu"), "classifier", files=files or ModelFiles())
    loaded.load()
    return loaded


@pytest.fixture(scope="module")
def mobilenet_root(tmp_path_factory, mobilenet_weights) -> Path:
    """An unpacked archive as the shipped YAML's command packs it: model.py, the state_dict, index_to_name.json."""
    root = tmp_path_factory.mktemp("mobilenet")
    for name in ("model.py", "index_to_name.json"):
        shutil.copy(EXAMPLE / name, root / name)
    shutil.copy(mobilenet_weights, root / "model.pth")
    return root


@pytest.fixture(scope="module")
def mobilenet_eager(mobilenet_root):
    from handlers.models.state_dict import load_module

    model = load_module(mobilenet_root, STATE_DICT, torch.device("cpu"))
    return lambda pixels: model(pixels).softmax(dim=-1)


def photographs() -> list[bytes]:
    return [path.read_bytes() for path in PHOTOS]


def synthetic(count: int, seed: int = 7) -> list[bytes]:
    return [encoded(image, "PNG") for image in images.synthetic_images(count, seed)]


@pytest.fixture(scope="module")
def served_mobilenet(mobilenet_root):
    """The shipped YAML, whose first rung is openvino: the tests that take it are marked openvino, since without
    OpenVINO (the ipex profile) the worker would compile MobileNetV2 for two minutes to test what torch's version
    does not change (the request forms)."""
    return engine(mobilenet_root, {}, STATE_DICT, shipped=True)


@pytest.mark.openvino
def test_mobilenet_v2_with_imagenet_weights_serves_real_photographs_as_eager_fp32_does(served_mobilenet,
                                                                                     mobilenet_eager):
    optimization = served_mobilenet.describe()["optimization"]
    assert optimization["active"] == "openvino", optimization["attempts"]  # the shipped YAML: openvino first
    spec = served_mobilenet.task.spec
    pictures = photographs() + synthetic(3)
    assert len(PHOTOS) == 2, PHOTOS
    answers = served_mobilenet.predict(pictures)
    with torch.no_grad():
        want = mobilenet_eager(torch.stack([images.to_pixels(images.open_image(p, 10**8), spec) for p in pictures]))
    labels = served_mobilenet.task.labels
    bound = 1e-3 if optimization["dtype"] == "float32" else 0.2
    for answer, row in zip(answers, want, strict=True):
        assert len(answer) == 5
        top = row.topk(5)
        assert list(answer)[0] == labels[top.indices[0]], (answer, top)  # the most likely label, identical
        assert len(set(answer) & {labels[i] for i in top.indices.tolist()}) >= 4
        for label, probability in answer.items():
            assert probability == pytest.approx(row[labels.index(label)].item(), abs=bound)
    assert list(answers[0])[0] == "palace" and list(answers[1])[0] in ("daisy", "honeycomb", "mushroom"), answers[:2]


def test_mobilenet_v2_in_float32_answers_within_a_thousandth_of_eager(mobilenet_root, mobilenet_eager):
    served = engine(mobilenet_root, {"dtype": "float32", "ladder": ["openvino", "eager"], "pick": "first",
                                     "shapes": {"batch_sizes": [1, 4]}}, STATE_DICT)
    pictures = photographs()
    with torch.no_grad():
        want = mobilenet_eager(torch.stack([images.to_pixels(images.open_image(p, 10**8), ImageSpecDefault)
                                            for p in pictures]))
    for answer, row in zip(served.predict(pictures), want, strict=True):
        for label, probability in answer.items():
            assert probability == pytest.approx(row[served.task.labels.index(label)].item(), abs=1e-3)


ImageSpecDefault = ImageSpec()


@pytest.mark.openvino
def test_every_request_form_of_torchserves_image_classifier_and_open_inference(served_mobilenet):
    photo = photographs()[0]
    text = base64.b64encode(photo).decode()
    want = served_mobilenet.predict([photo])[0]
    pixels = images.to_pixels(images.open_image(photo, 10**8), served_mobilenet.task.spec)
    array = torch.from_numpy(__import__("numpy").asarray(images.open_image(photo, 10**8)).copy())
    bodies = [
        text,  # base64 text
        {"data": text},
        {"data": f"data:image/jpeg;base64,{text}", "top_k": 2},
        {"data": [text, text]},
        pixels.tolist(),  # preprocessed, as TorchServe's handler reads a JSON list
        {"inputs": [{"name": "images", "shape": [1], "datatype": "BYTES", "data": [text]}],
         "parameters": {"top_k": 3}},
        {"inputs": [{"name": "pixels", "shape": list(array.shape), "datatype": "UINT8",
                     "data": array.flatten().tolist()}]},
        {"inputs": [{"name": "pixel_values", "shape": [1, 3, 224, 224], "datatype": "FP32",
                     "data": pixels.flatten().tolist()}]},
    ]
    answers = served_mobilenet.predict(bodies)
    close = 1e-4
    assert answers[0] == pytest.approx(want, abs=close) and answers[1] == pytest.approx(want, abs=close)
    assert list(answers[2]) == list(want)[:2]
    assert len(answers[3]) == 2 and all(row == pytest.approx(want, abs=close) for row in answers[3])
    assert answers[4] == pytest.approx(want, abs=close)
    v2 = answers[5]
    assert [o["name"] for o in v2["outputs"]] == ["label", "score"] and v2["outputs"][0]["shape"] == [1, 3]
    assert v2["outputs"][0]["data"] == list(want)[:3]
    assert answers[6]["outputs"][0]["data"] == list(want)  # raw pixels: resized and cropped as the image
    assert answers[7]["outputs"][0]["data"] == list(want)


@pytest.mark.openvino
def test_bad_images_are_refused_alone_and_their_neighbours_answered(served_mobilenet):
    photo = photographs()[0]
    png = synthetic(1)[0]
    bodies = [photo, b"", b"GIF89a" + b"\0" * 10, png[: len(png) // 3], {"data": "!!!"}, {"image": "x"},
              {"data": base64.b64encode(photo).decode(), "top_k": 0}, [[1.0, 2.0]],
              {"inputs": [{"name": "x", "shape": [2], "datatype": "INT64", "data": [1, 2]}]}, photo]
    answers = served_mobilenet.predict(bodies)
    assert isinstance(answers[0], dict) and answers[0] == answers[-1]
    messages = [str(answer) for answer in answers[1:-1]]
    assert all(isinstance(answer, HandlerError) and answer.status == 400 for answer in answers[1:-1]), answers
    for message, expected in zip(messages, ["the image is empty", "is not an image PIL can read",
                                            "truncated or corrupt", "is text but not base64", "unknown key(s): image",
                                            '"top_k" must be a positive integer', "a preprocessed image has shape",
                                            "send BYTES (base64 images), UINT8"], strict=True):
        assert expected in message, (expected, message)


def hugging_face_answers(model_dir: Path, pictures: list[bytes]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForImageClassification.from_pretrained(model_dir).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    decoded = [images.open_image(p, 10**8) for p in pictures]
    with torch.no_grad():
        return model(**processor(images=decoded, return_tensors="pt")).logits.softmax(dim=-1)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.openvino
@pytest.mark.parametrize("name", vision_models.NAMES)
def test_each_hugging_face_architecture_serves_equal_to_transformers_eager(zoo, name):
    """Random weights, so fp32: every architecture on the openvino rung, or on eager with the converter's reason."""
    model_dir = vision_models.build(name, zoo)
    served = engine(zoo, {"model_dir": model_dir.name, "dtype": "float32", "ladder": ["openvino", "eager"],
                          "shapes": {"batch_sizes": [1, 4]}})
    optimization = served.describe()["optimization"]
    attempts = {attempt["rung"]: attempt for attempt in optimization["attempts"]}
    assert optimization["active"] == "openvino" or attempts["openvino"]["reason"], attempts
    print(f"{name}: {optimization['active']} {attempts['openvino']['status']} {attempts['openvino'].get('reason')}")
    pictures = photographs() + synthetic(2)
    want = hugging_face_answers(model_dir, pictures)
    for answer, row in zip(served.predict(pictures), want, strict=True):
        assert list(answer) == [f"class_{i}" for i in row.topk(5).indices.tolist()], (answer, row)
        assert list(answer.values()) == pytest.approx(row.topk(5).values.tolist(), abs=1e-3)


def test_a_hugging_face_classifier_compiles_and_one_dynamo_cannot_trace_lands_on_eager_with_the_reason(zoo):
    model_dir = vision_models.build("resnet", zoo)
    compiled = engine(zoo, {"model_dir": model_dir.name, "dtype": "float32", "ladder": ["compile", "eager"],
                            "shapes": {"batch_sizes": [1, 4]}})
    assert compiled.active_rung == "compile", compiled.describe()["optimization"]["attempts"]
    pictures = photographs()
    want = hugging_face_answers(model_dir, pictures)
    for answer, row in zip(compiled.predict(pictures), want, strict=True):
        assert list(answer.values()) == pytest.approx(row.topk(5).values.tolist(), abs=1e-3)
    root = zoo / "untraceable"
    root.mkdir(exist_ok=True)
    shutil.copy(REPO / "tests" / "models" / "untraceable_classifier.py", root / "model.py")
    torch.manual_seed(0)
    from tests.models.untraceable_classifier import UntraceableClassifier

    torch.save(UntraceableClassifier().state_dict(), root / "model.pth")
    fallen = engine(root, {"dtype": "float32", "ladder": ["compile", "eager"], "shapes": {"batch_sizes": [1, 2]}},
                    STATE_DICT)
    attempts = {attempt["rung"]: attempt for attempt in fallen.describe()["optimization"]["attempts"]}
    assert fallen.active_rung == "eager" and attempts["compile"]["status"] == "failed", attempts
    assert attempts["compile"]["reason"], attempts["compile"]
    answer = fallen.predict([photographs()[0]])[0]
    assert list(answer) and all(label.isdigit() for label in answer)  # no index_to_name.json: class indexes
