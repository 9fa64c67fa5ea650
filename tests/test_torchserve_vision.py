"""The shipped image classifier (MobileNetV2, ImageNet weights) through a real TorchServe on loopback, token auth on:
each way TorchServe's image_classifier is called (curl -T's raw bytes, a multipart field, base64 text, JSON, Open
Inference) answered alike, as the Engine answers; bad images a 400 naming the problem beside neighbours that are
answered in the same server-side batch; the worker up after all of them."""

from __future__ import annotations

import base64
import json
import time

import pytest

from handlers.serving import server as tsctl
from tests.conftest import port_shift
from tests.test_image_classification import photographs

pytestmark = [pytest.mark.integration, pytest.mark.openvino]

PORT_SHIFT = port_shift(13000)  # clear of the other test servers (+10000 ... +12000, +14000 ...)
MODEL = "mobilenet"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store):
    tmp = tmp_path_factory.mktemp("torchserve-vision")
    started = time.monotonic()
    server = tsctl.start(tsctl.shifted_config(tmp, PORT_SHIFT), model_store, [f"{MODEL}={MODEL}.mar"], tmp / "run",
                         timeout=900)
    print(f"TorchServe READY with {MODEL} in {time.monotonic() - started:.0f}s")
    yield server
    tsctl.stop(server.run_dir)


def post(server, body: bytes, content_type: str) -> tuple[int, object]:
    status, raw = server.call("POST", f"{server.inference_url}/predictions/{MODEL}", "inference", body, content_type)
    return status, json.loads(raw)


def put_as_curl_t(server, data: bytes) -> tuple[int, object]:
    """``curl -T photo.jpg URL``: a PUT of the file's bytes with no Content-Type (urllib would add a form's)."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(f"{server.inference_url}/predictions/{MODEL}")
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.putrequest("PUT", url.path)
        connection.putheader("Authorization", f"Bearer {server.key('inference')}")
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def multipart(field: str, data: bytes) -> tuple[bytes, str]:
    boundary = "pt2handlersboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"photo.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_every_way_to_send_an_image_gets_the_same_answer(server):
    photo = photographs()[0]
    text = base64.b64encode(photo).decode()
    status, want = post(server, photo, "image/jpeg")  # curl -T photo.jpg / --data-binary @photo.jpg
    assert status == 200 and list(want)[0] == "palace" and len(want) == 5, want
    answers = [
        put_as_curl_t(server, photo),
        post(server, photo, "application/octet-stream"),
        post(server, *multipart("data", photo)),  # curl -F data=@photo.jpg
        post(server, text.encode(), "text/plain"),
        post(server, json.dumps({"data": text}).encode(), "application/json"),
    ]
    for status, answer in answers:
        assert status == 200 and answer == pytest.approx(want, abs=1e-5), answer
    status, v2 = server.call("POST", f"{server.inference_url}/v2/models/{MODEL}/infer", "inference", json.dumps(
        {"inputs": [{"name": "images", "shape": [1], "datatype": "BYTES", "data": [text]}]}).encode(),
        "application/json")
    outputs = {output["name"]: output for output in json.loads(v2)["outputs"]}
    assert status == 200 and outputs["label"]["data"] == list(want), v2
    status, described = server.management("GET", f"/models/{MODEL}?customized=true")
    optimization = json.loads(described)[0]["customizedMetadata"]["optimization"]
    assert status == 200 and optimization["active"] == "openvino", optimization["attempts"]


def test_bad_images_get_a_400_naming_the_problem_and_their_batch_neighbours_are_answered(server):
    """benchmarks/hostile_inputs.py's image cases (not an image, truncated, empty, not base64, a decompression bomb,
    too many images, a body over the limit; odd modes and EXIF rotation answered), sent at once with good photos so
    TorchServe batches them together: each bad one its 4xx naming the problem, each good one its answer alone, the
    worker the same process."""
    from benchmarks import hostile_inputs

    max_request_size = int(tsctl.read_properties(server.run_dir.parent / "config.properties")["max_request_size"])
    report = hostile_inputs.check(server, MODEL, max_request_size)
    outcomes = {outcome.case.kind: outcome for outcome in report["outcomes"]}
    print(f"{MODEL}: {len(outcomes)} kinds of hostile request: {list(outcomes)}")
    assert not report["problems"], "\n".join(report["problems"])
    assert outcomes["decompression bomb (header of 10000x10000)"].status == 400
    assert outcomes["CMYK JPEG"].status == 200 and outcomes["EXIF-rotated JPEG"].status == 200
    assert {o.status for o in report["outcomes"]} == {200, 400, 404, 413}


def test_a_short_soak_of_photographs_and_bad_images_answers_each_as_eager_does(server, model_store):
    """benchmarks/soak.py, shortened: photographs of mixed sizes at concurrency 16, 1 in 8 a bad image; the sampled
    answers against fp32 eager, the worker the same process."""
    from benchmarks import soak

    report = soak.soak(server, MODEL, model_store / f"{MODEL}.mar", requests=240, concurrency=16, bad_every=8,
                       sample_every=6, warmup=32, max_rss_growth=0.25)
    print({key: value for key, value in report.items() if key != "samples"})
    assert not report["problems"], report["problems"]
    assert report["bad"] == 30 and report["answers_checked"] >= 30
