"""The shipped image classifier (MobileNetV2, ImageNet weights) through a real TorchServe on loopback, token auth on:
each way TorchServe's image_classifier is called (curl -T's raw bytes, a multipart field, base64 text, JSON, Open
Inference) answered alike, as the Engine answers; bad images a 400 naming the problem beside neighbours that are
answered in the same server-side batch; the worker up after all of them."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest

from handlers.serving import server as tsctl
from tests.conftest import port_shift
from tests.test_image_classification import photographs, synthetic

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
    photo, png = photographs()[1], synthetic(1)[0]
    bodies = [(photo, "image/jpeg"), (b"", "image/jpeg"), (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "image/png"),
              (png[: len(png) // 2], "image/png"), (b"plain words", "text/plain"), (photo, "image/jpeg"),
              (json.dumps({"data": "A" * 1000}).encode(), "application/json")]
    answers: dict[int, tuple[int, object]] = {}
    barrier = threading.Barrier(len(bodies))

    def send(index: int) -> None:
        barrier.wait()
        answers[index] = post(server, *bodies[index])

    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers[0][0] == 200 and answers[5][0] == 200 and answers[0][1] == answers[5][1], answers
    expected = {1: "empty", 2: "is not an image PIL can read", 3: "truncated or corrupt",
                4: "is text but not base64", 6: "is not an image PIL can read"}
    for index, words in expected.items():
        status, answer = answers[index]
        assert status == 400 and words in answer["message"], (index, answer)
    status, _ = post(server, photo, "image/jpeg")
    assert status == 200  # the worker is up


def test_a_decompression_bomb_is_refused_and_the_worker_stays_up(server):
    from tests.test_images import png_header_only

    status, answer = post(server, png_header_only(10_000, 10_000), "image/png")
    assert status == 400 and "100,000,000 pixels; at most 40,000,000" in answer["message"], answer
    assert post(server, photographs()[0], "image/jpeg")[0] == 200
