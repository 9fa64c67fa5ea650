"""Send every kind of bad request to a served pt2-handlers model and check that each one fails alone.

All the cases and a few good requests go out at the same moment, so TorchServe batches bad requests with good ones.
Each case must get its own 4xx status and a JSON error that names the problem. One exception: a body over the
server's ``max_request_size`` gets TorchServe's bare 413, because the frontend refuses it before any worker sees it.
An image classifier gets bad images instead (benchmarks/hostile_images.py): not an image, truncated, empty, not
base64, a decompression bomb; and odd modes (CMYK, 16-bit, palette, alpha, EXIF rotation) that must be answered.
Each good neighbour must get the answer it gets when sent alone, the worker must still be the same process, and a
good request afterwards must get the same answer as before.

  .venv/bin/python -m benchmarks.hostile_inputs --model minilm   # against the server scripts/start.sh started
  .venv/bin/python -m benchmarks.hostile_inputs --markdown       # docs/tasks/errors.md's table, from the cases below

The integration tests run ``check`` against every task's archive (tests/test_torchserve.py).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks import hostile_images
from handlers.serving import server as torchserve

DEFAULT_MAX_REQUEST_SIZE = 6553500  # TorchServe's, when config.properties does not set max_request_size
IMAGE_TASK = "image-classification"
GOOD_TEXTS = ("Where does the fox live?", "The weather in Paris is mild today.", "Once upon a time")
QA_CONTEXT = "The quick brown fox lives in Paris and jumps over the lazy dog every morning."


@dataclass(frozen=True)
class Case:
    kind: str
    body: bytes
    content_type: str | None
    status: int
    says: str | None  # a fragment of the JSON error's message; None: no JSON body (TorchServe's own 413)
    path: str = ""  # sent to /predictions/<model>/<version>/<path>; "": to /predictions/<model>

    def after_model(self, version: str) -> str:
        """What follows /predictions/<model> in this case's URL ("" for nothing)."""
        return f"{version}/{self.path}" if self.path else ""


Request = tuple[bytes, str | None, str]  # body, Content-Type, the path after /predictions/<model> ("" for none)
Answer = tuple[int | None, bytes]  # status (None: the connection failed), body


@dataclass(frozen=True)
class TaskInputs:
    """How one task reads text: the JSON body for one text, its key, and what its messages say."""

    good: Callable[[str], dict[str, Any]]
    key: str  # where the text goes
    empty: str  # what an empty body is told
    not_object: str  # what a JSON number is told
    inputs: str  # what {"inputs": []} is told
    own: tuple[tuple[str, dict[str, Any], str], ...]  # (kind, body, says): the task's own parameters


TASKS = {
    "embeddings": TaskInputs(
        good=lambda text: {"text": text}, key="text", empty="the text is empty",
        not_object="expected text or a JSON object, got JSON int", inputs='"inputs" must be a string or a non-empty',
        own=(("unsupported encoding_format", {"input": "hi", "encoding_format": "int8"},
              "encoding_format 'int8' is not supported"),)),
    "text-classification": TaskInputs(
        good=lambda text: {"text": text, "top_k": None}, key="text", empty="the text is empty",
        not_object="expected text or a JSON object, got JSON int", inputs='"inputs" must be a string or a non-empty',
        own=(("top_k not a number", {"text": "hi", "top_k": "two"}, '"top_k" must be a positive integer'),
             ("top_k out of range", {"text": "hi", "top_k": 0}, '"top_k" must be a positive integer'))),
    "token-classification": TaskInputs(
        good=lambda text: {"text": text}, key="text", empty="the text is empty",
        not_object="expected text or a JSON object, got JSON int", inputs='"inputs" must be a string or a non-empty',
        own=(("unknown aggregation_strategy", {"text": "hi", "aggregation_strategy": "loud"},
              '"aggregation_strategy" must be one of'),)),
    "question-answering": TaskInputs(
        good=lambda text: {"question": text, "context": QA_CONTEXT}, key="question",
        empty='send a JSON object with "question" and "context"',
        not_object='send a JSON object with "question" and "context"', inputs='"inputs" must be a non-empty list',
        own=(("question without context", {"question": "Who?"}, 'the request has no "context"'),
             ("top_k out of range", {"question": "Who?", "context": QA_CONTEXT, "top_k": -1},
              '"top_k" must be a positive integer'),
             ("doc_stride past the window", {"question": "Who?", "context": QA_CONTEXT, "doc_stride": 9999},
              '"doc_stride" 9999 must be smaller than the window'))),
    "text-generation": TaskInputs(
        good=lambda text: {"text": text, "max_new_tokens": 4}, key="text", empty="the prompt is empty",
        not_object="expected text or a JSON object, got JSON int", inputs='send the prompt as "text"',
        own=(("max_new_tokens not a number", {"text": "hi", "max_new_tokens": "ten"},
              '"max_new_tokens" must be a positive integer'),
             ("max_new_tokens infinite", {"text": "hi", "max_new_tokens": math.inf},
              '"max_new_tokens" must be a positive integer'),
             ("temperature NaN", {"text": "hi", "temperature": math.nan}, '"temperature" must be a number'),
             ("top_p out of range", {"text": "hi", "top_p": 2}, '"top_p" must be a number in (0, 1]'),
             ("stop not strings", {"text": "hi", "stop": [1, 2]}, '"stop" must be a string or a list'))),
}


def cases(task: str, inputs: dict[str, Any], max_request_size: int) -> list[Case]:
    """Every hostile case for ``task``, given its describe ``inputs`` (limits) and the server's request limit."""
    if task == IMAGE_TASK:
        return image_cases(inputs, max_request_size)
    spec = TASKS[task]
    max_length = inputs["max_length"]

    def as_json(kind: str, body: Any, status: int, says: str | None) -> Case:
        return Case(kind, json.dumps(body).encode(), "application/json", status, says)

    many = inputs.get("max_per_request")  # None: one text per request (generation)
    over = spec.good(" ".join(["word"] * (2 * max_length)))
    if task == "question-answering":  # a long context is read in windows; a question must fit one window
        too_long = (400, "the question is too long")
    else:  # the YAML's policy: truncate reads the first max_length tokens, reject refuses
        too_long = (200, None) if inputs["too_long"] == "truncate" else (400, f"at most {max_length}")
    result = [
        Case("empty body", b"", "application/json", 400, spec.empty),
        Case("whitespace only", b" \n\t  ", "text/plain", 400, spec.empty),
        Case("invalid UTF-8", b'{"text": "caf\xe9"}', "application/json", 400, "not valid UTF-8"),
        Case("malformed JSON", b'{"text": "unterminated', "application/json", 400, "does not parse"),
        Case("JSON null", b"null", "application/json", 400, "request body is empty"),
        Case("JSON of the wrong shape", b"42", "application/json", 400, spec.not_object),
        as_json("wrong type for the text", {**spec.good("x"), spec.key: 42}, 400, f'"{spec.key}" must be a'),
        as_json("nested object for the text", {**spec.good("x"), spec.key: {"text": "x"}}, 400,
                f'"{spec.key}" must be a'),
        as_json("empty list", {"inputs": []}, 400, spec.inputs),
        as_json("list over the per-request limit" if many else "a list of prompts",
                {"inputs": ["x"] * (many + 1)} if many else {"text": ["x", "y"]}, 400,
                f"at most {many} per request" if many else "one prompt per request"),
        as_json(f"text over {max_length} tokens", over, *too_long),
        Case("body over max_request_size", b'{"text": "' + b"x " * (max_request_size // 2 + 1) + b'"}',
             "application/json", 413, None),
        Case("form-encoded body", b"text=hello", "application/x-www-form-urlencoded", 400,
             "form-encoded bodies are not supported"),
        as_json("unknown field", {**spec.good("x"), "colour": "red"}, 400, "unknown key(s) colour"),
        Case("lone UTF-16 surrogate", f'{{"{spec.key}": "a\\ud800b"}}'.encode(), "application/json", 400,
             "lone surrogate"),
        Case("JSON nested 100,000 deep", b"[" * 100_000, "application/json", 400, "nested more than 32 levels"),
        as_json("Open Inference (v2): a tensor that is not BYTES",
                {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400,
                "this model reads text"),
        as_json("Open Inference (v2): shape and data disagree",
                {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a"]}]}, 400,
                "(3 elements) but 1"),
        as_json("odd but valid Unicode (NUL, zero-width, emoji, RTL, CJK)",
                spec.good("a\u0000b \u200b \U0001f600 \u05e9\u05dc\u05d5\u05dd \u4e2d\u6587"), 200, None),
        Case("a path under the model's URL it does not serve",
             json.dumps(spec.good("x")).encode(), "application/json", 404, "serves nothing at 'v1/chat/completions'",
             path="v1/chat/completions"),
    ]
    result += [as_json(kind, body, 400, says) for kind, body, says in spec.own]
    if task == "question-answering":  # the room a window leaves the context at or under the stride: a Rust panic once
        window = min(max_length, 384)
        stride = min(window // 2, 128)
        question = " ".join(["word"] * (window - 3 - stride // 2))  # [CLS] q [SEP] c [SEP]: stride / 2 left
        result.append(as_json("question leaving the context no more than the stride",
                              {"question": question, "context": " ".join(["word"] * 2 * window)}, 400,
                              "not more than the stride"))
    return result


def image_cases(inputs: dict[str, Any], max_request_size: int) -> list[Case]:
    """An image classifier's: bad images each a 400 naming the problem, odd modes and rotation answered."""
    bad = [Case(kind, body, content_type, status, says)
           for kind, body, content_type, status, says in hostile_images.bad(max_request_size,
                                                                            inputs["max_per_request"])]
    return bad + [Case(kind, body, content_type, 200, None) for kind, body, content_type in
                  hostile_images.odd_but_good()] + [
        Case("a path under the model's URL it does not serve", hostile_images.good_photos(1)[0], "image/jpeg", 404,
             "serves nothing at 'v1/chat/completions'", path="v1/chat/completions")]


def good_requests(task: str) -> list[Request]:
    """The good requests sent alone, then beside the cases (an image's top 1 only: a near tie further down may swap
    places when a half precision runs it in another batch)."""
    if task == IMAGE_TASK:
        return [(json.dumps({"data": base64.b64encode(photo).decode(), "top_k": 1}).encode(), "application/json", "")
                for photo in hostile_images.good_photos()]
    return [(json.dumps(TASKS[task].good(text)).encode(), "application/json", "") for text in GOOD_TEXTS]


@dataclass
class Outcome:
    case: Case
    status: int | None
    body: bytes
    problem: str | None = None  # None: as expected


EXPECT_CONTINUE_FROM = 1 << 20  # bodies from 1 MiB ask first, as curl does


def send(server: torchserve.Server, model: str, body: bytes, content_type: str | None, path: str = "") -> Answer:
    if len(body) >= EXPECT_CONTINUE_FROM:
        return send_expecting_continue(server, model, body, content_type)
    try:
        return server.call("POST", f"{server.inference_url}/predictions/{model}{'/' + path if path else ''}",
                           "inference", body, content_type, timeout=300)
    except OSError as exc:
        return None, str(exc).encode()


def send_expecting_continue(server: torchserve.Server, model: str, body: bytes, content_type: str | None) -> Answer:
    """POST with ``Expect: 100-continue``: the server may refuse the body (413) before it is sent. Without it,
    TorchServe answers 413 and resets the connection while the client is still sending, so the client sees only
    the reset."""
    url = urlsplit(server.inference_url)
    head = (f"POST /predictions/{model} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {server.key('inference')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    try:
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.sendall(head.encode())
            if sock.recv(32, socket.MSG_PEEK).split(b" ", 2)[1:2] == [b"100"]:
                interim = b""
                while not interim.endswith(b"\r\n\r\n"):
                    interim += sock.recv(1)
                sock.sendall(body)
            response = http.client.HTTPResponse(sock)
            response.begin()
            return response.status, response.read()
    except OSError as exc:
        return None, str(exc).encode()


def judge(case: Case, status: int | None, raw: bytes) -> str | None:
    """What is wrong with this answer to ``case``, or None."""
    if status != case.status:
        return f"status {status}, expected {case.status}: {raw[:200]!r}"
    if case.status == 200 or case.says is None:
        return None
    try:
        error = json.loads(raw)
    except ValueError:
        return f"not a JSON error: {raw[:200]!r}"
    message = error.get("message", error.get("error"))  # an Open Inference request's error says "error"
    if error.get("code") != case.status or case.says not in str(message):
        return f"expected a message with {case.says!r}, got {error}"
    return None


# How far a good request's floats may move when it is batched with others: fp32 kernels only reorder sums; a half
# precision (bf16/fp16) keeps 8-11 mantissa bits, and its kernels depend on the batch's shape, so "the same answer"
# means within the quality gate's own half-precision tolerance (max_score_error_half), not bit-equal.
TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2, "float16": 1e-2}


def close(a: Any, b: Any, tolerance: float = TOLERANCE["float32"]) -> bool:
    """Equal JSON, floats within ``tolerance`` (a request batched with others may differ in the last bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return a == b


def describe(server: torchserve.Server, model: str) -> dict[str, Any]:
    status, raw = server.management("GET", f"/models/{model}?customized=true")
    if status != 200:
        raise RuntimeError(f"describe {model}: {status} {raw[:200]!r}")
    return json.loads(raw)[0]


def at_once(server: torchserve.Server, model: str, requests: list[Request]) -> list[Answer]:
    """Send every request at the same moment (one thread each), so TorchServe batches them together."""
    barrier = threading.Barrier(len(requests))
    results: list[Answer] = [(None, b"")] * len(requests)

    def one(index: int) -> None:
        barrier.wait()
        results[index] = send(server, model, *requests[index])

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results


def check(server: torchserve.Server, model: str, max_request_size: int = DEFAULT_MAX_REQUEST_SIZE) -> dict[str, Any]:
    """Run every case against ``model`` with good neighbours. Returns the outcomes and the problems found
    (an empty ``problems`` list: the model passed)."""
    before = describe(server, model)
    meta = before["customizedMetadata"]
    task = meta["task"]
    goods = good_requests(task)
    alone = [send(server, model, *good) for good in goods]
    problems = [f"good request {i} alone: {status} {raw[:200]!r}" for i, (status, raw) in enumerate(alone)
                if status != 200]
    hostile = cases(task, meta["inputs"], max_request_size)
    version = before["modelVersion"]
    results = at_once(server, model, [(c.body, c.content_type, c.after_model(version)) for c in hostile] + goods)
    outcomes = [Outcome(case, status, raw, judge(case, status, raw))
                for case, (status, raw) in zip(hostile, results, strict=False)]
    problems += [f"{o.case.kind}: {o.problem}" for o in outcomes if o.problem]
    tolerance = TOLERANCE[meta["optimization"]["dtype"]]
    for index, ((status, raw), (_, want)) in enumerate(zip(results[len(hostile):], alone, strict=True)):
        if status != 200 or not close(json.loads(raw), json.loads(want), tolerance):
            problems.append(f"good neighbour {index}: {status} {raw[:200]!r} differs from its answer alone")
    status, raw = send(server, model, *goods[0])
    if status != 200 or not close(json.loads(raw), json.loads(alone[0][1]), tolerance):
        problems.append(f"the good request after the cases: {status} {raw[:200]!r}")
    after = describe(server, model)
    pids = [[w["pid"] for w in d["workers"]] for d in (before, after)]
    if pids[0] != pids[1] or {w["status"] for w in after["workers"]} != {"READY"}:
        problems.append(f"workers changed: {before['workers']} -> {after['workers']}")
    return {"task": task, "model": model, "outcomes": outcomes, "problems": problems}


def markdown(max_request_size: int = DEFAULT_MAX_REQUEST_SIZE) -> str:
    """docs/tasks/errors.md's table: one row per kind, the status and message fragment per task."""
    def limits(task: str) -> dict[str, Any]:  # as for the shipped configs, with a 256-token model
        return {"max_length": 256, "max_per_request": None if task == "text-generation" else 64,
                "too_long": "truncate" if task == "embeddings" else "reject"}

    per_task = {task: {c.kind: c for c in cases(task, limits(task), max_request_size)} for task in TASKS}
    kinds = list(dict.fromkeys(kind for table in per_task.values() for kind in table))
    lines = ["| kind | " + " | ".join(TASKS) + " |", "|---" * (len(TASKS) + 1) + "|"]
    for kind in kinds:
        cells = []
        for task in TASKS:
            case = per_task[task].get(kind)
            cells.append("" if case is None else str(case.status) if case.says is None else
                         f"{case.status} `{case.says}`")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile_inputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="a registered model (repeat for several)")
    parser.add_argument("--config", type=Path, default=torchserve.DEFAULT_CONFIG, help="the server's config.properties")
    parser.add_argument("--run-dir", type=Path, default=torchserve.DEFAULT_RUN_DIR, help="where its key_file.json is")
    parser.add_argument("--markdown", action="store_true", help="print the table of cases and exit")
    args = parser.parse_args()
    props = torchserve.read_properties(args.config)
    max_request_size = int(props.get("max_request_size", DEFAULT_MAX_REQUEST_SIZE))
    if args.markdown:
        print(markdown(max_request_size))
        return
    server = torchserve.server_for(args.config, args.run_dir.resolve())
    failed = False
    for model in args.model or ["minilm"]:
        report = check(server, model, max_request_size)
        print(f"== {model} ({report['task']}): {len(report['outcomes'])} hostile cases, batched with good requests")
        for outcome in report["outcomes"]:
            print(f"  {'ok  ' if outcome.problem is None else 'FAIL'} {outcome.status}  {outcome.case.kind}")
        for problem in report["problems"]:
            print(f"  PROBLEM: {problem}")
        failed |= bool(report["problems"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
