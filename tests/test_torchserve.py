"""End to end against a real TorchServe on loopback, with token auth on: package -> start -> READY ->
predictions (with the key; refused without) -> equal to sentence-transformers -> concurrent requests
batched -> describe -> scale to 2 workers -> a model whose compile fails still serves -> unregister."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from handlers.config import DType
from handlers.cpu import features
from handlers.precision import choice, quantize
from handlers.rungs.ipex import probe_ipex
from handlers.serving import server as tsctl
from handlers.serving import server_timing
from tests.conftest import SHARED_STORE_ENV, port_shift
from tests.test_int8 import assert_raced
from tests.test_precision import auto_served

REPO = Path(__file__).resolve().parent.parent

# The default profile only (tests/conftest.py): TorchServe and adapter behaviour, which torch's version does not change.
# The ipex profile serves real archives through TorchServe in tests/test_faults.py, tests/test_import_time.py and
# tests/test_production.py, and proves each task compiled in process (tests/test_<task>.py).
pytestmark = [pytest.mark.integration, pytest.mark.default_profile]

PORT_SHIFT = port_shift(10000)  # the shipped ports + 10000, so a server started by scripts/start.sh can keep running
TEXTS = [f"sentence number {i} about {topic}" for i, topic in
         enumerate(["serving", "compilers", "cats", "the weather", "trains", "music", "databases", "tea"])]


def shifted_config_path(server) -> Path:
    return server.run_dir.parent / "config.properties"


def shifted_config(tmp: Path) -> Path:
    return tsctl.shifted_config(tmp, PORT_SHIFT)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store):
    tmp = tmp_path_factory.mktemp("torchserve")
    run_dir = tmp / "run"
    started = time.monotonic()
    server = tsctl.start(shifted_config(tmp), model_store, ["minilm=minilm.mar"], run_dir, timeout=900)
    print(f"TorchServe READY in {time.monotonic() - started:.0f}s")
    yield server
    stop_and_check_no_key_leaked(server)


def stop_and_check_no_key_leaked(server) -> None:
    """Stop the server, then look for its keys in everything it logged."""
    keys = [server.key(kind) for kind in ("inference", "management")]
    tsctl.stop(server.run_dir)
    # logs/ and the server's output only: run/tmp holds worker scratch files that may vanish mid-scan.
    logs = [*(server.run_dir / "logs").rglob("*.log"), server.run_dir / "torchserve.out"]
    leaked = [str(path) for path in logs if path.is_file() and any(key in path.read_text(errors="replace")
                                                                   for key in keys)]
    assert not leaked, f"a token appears in {leaked}"


def predict(server, body, content_type="application/json", model="minilm", key="inference"):
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    status, raw = server.call("POST", f"{server.inference_url}/predictions/{model}", key, body, content_type)
    return status, json.loads(raw) if raw else None


def describe(server, model="minilm", customized=True):
    """``customized`` asks a worker for our metadata; TorchServe answers 507 if that worker dies meanwhile,
    so a poll of the worker list while workers are killed asks without it."""
    status, raw = server.management("GET", f"/models/{model}" + ("?customized=true" if customized else ""))
    assert status == 200, raw
    return json.loads(raw)[0]


def assert_close_embeddings(got, want, min_cosine=0.999):
    """The quality gate's bar for bf16 (dtype auto on this CPU): cosine per row against fp32."""
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=-1)
    assert cosine.min().item() >= min_cosine, cosine


def test_package_refuses_a_name_that_torchserve_routes_to_its_token_api(tmp_path, minilm_dir):
    from handlers.serving import archive as package

    with pytest.raises(SystemExit, match="routes every URL containing '/token' to its token API"):
        package.build("token-classification", minilm_dir, REPO / "model_configs" / "minilm-embeddings.yaml", tmp_path)
    assert not list(tmp_path.iterdir())


def test_package_stores_the_weights_unless_asked_to_deflate_them(tmp_path, tiny_bert_dir):
    """A .mar whose files are stored (safetensors weights barely compress, and deflating them is most of a build);
    ``--archive-format default`` deflates, as torch-model-archiver does by default."""
    import zipfile

    from handlers.serving import archive as package

    config = REPO / "model_configs" / "minilm-embeddings.yaml"
    for archive_format, compression in (("zip-store", zipfile.ZIP_STORED), ("default", zipfile.ZIP_DEFLATED)):
        command = [sys.executable, "-m", "handlers", "package", "--name", "tiny", "--model-dir",
                   str(tiny_bert_dir), "--config", str(config), "--export-path", str(tmp_path / archive_format)]
        if archive_format != package.DEFAULT_FORMAT:
            command += ["--archive-format", archive_format]
        subprocess.run(command, check=True, capture_output=True, timeout=300, cwd=REPO)
        with zipfile.ZipFile(tmp_path / archive_format / "tiny.mar") as mar:
            weights = mar.getinfo("model/model.safetensors")
            assert weights.compress_type == compression, (archive_format, weights)
            assert {"torchserve_handler.py", "handlers/serving/engine.py",
                    "MAR-INF/MANIFEST.json"} <= set(mar.namelist())


def test_package_refuses_a_model_with_only_pickled_weights(tmp_path, tiny_bert_dir):
    import shutil

    from handlers.serving import archive as package

    model = tmp_path / "pickled"
    shutil.copytree(tiny_bert_dir, model)
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(SystemExit, match=r"has no \.safetensors weights \(only pickled pytorch_model\.bin\); "
                                         "pt2-handlers loads safetensors only"):
        package.build("pickled", model, REPO / "model_configs" / "minilm-embeddings.yaml", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_package_refuses_an_embeddings_model_with_a_module_the_worker_would_not_compute(tmp_path, tiny_bert_dir):
    import shutil

    from handlers.serving import archive as package

    model = shutil.copytree(tiny_bert_dir, tmp_path / "dense")
    (model / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(SystemExit, match=r"lists sentence_transformers\.models\.Dense \(2_Dense\): pt2-handlers "
                                         "computes a Transformer, Pooling and Normalize only"):
        package.build("dense", model, REPO / "model_configs" / "minilm-embeddings.yaml", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_package_refuses_a_model_yaml_the_worker_would_reject(tmp_path, minilm_dir):
    from handlers.serving import archive as package

    config = tmp_path / "typo.yaml"
    config.write_text("pt2:\n  compile:\n    enable: true\n    mdoe: reduce-overhead\n")
    with pytest.raises(SystemExit, match=r"unknown key\(s\) mdoe \(did you mean mode\?\)"):
        package.build("typo", minilm_dir, config, tmp_path / "store")
    assert not (tmp_path / "store" / "typo.mar").exists()
    checked = subprocess.run([sys.executable, "-m", "handlers", "check", str(config),
                              str(REPO / "model_configs" / "tiny-llama-generation.yaml")],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 1, checked.stderr
    assert "typo.yaml: INVALID: pt2.compile: unknown key(s) mdoe (did you mean mode?)" in checked.stdout
    assert "tiny-llama-generation.yaml: ok: task text-generation" in checked.stdout


def test_archive_is_self_contained(model_store):
    if os.environ.get(SHARED_STORE_ENV):
        shared = Path(os.environ[SHARED_STORE_ENV]) / "minilm.mar"
        digest = hashlib.sha256(shared.read_bytes()).hexdigest()
        print(f"serving the shared archive {shared} (sha256 {digest[:16]}) with torch {torch.__version__}")
        assert hashlib.sha256((model_store / "minilm.mar").read_bytes()).hexdigest() == digest
    with zipfile.ZipFile(model_store / "minilm.mar") as archive:
        names = set(archive.namelist())
    assert {"torchserve_handler.py", "handlers/serving/engine.py", "handlers/tasks/embeddings.py",
            "model/model.safetensors", "model/tokenizer.json", "minilm-embeddings.yaml"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)
    env = tsctl.server_env(model_store)
    probe = subprocess.run([sys.executable, "-c", "import handlers"], cwd=model_store, env=env, capture_output=True)
    assert probe.returncode != 0, "pt2-handlers is installed in this venv; the archive test would prove nothing"


def test_predictions_need_the_token(server):
    status, body = predict(server, {"text": "hello"}, key=None)
    assert status in (400, 401) and "Token Authorization failed" in body["message"]
    req_status, _ = server.call("POST", f"{server.inference_url}/predictions/minilm", "management",
                                b'{"text": "hello"}', "application/json")
    assert req_status in (400, 401), "the management key must not open the inference API"
    status, body = predict(server, {"text": "hello"})
    assert status == 200 and len(body["embedding"]) == 384


def timed_post(server, body: bytes, model: str = "minilm") -> tuple[int, str | None, float]:
    """(status, the Server-Timing header, the milliseconds the client waited) for one request."""
    started = time.perf_counter()
    status, _, headers = server.exchange("POST", f"{server.inference_url}/predictions/{model}", "inference", body,
                                         "application/json")
    return status, headers.get(server_timing.NAME), (time.perf_counter() - started) * 1000


def test_every_answer_carries_its_batchs_server_timing(server):
    """handlers/serving/server_timing.py through TorchServe: a lone request's stages in the order run, the handler's
    whole call (the stages within it, itself within what the client waited), its batch of one; a body that is not JSON
    stops after parsing, refused with the stages it went through."""
    status, value, waited = timed_post(server, b'{"text": "hello world"}')
    timing = server_timing.durations(value or "")
    assert status == 200 and list(timing) == ["parse", "preprocess", "cores", "forward", "postprocess", "handler"], \
        value
    assert value.endswith(", batch;desc=1"), value
    stages = sum(ms for name, ms in timing.items() if name != "handler")
    assert 0 < timing["forward"] <= stages <= timing["handler"] + 0.005 < waited, (value, waited)
    status, value, waited = timed_post(server, b'{"text": ')
    timing = server_timing.durations(value or "")
    assert status == 400 and "forward" not in timing and 0 < timing["parse"] <= timing["handler"] < waited, value


def test_embeddings_equal_sentence_transformers(server, reference):
    want = reference(TEXTS[:3])
    status, raw_text = predict(server, TEXTS[0], content_type="text/plain")
    assert status == 200
    assert_close_embeddings(raw_text["embedding"], want[0])
    _, octets = predict(server, TEXTS[0], content_type="application/octet-stream")
    assert_close_embeddings(octets["embedding"], want[0])
    _, single = predict(server, {"text": TEXTS[1]})
    assert_close_embeddings(single["embedding"], want[1])
    _, many = predict(server, {"inputs": TEXTS[:3]})
    assert_close_embeddings(many["embeddings"], want)
    _, openai = predict(server, {"input": TEXTS[:3], "model": "minilm"})
    assert [d["index"] for d in openai["data"]] == [0, 1, 2] and openai["model"] == "minilm"
    assert_close_embeddings([d["embedding"] for d in openai["data"]], want)


@pytest.mark.default_profile  # the openai extra is installed in the default profile
def test_the_openai_sdk_embeds_through_torchserve_with_the_inference_key(server, reference):
    """OpenAI's own Python SDK pointed at /predictions/<model>/<version>/v1, the inference key as its api_key: its
    default request (encoding_format "base64", which the SDK decodes) and "float" both answer sentence-transformers'
    embeddings; the management key is refused; a path the model does not serve is a 404 that says where to send."""
    import openai

    version = describe(server, customized=False)["modelVersion"]
    base_url = f"{server.inference_url}/predictions/minilm/{version}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=server.key("inference"), max_retries=0, timeout=120)
    want = reference(TEXTS[:3])
    default = client.embeddings.create(model="minilm", input=TEXTS[:3])
    floats = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="float")
    for answer in (default, floats):
        assert [item.index for item in answer.data] == [0, 1, 2] and answer.model == "minilm", answer
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > 3
        assert_close_embeddings([item.embedding for item in answer.data], want)
    torch.testing.assert_close(torch.tensor([item.embedding for item in default.data]),
                               torch.tensor([item.embedding for item in floats.data]), atol=1e-5, rtol=0)
    management = openai.OpenAI(base_url=base_url, api_key=server.key("management"), max_retries=0, timeout=120)
    with pytest.raises((openai.AuthenticationError, openai.BadRequestError)) as refused:
        management.embeddings.create(model="minilm", input="hello")
    assert "Token Authorization failed" in str(refused.value)
    with pytest.raises(openai.NotFoundError) as elsewhere:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hello"}])
    assert f"serves nothing at 'v1/chat/completions' after its version; send to /predictions/minilm[/<version>] or " \
           f"/predictions/minilm/{version}/v1/embeddings" in str(elsewhere.value), elsewhere.value


def concurrently(server, bodies: list, model: str = "minilm") -> list[tuple[int, object]]:
    """(status, answer) per body, all sent at once so that TorchServe batches them server-side."""
    barrier = threading.Barrier(len(bodies))
    answers: dict[int, tuple[int, object]] = {}

    def send(index):
        barrier.wait()
        answers[index] = predict(server, bodies[index], model=model)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(answers) == list(range(len(bodies)))
    return [answers[index] for index in range(len(bodies))]


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, reference):
    answers = concurrently(server, [{"text": text} for text in TEXTS])
    want = reference(TEXTS)
    for index, (status, answer) in enumerate(answers):
        assert status == 200
        assert_close_embeddings(answer["embedding"], want[index])
    batches = describe(server)["customizedMetadata"]["batches"]
    assert batches["max_requests"] > 1, f"no server-side batching happened: {batches}"


def test_describe_shows_the_ladder_and_the_fast_path(server):
    meta = describe(server)["customizedMetadata"]
    optimization = meta["optimization"]
    assert optimization["active"] in RACING  # openvino and compile race at load: the faster serves
    # dtype auto: whatever this CPU resolves it to (tests/test_config.py covers both kinds with injected flags),
    # MiniLM's embeddings keep the gate in the fastest precision, so the served rung runs in it.
    plan = [p.value for p in choice.resolve_precisions((DType.AUTO,), torch.device("cpu")).value]
    assert optimization["precisions"]["tried_in_order"] == plan
    served = auto_served(optimization, plan)  # bf16 where it is faster than fp32 here
    accepted = accepted_attempt(optimization)
    assert (accepted["rung"], accepted["dtype"]) == (optimization["active"], served) and accepted["seconds"] > 0
    assert optimization["device"] == "cpu" and optimization["dtype"] == served
    gate = accepted["quality"]
    assert gate["metric"] == "min_cosine" and gate["value"] >= gate["threshold"] == (
        0.9999 if served == "float32" else 0.999)
    assert optimization["threads"]["intra_op"] >= 1 and "minWorkers" in optimization["threads"]["reason"]
    assert optimization["notes"] == ["mode reduce-overhead: no CUDA graphs on cpu; inductor compiles without them"]
    assert optimization["shapes"]["policy"] == "dynamic"
    assert "warning" not in optimization["compile_cache"]  # TorchServe drops null fields
    assert optimization["torch"] == torch.__version__
    assert meta["state"] == "ready"


def varied_traffic(server, model, reference):
    """Batch sizes 1..8 (concurrent requests batched server-side, and multi-text requests chunked) and
    lengths from 3 to 256 tokens; every answer checked against sentence-transformers."""
    texts = [" ".join(["word"] * n) for n in (1, 5, 14, 30, 31, 60, 100, 200, 254, 400)]
    want = reference(texts)
    for rows in range(1, 9):
        status, answer = predict(server, {"inputs": texts[:rows]}, model=model)
        assert status == 200, answer
        assert_close_embeddings(answer["embeddings"], want[:rows])
    answers: dict[int, tuple[int, dict]] = {}
    barrier = threading.Barrier(len(texts))

    def send(index):
        barrier.wait()
        answers[index] = predict(server, {"text": texts[index]}, model=model)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, (status, answer) in answers.items():
        assert status == 200, answer
        assert_close_embeddings(answer["embedding"], want[index])
    assert len(answers) == len(texts)


def test_varied_shapes_are_served_compiled_without_compiling_after_ready(server, reference):
    varied_traffic(server, "minilm", reference)
    runtime = describe(server)["customizedMetadata"]["optimization"]["runtime"]
    assert (runtime["compiles_after_ready"], runtime["eager_batches"], runtime["runtime_failures"]) == (0, 0, 0)


@pytest.mark.default_profile  # the shape policy and the cache fallback are ours; both profiles prove them in-process
# (in the ipex stage it made that stage the last to end on an AVX2-only EPYC)
def test_static_buckets_and_an_unusable_compile_cache(server, reference):
    status, body = server.management("POST", "/models?url=minilm-buckets.mar&initial_workers=1&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    optimization = describe(server, "minilm-buckets")["customizedMetadata"]["optimization"]
    assert optimization["compile_cache"]["source"] == "private fallback"
    assert "/proc/pt2-handlers-cannot-create-this is unusable" in optimization["compile_cache"]["warning"]
    assert optimization["active"] == "compile" and optimization["shapes"]["seq_lengths"] == [32, 256]
    varied_traffic(server, "minilm-buckets", reference)  # after_ready: fail would turn any unwarmed shape into a 500
    runtime = describe(server, "minilm-buckets")["customizedMetadata"]["optimization"]["runtime"]
    assert (runtime["compiles_after_ready"], runtime["eager_batches"], runtime["runtime_failures"]) == (0, 0, 0)
    assert server.management("DELETE", "/models/minilm-buckets")[0] == 200


def manage(server, *args: str, config: Path | None = None) -> str:
    """``python -m handlers`` against this server (started with ``config``, else this module's), as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "handlers", "--config",
                           str(config or shifted_config_path(server)), "--run-dir", str(server.run_dir), *args],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def trickle(server, client: int, phase: list[str], stop: threading.Event, results: list) -> None:
    """Embed one of TEXTS[:4] after another until ``stop``, appending (phase it started and ended in, or "down",
    text index, status, answer) to ``results``."""
    while not stop.is_set():
        index, started_in = (client + len(results)) % 4, phase[0]
        try:
            status, raw = server.call("POST", f"{server.inference_url}/predictions/minilm", "inference",
                                      json.dumps({"text": TEXTS[index]}).encode(), "application/json", timeout=30)
            answer = json.loads(raw)
        except TimeoutError:  # a request TorchServe lost with the worker it removed: no answer, never a wrong one
            status, answer = None, "no answer in 30 s"
        results.append((started_in if started_in == phase[0] else "down", index, status, answer))
        time.sleep(0.05)


@pytest.mark.default_profile  # TorchServe's scaling and the core share: no torch-version dependence (under torch 2.8
# its new workers load twice as long: 142 s against 63-73, so it stays in the default stage)
def test_the_cli_scales_1_3_1_under_a_trickle_and_new_workers_load_from_the_compile_cache(server, reference):
    """python -m handlers scale scales minilm to 3 workers and back while clients keep sending. Scaling up fails no
    request; each new worker proves its rung (the model log's READY line per worker) and loads its graphs from the
    compile cache (hits, no misses). Scaling down: TorchServe 0.12 disconnects a removed worker at once, even
    mid-batch (pytorch/serve#1101), so a request in flight there may get its 500 "Worker died.", or no answer at
    all (seen once in about ten runs: the client times out) - never a wrong answer - and the requests after it
    succeed."""
    want = reference(TEXTS[:4])
    first = {w["id"] for w in describe(server)["workers"]}
    log = server.run_dir / "logs" / "model_log.log"
    offset = log.stat().st_size
    results: list[tuple[str, int, int, object]] = []  # phase, text index, status, answer
    phase = ["up"]
    stop = threading.Event()

    threads = [threading.Thread(target=trickle, args=(server, client, phase, stop, results)) for client in range(2)]
    for thread in threads:
        thread.start()
    try:
        manage(server, "scale", "minilm", "--min", "3", "--max", "3", "--wait")
        workers = describe(server)["workers"]
        assert len(workers) == 3 and {w["status"] for w in workers} == {"READY"}, workers
        shown = manage(server, "describe", "minilm")
        ready_workers = re.findall(r"worker \d+: pid \d+ READY$", shown, re.M)
        rung = describe(server)["customizedMetadata"]["optimization"]["active"]
        assert len(ready_workers) == 3 and f"serving: rung {rung} in" in shown and rung in RACING, shown
        # Sized from minWorkers 1, each worker would run every core: their forwards share them instead
        intra_op = describe(server)["customizedMetadata"]["optimization"]["threads"]
        assert intra_op["per_forward"].startswith("shared with the other workers on these"), intra_op
        phase[0] = "down"
        manage(server, "scale", "minilm", "--min", "1", "--max", "1")
        deadline = time.monotonic() + 120
        while len(describe(server, customized=False)["workers"]) != 1:
            assert time.monotonic() < deadline, describe(server, customized=False)["workers"]
            time.sleep(0.5)
        phase[0] = "after"
        deadline = time.monotonic() + 60
        while sum(started == "after" for started, *_ in results) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    for step in ("up", "after"):
        step_results = [(status, answer) for started, _, status, answer in results if started == step]
        failed = [(status, answer) for status, answer in step_results if status != 200]
        assert step_results and not failed, (step, len(step_results), failed[:3])
    # Answered while the new workers loaded: a synchronous scale call holds a frontend thread that new inference
    # connections share, and the trickle (a connection per request) then waited out the whole load (6 in 10 s).
    answered_up = sum(started == "up" and status == 200 for started, _, status, _ in results)
    assert answered_up >= 10, answered_up
    dropped = [answer for started, _, status, answer in results if status != 200]
    assert all(a in ({"code": 500, "type": "InternalServerException", "message": "Worker died."},
                     "no answer in 30 s") for a in dropped), dropped
    print(f"{len(results)} requests while scaling 1 -> 3 -> 1; {len(dropped)} dropped by the scale-down")
    for _, index, status, answer in results:
        if status == 200:
            assert_close_embeddings(answer["embedding"], want[index])
    new = {w["id"] for w in workers} - first
    assert len(new) == 2
    log_text = log.read_text(errors="replace")[offset:]
    assert_loaded_from_the_cache(log_text, new)
    # The two new workers took turns: one loaded, the other waited for it, then loaded from what it kept
    waited = [w for w in new if re.search(rf"W-{w}-minilm_.* load: waited [\d.]+s for the loads of other workers on "
                                          r"these cores \(this model\)", log_text)]
    assert len(waited) == 1, [line for line in log_text.splitlines() if " load: " in line]
    # ... each beside the worker(s) already serving the trickle: on its share of the cores, leaving them the rest
    beside = [w for w in new if re.search(rf"W-{w}-minilm_.* load: \d+ other worker\(s\) serve on these \d+ cores: "
                                          r"this one loads on \d+ of them", log_text)]
    assert len(beside) == 2, [line for line in log_text.splitlines() if " load: " in line]


def assert_loaded_from_the_cache(log_text: str, worker_ids: set[str], model: str = "minilm") -> None:
    """Each worker proved its rung (its READY line) with FX graphs from the compile cache: hits, no misses, none
    bypassed (a frozen int8 graph included: ``handlers.rungs.prepacked_cache``). Where auto's bf16 screen races fp32
    eager (CPUs with bf16 instructions), a new worker follows the race the first one kept
    (``handlers.ladder.decisions``): one that raced while the others loaded beside it could pick the other precision,
    whose graph no worker compiled (workers on the same cores now load in turn, ``CoreShare.loading``, and still
    follow it)."""
    autos_bf16_is_raced = DType.BFLOAT16 in choice.resolve_precisions((DType.AUTO,), torch.device("cpu")).value
    for worker_id in worker_ids:
        lines = [line for line in log_text.splitlines() if f"W-{worker_id}-{model}_" in line]
        ready = [line for line in lines if re.search(rf"model {model} READY on rung ({'|'.join(RACING)}) ", line)]
        use = [line for line in lines if "compile cache " in line and "fx_graph" in line]
        assert ready and use, lines[-20:]
        frozen = [line for line in lines if "objects the load left kept out of full garbage collections" in line]
        assert frozen and int(re.search(rf"model {model}: (\d+) objects", frozen[-1])[1]) > 100_000, frozen
        fx_graph = re.search(r"fx_graph (\d+) hit / (\d+) missed / (\d+) bypassed", use[-1])
        assert int(fx_graph[2]) == 0 and int(fx_graph[3]) == 0, use[-1]
        # The race kept, a worker builds the rung that won (or both, where they share the shapes): a compile rung
        # from the compile cache's graphs, the openvino rung from the IR the first worker kept.
        built = {rung for rung in RACING if any(f"rung {rung} (" in line and " warmup " in line for line in lines)}
        assert built, lines[-20:]
        assert ("compile" in built) == (int(fx_graph[1]) > 0), (built, use[-1])
        if "openvino" in built:
            assert any("openvino: read from the cache" in line for line in lines), lines[-20:]
        # bf16's eager screen runs for the compile rung (the openvino rung's bf16 is its own)
        screens = [line for line in lines if "screen: bfloat16" in line]
        assert len(screens) == int(autos_bf16_is_raced and "compile" in built) and all(
            "remembered from an earlier load, which this worker follows" in line for line in screens), screens


def test_a_compile_that_fails_at_first_forward_still_serves_every_request(server, reference):
    status, body = server.management("POST", "/models?url=minilm-faulty.mar&initial_workers=1&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    optimization = describe(server, "minilm-faulty")["customizedMetadata"]["optimization"]
    attempts = {a["rung"]: a for a in optimization["attempts"]}
    assert attempts["compile"]["status"] == "failed"
    assert "injected failure" in attempts["compile"]["reason"]
    if probe_ipex()[0] is not None:  # the ipex profile: IPEX takes over from the failed compile
        assert attempts["ipex"]["status"] == "accepted" and optimization["active"] == "ipex"
        assert attempts["ipex"]["quality"]["value"] >= attempts["ipex"]["quality"]["threshold"]
    else:
        assert attempts["ipex"]["status"] == "skipped" and "intel_extension_for_pytorch" in attempts["ipex"]["reason"]
        assert optimization["active"] == "eager"
    want = reference(TEXTS[:4])
    for index, text in enumerate(TEXTS[:4]):
        status, answer = predict(server, {"text": text}, model="minilm-faulty")
        assert status == 200
        assert_close_embeddings(answer["embedding"], want[index])
    assert server.management("DELETE", "/models/minilm-faulty")[0] == 200


@pytest.mark.default_profile
def test_a_compile_with_wrong_outputs_is_refused_at_load_by_the_quality_gate(server, reference):
    status, body = server.management("POST", "/models?url=minilm-wrong.mar&initial_workers=1&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    optimization = describe(server, "minilm-wrong")["customizedMetadata"]["optimization"]
    compile_attempt = optimization["attempts"][0]
    assert (compile_attempt["rung"], compile_attempt["status"]) == ("compile", "failed")
    quality = compile_attempt["quality"]
    assert quality["metric"] == "min_cosine" and quality["value"] < quality["threshold"], quality
    assert optimization["active"] == "eager"
    want = reference(TEXTS[:4])
    for index, text in enumerate(TEXTS[:4]):
        status, answer = predict(server, {"text": text}, model="minilm-wrong")
        assert status == 200
        assert_close_embeddings(answer["embedding"], want[index])
    assert server.management("DELETE", "/models/minilm-wrong")[0] == 200


@pytest.mark.default_profile
def test_a_compiled_rung_that_breaks_after_ready_is_retried_eagerly_then_demoted(server, reference):
    """No client sees the failures: each failing batch is re-run eagerly, and after max_runtime_failures (2) the
    worker serves eager for good, visibly in describe and the log."""
    from tests.faulty_backends import BREAK_FILE

    status, body = server.management("POST", "/models?url=minilm-breaks.mar&initial_workers=1&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    assert describe(server, "minilm-breaks")["customizedMetadata"]["optimization"]["active"] == "compile"
    want = reference(TEXTS)
    assert predict(server, {"text": TEXTS[0]}, model="minilm-breaks")[0] == 200
    trigger = server.run_dir / "tmp" / BREAK_FILE
    trigger.touch()
    try:
        answers = [predict(server, {"text": text}, model="minilm-breaks") for text in TEXTS[:3]]
        answers += concurrently(server, [{"text": text} for text in TEXTS[3:]], model="minilm-breaks")
    finally:
        trigger.unlink()
    for index, (status, answer) in enumerate(answers):
        assert status == 200, answer
        assert_close_embeddings(answer["embedding"], want[index])
    optimization = describe(server, "minilm-breaks")["customizedMetadata"]["optimization"]
    runtime = optimization["runtime"]
    assert optimization["active"] == "eager" and runtime["demoted"] and runtime["runtime_failures"] == 2, runtime
    assert "injected failure: the compiled graph broke after READY" in runtime["last_failure"]
    log = (server.run_dir / "logs" / "model_log.log").read_text()
    assert "rung compile failed 2 live batches; demoting this worker to fp32 eager" in log
    assert server.management("DELETE", "/models/minilm-breaks")[0] == 200


def assert_same_classification(got: list[dict], want: list[dict], tolerance: float) -> None:
    """Scores per label within the gate's tolerance; the order of labels identical wherever fp32's own
    scores are further apart than the tolerance allows to swap (always, for an fp32 rung at 1e-4 here)."""
    ours, theirs = {r["label"]: r["score"] for r in got}, {r["label"]: r["score"] for r in want}
    assert ours.keys() == theirs.keys(), (got, want)
    assert all(abs(ours[label] - theirs[label]) <= tolerance for label in ours), (got, want)
    for rank in range(len(want) - 1):
        if want[rank]["score"] - want[rank + 1]["score"] > 2 * tolerance:
            assert got[rank]["label"] == want[rank]["label"], (got, want)


@pytest.mark.default_profile  # the task itself is proven compiled in both (tests/test_<task>.py)
@pytest.mark.torchao
def test_the_int8_archive_serves_int8_where_it_passes_and_pays(server, reference):
    """model_configs/minilm-embeddings-int8.yaml, compiled by inductor: on any CPU int8 is screened, compiled within
    the int8 gate, and raced against the compile in auto's precision; the faster serves. Its weights are 7-bit where
    the CPU has no int8 dot products, and describe says so. (Without torchao, the ipex profile, tests/test_int8.py
    checks the reason int8 is left out.)"""
    optimization = registered(server, "minilm-int8", metric="min_cosine")
    assert optimization["requested_compile"]["options"] == {"cpp_wrapper": True}  # its int8 graph's short kernels
    tried = optimization["precisions"]["tried_in_order"]
    assert tried[0] == "int8", optimization["precisions"]
    # judged on held-out texts too, then raced against the next precision auto picks
    assert optimization["int8_calibration"].startswith("calibrated on the warmup batches (")
    dot_products = any(features.cpu_features().get(name) for name in quantize.INT8_CPU_FEATURES)
    assert optimization["int8_weights"].startswith(
        "weights in [-128, 127]" if dot_products else "weights in [-64, 63]"), optimization["int8_weights"]
    screen = next(a for a in optimization["attempts"] if a["screen"] and a["dtype"] == "int8")
    assert "held_out" in screen["quality"], screen
    rival = auto_served(optimization, tried)  # bf16, or fp32 where bf16 is slower here
    if rival == "float32" and "bfloat16" in tried:  # int8's float layers follow bf16's screen
        assert "its float layers in float32" in screen["reason"], screen
    if screen["status"] == "failed":  # below the gate on the texts it was not calibrated on: auto's serves
        assert "on held-out batches (calibration never saw them" in screen["reason"], screen
        assert optimization["dtype"] == rival and "int8 failed the quality gate" in optimization["dtype_reason"]
    else:  # the faster serves
        served = assert_raced(optimization, rival)
        assert accepted_attempt(optimization)["quality"]["threshold"] == (0.99 if served == "int8" else 0.999)
    answers = concurrently(server, [{"inputs": TEXTS[:3]}, {"text": TEXTS[3]}, {"inputs": TEXTS[4:]}],
                           model="minilm-int8")
    assert all(status == 200 for status, _ in answers), answers
    got = [*answers[0][1]["embeddings"], answers[1][1]["embedding"], *answers[2][1]["embeddings"]]
    assert_close_embeddings(got, reference(TEXTS), min_cosine=0.99)
    assert_nothing_compiled_after_ready(server, "minilm-int8")
    # An added worker follows the first one's race and loads the graph it served from the compile cache, the
    # frozen int8 graph included (its prepacked weights keyed as torch keys frozen weights).
    first = {w["id"] for w in describe(server, "minilm-int8")["workers"]}
    log = server.run_dir / "logs" / "model_log.log"
    offset = log.stat().st_size
    status, body = server.management("PUT", "/models/minilm-int8?min_worker=2&max_worker=2&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    new = {w["id"] for w in describe(server, "minilm-int8")["workers"]} - first
    assert len(new) == 1, describe(server, "minilm-int8")["workers"]
    assert_loaded_from_the_cache(log.read_text(errors="replace")[offset:], new, model="minilm-int8")
    # Though the YAML says minWorkers 1, the two take requests in turn: a forward on more than one thread (a text
    # past the idle rule's 64 tokens) that followed the other worker's ends its OpenMP threads
    # (handlers.cpu.openmp_pause). (Requests in threes between two describes: a describe is a job for a worker too,
    # taken in turn with them.)
    long_text = " ".join(TEXTS * 3)
    said = ""
    for _ in range(8):
        for _ in range(3):
            status, answer = predict(server, {"text": long_text}, model="minilm-int8")
            assert status == 200, answer
        said = describe(server, "minilm-int8")["customizedMetadata"]["optimization"]["threads"]["openmp_after_forward"]
        if not said.startswith("threads ended after a forward on more than one that followed another worker's "
                               "on these cores (0 so far)"):
            break
    # (Or, where restarting the threads measured too costly at load, left to spin, and describe says what it cost.)
    assert re.match(r"threads ended after a forward on more than one that followed another worker's on these cores "
                    r"\([1-9]\d* so far\)|threads left to spin: restarting them after a pause cost a parallel region "
                    r"-?[\d.]+ ms at the 90th percentile here", said), said
    status, body = server.management("DELETE", "/models/minilm-int8")
    assert status == 200, body


@pytest.mark.default_profile  # the token-classification archive is served by the default profile only
def test_models_registered_at_once_load_one_after_the_other(server):
    """Two models registered at the same moment (as several models at server start): their workers take turns on
    the cores, so each measures its rungs on quiet cores, and the one that waited names the model it waited for.
    The later tests serve them."""
    models = ("minilm-sentiment", "minilm-ner")
    answers: dict[str, tuple[int, bytes]] = {}

    def register(model: str) -> None:
        answers[model] = server.management("POST", f"/models?url={model}.mar&initial_workers=1&synchronous=true",
                                           timeout=900)

    threads = [threading.Thread(target=register, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(status == 200 for status, _ in answers.values()), answers
    waits = {model: (meta["load_waited_s"], meta["load_waited_for"]) for model in models
             for meta in [describe(server, model)["customizedMetadata"]]}
    first, second = sorted(models, key=lambda model: waits[model][0])
    assert waits[first] == (0.0, []) and waits[second][0] > 0 and waits[second][1] == [first], waits
    log = (server.run_dir / "logs" / "model_log.log").read_text(errors="replace")
    assert re.search(rf"{second}_.* load: waited [\d.]+s for the loads of other workers on these cores \({first}\)",
                     log), waits


@pytest.mark.default_profile  # the task itself is proven compiled in both (tests/test_<task>.py)
def test_text_classification_compiled_equals_the_pipeline(server, task_model_dirs):
    import transformers

    from tests.test_classification import TEXTS as CLASSIFY

    optimization = registered(server, "minilm-sentiment")
    tolerance = 1e-4 if optimization["dtype"] == "float32" else 1e-2
    pipe = transformers.pipeline("text-classification", model=str(task_model_dirs["minilm-sentiment"]),
                                 device="cpu")
    bodies = [*({"text": text, "top_k": None} for text in CLASSIFY), {"inputs": CLASSIFY, "top_k": None},
              {"text": "hi", "top_k": "two"}]  # a bad neighbour in the same batches
    answers = concurrently(server, bodies, model="minilm-sentiment")
    for text, (status, answer) in zip(CLASSIFY, answers, strict=False):
        assert status == 200, answer
        assert_same_classification(answer, pipe(text, top_k=None), tolerance)
    status, many = answers[len(CLASSIFY)]
    assert status == 200 and len(many) == len(CLASSIFY)
    for got, want in zip(many, pipe(CLASSIFY, top_k=None), strict=True):
        assert_same_classification(got, want, tolerance)
    status, error = answers[-1]
    assert status == 400 and '"top_k" must be a positive integer or null' in error["message"]
    status, error = predict(server, {"text": "too long " * 600}, model="minilm-sentiment")
    assert status == 400 and '"text" is 1202 tokens long; this model reads at most 512' in error["message"]
    assert_nothing_compiled_after_ready(server, "minilm-sentiment")


def test_the_aot_archive_serves_its_package_without_compiling(server, reference):
    """model_configs/minilm-embeddings-aot.yaml: its AOTInductor packages were built and proven by packaging on this
    host, so the worker serves the one for auto's precision, compiling nothing; its answers are the model's."""
    status, body = server.management("POST", "/models?url=minilm-aot.mar&initial_workers=1&synchronous=true",
                                     timeout=900)
    assert status == 200, body
    try:
        optimization = describe(server, "minilm-aot")["customizedMetadata"]["optimization"]
        assert optimization["active"] == "aot", optimization["attempts"]
        assert optimization["attempts"][0]["rung"] == "aot" and optimization["attempts"][0]["status"] == "accepted"
        assert optimization["dtype"] == optimization["precisions"]["tried_in_order"][0]
        use = optimization["compile_cache"]["use_at_load"]
        assert all(counts["miss"] == 0 for counts in use.values()), use
        status, answer = predict(server, {"inputs": TEXTS}, model="minilm-aot")
        assert status == 200, answer
        assert_close_embeddings(answer["embeddings"], reference(TEXTS))
    finally:
        server.management("DELETE", "/models/minilm-aot")


def registered(server, model: str, metric: str = "score_agreement") -> dict:
    """``model``.mar registered with one worker (once per server: later tests reuse it); its optimization
    metadata, with one of the racing rungs active (openvino or compile: the faster here) and its gate's ``metric``
    passed."""
    if server.management("GET", f"/models/{model}")[0] != 200:
        status, body = server.management("POST", f"/models?url={model}.mar&initial_workers=1&synchronous=true",
                                         timeout=900)
        assert status == 200, body
    optimization = describe(server, model)["customizedMetadata"]["optimization"]
    assert optimization["active"] in RACING, optimization["attempts"]
    quality = accepted_attempt(optimization)["quality"]
    assert quality["metric"] == metric and quality["value"] >= quality["threshold"]
    return optimization


RACING = ("openvino", "compile")  # the shipped ladders' racing rungs: the faster one serves


def accepted_attempt(optimization: dict) -> dict:
    """The served rung's accepted attempt (the other racing rung's is accepted too where it serves small batches)."""
    accepted = [attempt for attempt in optimization["attempts"]
                if attempt["status"] == "accepted" and attempt["rung"] == optimization["active"]]
    assert len(accepted) == 1, optimization["attempts"]
    return accepted[0]


def assert_compiled_once_in_fp32_where_bf16_loses_the_answers(optimization: dict) -> None:
    """NER and QA with a random head: bf16 moves their probabilities past the gate's 1e-2. On a CPU where auto
    tries bf16 first, OpenVINO's bf16 (its own precision, not held to eager's screen) fails the gate, eager's screen
    fails, and compile runs once, in fp32; on others fp32 is all there is. The faster serves; the other lost the
    race (or was not built: an earlier load's race said so), or serves the small batches it is faster on."""
    # a rung not built (an earlier load's race said it would lose) has no precision: TorchServe drops null keys
    attempts = [(a["rung"], a.get("dtype"), a["status"]) for a in optimization["attempts"]]
    if "bfloat16" in optimization["precisions"]["tried_in_order"]:
        failed = [attempt for attempt in attempts if attempt[1] == "bfloat16"]
        compile_built = any(rung == "compile" and dtype for rung, dtype, _ in attempts)  # else a kept race said so
        assert (("eager", "bfloat16", "failed") in failed) == compile_built, attempts
        assert failed and all(status == "failed" for *_, status in failed), attempts
        assert set(failed) <= {("eager", "bfloat16", "failed"), ("openvino", "bfloat16", "failed")}, attempts
        attempts = [attempt for attempt in attempts if attempt not in failed]
    assert sorted(rung for rung, _, _ in attempts) == sorted(RACING), attempts
    assert {dtype for _, dtype, _ in attempts} - {None} == {"float32"}, attempts
    assert {rung: status for rung, _, status in attempts}[optimization["active"]] == "accepted", attempts


def assert_nothing_compiled_after_ready(server, model: str) -> None:
    runtime = describe(server, model)["customizedMetadata"]["optimization"]["runtime"]
    assert runtime["compiles_after_ready"] == 0 and runtime["runtime_failures"] == 0, runtime


@pytest.mark.default_profile  # the task itself is proven compiled in both (tests/test_<task>.py)
def test_token_classification_compiled_equals_the_pipeline(server, task_model_dirs):
    import transformers

    from tests.test_token_classification import TEXTS as NER_TEXTS
    from tests.test_token_classification import assert_same_entities

    optimization = registered(server, "minilm-ner")
    assert_compiled_once_in_fp32_where_bf16_loses_the_answers(optimization)
    tolerance = 1e-4 if optimization["dtype"] == "float32" else 1e-2
    pipe = transformers.pipeline("token-classification", model=str(task_model_dirs["minilm-ner"]), device="cpu")
    bodies = [{"text": text, "aggregation_strategy": strategy}
              for text in NER_TEXTS for strategy in ("none", "simple")]
    bodies.append({"text": "fine", "aggregation_strategy": "loud"})  # a bad neighbour in the same batches
    answers = concurrently(server, bodies, model="minilm-ner")
    for body, (status, answer) in zip(bodies[:-1], answers[:-1], strict=True):
        assert status == 200, answer
        want = pipe(body["text"], aggregation_strategy=body["aggregation_strategy"])
        assert_same_entities(answer, want, tolerance)
    status, error = answers[-1]
    assert status == 400 and '"aggregation_strategy" must be one of' in error["message"]
    status, error = predict(server, "Paris " * 600, content_type="text/plain", model="minilm-ner")
    assert status == 400 and "is 602 tokens long; this model reads at most 512" in error["message"]
    assert_nothing_compiled_after_ready(server, "minilm-ner")


@pytest.mark.default_profile  # the task itself is proven compiled in both (tests/test_<task>.py)
@pytest.mark.qa_reference
def test_question_answering_compiled_equals_the_pipeline(server, task_model_dirs):
    from tests import pipeline_reference
    from tests.test_question_answering import CALLS, assert_same_answer

    optimization = registered(server, "minilm-qa")
    assert_compiled_once_in_fp32_where_bf16_loses_the_answers(optimization)
    tolerance = 1e-4 if optimization["dtype"] == "float32" else 1e-2
    want = pipeline_reference.answers(task_model_dirs["minilm-qa"], CALLS)
    bodies = [*CALLS, {"question": "Who?"}]  # a bad neighbour in the same batches
    answers = concurrently(server, bodies, model="minilm-qa")
    for (status, answer), expected in zip(answers[:-1], want, strict=True):
        assert status == 200, answer
        assert_same_answer(answer, expected, tolerance)
    status, error = answers[-1]
    assert status == 400 and 'the request has no "context"' in error["message"]
    status, answers = predict(server, {"inputs": [{k: c[k] for k in ("question", "context")} for c in CALLS]},
                              model="minilm-qa")
    assert status == 200 and len(answers) == len(CALLS)
    assert_same_answer(answers[0], want[0], tolerance)
    assert_nothing_compiled_after_ready(server, "minilm-qa")


def stream(server, body: dict, model: str) -> tuple[int, dict[str, str], list]:
    """POST ``body`` and read the response line by line as it arrives: (status, headers, parsed lines)."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(server.inference_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        connection.request("POST", f"/predictions/{model}", json.dumps(body).encode(), {
            "Content-Type": "application/json", "Authorization": f"Bearer {server.key('inference')}"})
        response = connection.getresponse()
        lines = [json.loads(line) for line in iter(response.readline, b"") if line.strip()]
        return response.status, {k.lower(): v for k, v in response.getheaders()}, lines
    finally:
        connection.close()


@pytest.mark.default_profile  # the task itself is proven compiled in both (tests/test_<task>.py)
def test_text_generation_compiled_equals_generate_and_streams_over_chunked_http(server, task_model_dirs):
    import transformers

    from tests.test_generation import PROMPTS

    registered(server, "tiny-llama", metric="greedy_token_agreement")
    model_dir = task_model_dirs["tiny-llama"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    bodies = [{"text": prompt, "max_new_tokens": max_new, "details": True} for prompt, max_new in PROMPTS]
    bodies.append({"text": "fine", "temperature": "hot"})  # a bad neighbour in the same batches
    answers = concurrently(server, bodies, model="tiny-llama")
    for body, (status, answer) in zip(bodies[:-1], answers[:-1], strict=True):
        assert status == 200, answer
        inputs = tokenizer(body["text"], return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=body["max_new_tokens"], do_sample=False)
        assert answer[0]["details"]["token_ids"] == ids[0, inputs["input_ids"].shape[1]:].tolist()
        (want,) = pipe(body["text"], max_new_tokens=body["max_new_tokens"], do_sample=False)
        assert answer[0]["generated_text"] == want["generated_text"]
    status, error = answers[-1]
    assert status == 400 and '"temperature" must be a number in [0, inf]' in error["message"]

    body = {"text": PROMPTS[2][0], "max_new_tokens": 24, "stream": True, "details": True}
    status, headers, lines = stream(server, body, "tiny-llama")
    assert status == 200 and headers.get("transfer-encoding") == "chunked", headers
    *chunks, final = lines
    assert len(chunks) == 24 and all(set(chunk) == {"token_id", "text"} for chunk in chunks)
    status, plain = predict(server, {**body, "stream": False}, model="tiny-llama")
    assert status == 200 and final == plain  # the last line is the answer itself
    assert body["text"] + "".join(chunk["text"] for chunk in chunks) == plain[0]["generated_text"]
    assert [chunk["token_id"] for chunk in chunks] == plain[0]["details"]["token_ids"]
    seeded = {"text": "Once upon a time", "max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    first, again = concurrently(server, [seeded, seeded], model="tiny-llama")
    assert first[0] == again[0] == 200 and first[1] == again[1]  # a seed reproduces, batched or not
    status, error = predict(server, {"text": "word " * 300}, model="tiny-llama")
    assert status == 400 and "this model reads at most 256 tokens in all" in error["message"]
    assert_nothing_compiled_after_ready(server, "tiny-llama")


ARCHIVES = {"minilm": "min_cosine", "minilm-sentiment": "score_agreement", "minilm-ner": "score_agreement",
            "minilm-qa": "score_agreement", "tiny-llama": "greedy_token_agreement"}  # one per task, with its gate


@pytest.mark.default_profile
@pytest.mark.parametrize("model", ARCHIVES)
def test_every_kind_of_bad_request_fails_alone_and_the_worker_stays_up(server, model):
    """benchmarks/hostile_inputs.py's cases (>= 15 kinds, plus the task's own), sent at once with good requests so
    TorchServe batches them together: each bad one gets its 4xx and a JSON error naming the problem, each good
    one the answer it gets alone, the worker stays the same process, and the next good request is still right."""
    from benchmarks import hostile_inputs

    if model != "minilm":
        registered(server, model, metric=ARCHIVES[model])
    max_request_size = int(tsctl.read_properties(shifted_config_path(server))["max_request_size"])
    report = hostile_inputs.check(server, model, max_request_size)
    kinds = [outcome.case.kind for outcome in report["outcomes"]]
    print(f"{model} ({report['task']}): {len(kinds)} kinds of hostile request: {kinds}")
    assert not report["problems"], "\n".join(report["problems"])
    assert len(kinds) >= 17 and {o.status for o in report["outcomes"]} >= {400, 413, 200}


def grpc_client_for(server):
    from benchmarks import grpc_client

    return grpc_client.Client.for_server(shifted_config_path(server), server.run_dir)


@pytest.mark.default_profile
def test_grpc_predictions_equal_rest_for_every_body_shape(server):
    from benchmarks.hostile_inputs import close

    bodies = [TEXTS[0].encode(), json.dumps({"text": TEXTS[1]}).encode(), json.dumps({"inputs": TEXTS[:3]}).encode(),
              json.dumps(TEXTS[2:4]).encode(), json.dumps({"input": TEXTS[:2], "model": "minilm"}).encode()]
    client = grpc_client_for(server)
    try:
        for body in bodies:
            over_grpc = json.loads(client.predict("minilm", body))
            content_type = "application/json" if body.startswith((b"{", b"[")) else "text/plain"
            status, over_rest = predict(server, body, content_type)
            assert status == 200 and close(over_grpc, over_rest, 1e-5), (body, over_grpc, over_rest)
    finally:
        client.close()


@pytest.mark.default_profile
def test_grpc_refuses_a_missing_or_wrong_key_and_answers_with_the_right_one(server):
    """The token goes as gRPC metadata (``authorization: Bearer ...``); stubs come from TorchServe's own protos."""
    import grpc

    from benchmarks import grpc_client

    config = shifted_config_path(server)
    body = json.dumps({"text": TEXTS[0]}).encode()
    right = grpc_client.Client.for_server(config, server.run_dir)
    try:
        over_grpc = json.loads(right.predict("minilm", body))
        over_rest = torch.tensor(predict(server, body)[1]["embedding"])
        assert_close_embeddings(over_grpc["embedding"], over_rest, min_cosine=0.99999)
        assert right.describe("minilm")[0]["modelName"] == "minilm"
    finally:
        right.close()
    wrong_keys = {"none": lambda kind: None, "wrong": lambda kind: "x" * 8,
                  "other": lambda kind: server.key("management" if kind == "inference" else "inference")}
    for name, key in wrong_keys.items():
        client = grpc_client.Client.for_server(config, server.run_dir, key)
        try:
            for call, args in ((client.predict, ("minilm", body)), (client.describe, ("minilm",))):
                with pytest.raises(grpc.RpcError) as info:
                    call(*args)
                details = info.value.details()
                assert "Token Authorization failed" in details, (name, info.value.code(), details)
        finally:
            client.close()


@pytest.mark.default_profile
def test_grpc_management_registers_scales_describes_and_unregisters(server, reference):
    client = grpc_client_for(server)
    try:
        assert "registered" in client.register("minilm-wrong.mar", "over-grpc")
        assert "scaled to 2" in client.scale("over-grpc", 2, 2)
        (entry,) = client.describe("over-grpc")
        assert [w["status"] for w in entry["workers"]] == ["READY", "READY"]
        meta = entry["customizedMetadata"]
        meta = json.loads(meta) if isinstance(meta, str) else meta
        assert meta["optimization"]["active"] == "eager" and meta["optimization"]["attempts"][0]["status"] == "failed"
        answer = json.loads(client.predict("over-grpc", json.dumps({"text": TEXTS[0]}).encode()))
        assert_close_embeddings(answer["embedding"], reference(TEXTS[:1])[0])
        assert "unregistered" in client.unregister("over-grpc").lower()
        assert server.management("GET", "/models/over-grpc")[0] == 404
    finally:
        client.close()


@pytest.mark.default_profile
def test_grpc_streams_generated_tokens(server):
    registered(server, "tiny-llama", metric="greedy_token_agreement")
    body = {"text": "Once upon a time", "max_new_tokens": 12, "stream": True, "details": True}
    client = grpc_client_for(server)
    try:
        messages = [json.loads(line) for raw in client.stream_predict("tiny-llama", json.dumps(body).encode())
                    for line in raw.decode().splitlines() if line.strip()]
    finally:
        client.close()
    *chunks, final = messages
    status, plain = predict(server, {**body, "stream": False}, model="tiny-llama")
    assert status == 200 and final == plain
    assert len(chunks) == 12 and [c["token_id"] for c in chunks] == plain[0]["details"]["token_ids"]
    assert body["text"] + "".join(c["text"] for c in chunks) == plain[0]["generated_text"]


def infer_v2(server, model: str, body: dict, key: str | None = "inference") -> tuple[int, dict]:
    """POST /v2/models/MODEL/infer, as a KServe (Open Inference Protocol) client sends it."""
    status, raw = server.call("POST", f"{server.inference_url}/v2/models/{model}/infer", key, json.dumps(body).encode(),
                              "application/json")
    return status, json.loads(raw)


def assert_same_entities(got: list[list[dict]], want: list[list[dict]]) -> None:
    """The same entities, words and spans; scores equal to float32's last digits. A forward after idle cores runs on
    one thread (handlers/cpu/idle_cores.py), the next on two: a float32 rung's sums then end ~1e-6 apart."""
    def without_scores(rows: list[list[dict]]) -> list[list[dict]]:
        return [[{**entity, "score": None} for entity in row] for row in rows]

    def scores(rows: list[list[dict]]) -> list[float]:
        return [entity["score"] for row in rows for entity in row]

    assert without_scores(got) == without_scores(want)
    assert scores(got) == pytest.approx(scores(want), rel=1e-5)


def kserve_request(request_id: str, parameters: dict | None = None, **inputs: list[str]) -> dict:
    """A v2 request as KServe's InferRequest.to_rest() writes one: BYTES tensors with a content_type."""
    body: dict = {"id": request_id, "inputs": [
        {"name": name, "shape": [len(texts)], "datatype": "BYTES", "data": texts, "parameters": {"content_type": "str"}}
        for name, texts in inputs.items()]}
    if parameters:
        body["parameters"] = parameters
    return body


def test_open_inference_requests_are_batched_with_native_ones_and_answered_in_kind(server, reference):
    bodies = [kserve_request(f"r{i}", text=TEXTS[i:i + 2]) if i % 2 else {"inputs": TEXTS[i:i + 2]} for i in range(4)]
    bad = kserve_request("bad", text=[])
    bad["inputs"][0]["shape"] = [2]
    answers = concurrently(server, [*bodies, bad])
    for index, (status, answer) in enumerate(answers[:4]):
        assert status == 200, answer
        if index % 2:
            assert answer["id"] == f"r{index}" and answer["model_name"] == "minilm"
            (tensor,) = answer["outputs"]
            assert tensor["shape"] == [2, 384] and tensor["datatype"] == "FP32"
            vectors = torch.tensor(tensor["data"]).reshape(2, 384)
        else:
            vectors = answer["embeddings"]
        assert_close_embeddings(vectors, reference(TEXTS[index:index + 2]))
    assert answers[4] == (400, {"error": 'input "text" has shape [2] (2 elements) but 0 in "data"', "code": 400,
                                "type": "InvalidInput"})
    status, answer = infer_v2(server, "minilm", bodies[1])  # alone now: the same answer but for bf16's last bits
    assert status == 200 and {**answer, "outputs": None} == {**answers[1][1], "outputs": None}
    (alone,), (batched,) = answer["outputs"], answers[1][1]["outputs"]
    assert {**alone, "data": None} == {**batched, "data": None}
    assert_close_embeddings(torch.tensor(alone["data"]).reshape(2, 384).tolist(),
                            torch.tensor(batched["data"]).reshape(2, 384), min_cosine=0.9999)
    assert infer_v2(server, "minilm", bodies[1], key=None)[0] == 400  # TorchServe's token check, before any v2
    status, raw = server.call("GET", f"{server.inference_url}/v2/health/ready", "inference")
    assert (status, json.loads(raw)) == (200, {"ready": True})


@pytest.mark.default_profile  # gRPC and the four other tasks are served by the default profile only
def test_open_inference_over_rest_and_grpc_for_every_task(server):
    cases = {
        "minilm-sentiment": kserve_request("s", {"top_k": 2}, text=TEXTS[:3]),
        "minilm-ner": kserve_request("n", text=["Ada Lovelace met Charles Babbage in London."]),
        "minilm-qa": kserve_request("q", question=["Where did they meet?"],
                                    context=["Ada Lovelace met Charles Babbage in London."]),
        "tiny-llama": kserve_request("g", {"max_new_tokens": 6}, prompt=["Once upon a time"]),
    }
    native = {
        "minilm-sentiment": {"inputs": TEXTS[:3], "top_k": 2},
        "minilm-ner": {"inputs": ["Ada Lovelace met Charles Babbage in London."]},
        "minilm-qa": {"inputs": [{"question": "Where did they meet?",
                                  "context": "Ada Lovelace met Charles Babbage in London."}]},
        "tiny-llama": {"text": "Once upon a time", "max_new_tokens": 6},
    }
    client = grpc_client_for(server)
    try:
        for model, body in cases.items():
            registered(server, model, "greedy_token_agreement" if model == "tiny-llama" else "score_agreement")
            status, answer = infer_v2(server, model, body)
            assert status == 200 and answer["id"] == body["id"], answer
            outputs = {tensor["name"]: tensor for tensor in answer["outputs"]}
            status, want = predict(server, native[model], model=model)
            assert status == 200, want
            if model == "minilm-sentiment":
                assert outputs["label"]["shape"] == [3, 2]
                assert outputs["label"]["data"] == [row["label"] for ranked in want for row in ranked]
            elif model == "minilm-ner":
                assert_same_entities([json.loads(row) for row in outputs["entities"]["data"]], want)
            elif model == "minilm-qa":
                assert outputs["answer"]["data"] == [want[0]["answer"]] and outputs["start"]["datatype"] == "INT64"
            else:
                assert outputs["generated_text"]["data"] == [want[0]["generated_text"]]
            # The same request over TorchServe's gRPC ModelInfer (ts_open_inference_protocol=true).
            texts = {tensor["name"]: tensor["data"] for tensor in body["inputs"]}
            if "parameters" not in body:  # TorchServe's gRPC bridge passes no request parameters on
                over_grpc = client.model_infer(model, texts, request_id=body["id"])
                for name, tensor in outputs.items():
                    got = over_grpc[name]["data"]
                    assert over_grpc[name]["shape"] == tensor["shape"], (model, name)
                    if name == "entities":  # JSON rows with scores in them
                        assert_same_entities([json.loads(row) for row in got],
                                             [json.loads(row) for row in tensor["data"]])
                    else:
                        assert got == pytest.approx(tensor["data"], rel=1e-5) if tensor["datatype"] == "FP32" \
                            else got == tensor["data"], (model, name, got, tensor["data"])
        over_grpc = client.model_infer("minilm", {"text": TEXTS[:2]}, request_id="e")
        status, over_rest = infer_v2(server, "minilm", kserve_request("e", text=TEXTS[:2]))
        assert over_grpc["embedding"]["shape"] == [2, 384]
        assert over_grpc["embedding"]["data"] == pytest.approx(over_rest["outputs"][0]["data"], abs=1e-5)
    finally:
        client.close()


def scrape(server) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The Prometheus text on the metrics port, as {metric: [(labels, value)]}."""
    status, raw = server.call("GET", f"{server.metrics_url}/metrics", None)
    assert status == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in raw.decode().splitlines():
        match = re.match(r"^(\w+)\{(.*)\}\s+(\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            samples.setdefault(match[1], []).append((labels, float(match[3])))
    return samples


@pytest.mark.default_profile
def test_prometheus_metrics_show_the_ladder_and_each_batch(server):
    """model_configs/metrics.yaml declares pt2-handlers' metrics; TorchServe exposes them in Prometheus mode."""
    for text in TEXTS[:3]:
        assert predict(server, {"text": text})[0] == 200
    metrics = scrape(server)

    def of(name: str, model: str = "minilm") -> list[tuple[dict[str, str], float]]:
        return [(labels, value) for labels, value in metrics.get(name, []) if labels.get("ModelName") == model]

    pids = {str(w["pid"]) for w in describe(server)["workers"]}
    optimization = describe(server)["customizedMetadata"]["optimization"]
    rung, served = optimization["active"], optimization["dtype"]
    assert rung in ("openvino", "compile"), rung  # they race at load; the faster serves
    active = {labels["WorkerPid"]: (labels["Rung"], labels["Precision"]) for labels, value in of("Pt2ActiveRung")
              if value == 1}
    assert pids <= active.keys() and {active[pid] for pid in pids} == {(rung, served)}, (pids, active)
    assert any(labels["Rung"] == rung and labels["Precision"] == served and labels["Status"] == "accepted"
               and value >= 1 for labels, value in of("Pt2RungAttempts"))
    assert any(labels["Rung"] == rung and value >= 0 for labels, value in of("Pt2RungSeconds"))
    raced = {labels["Rung"]: labels["Status"] for labels, value in of("Pt2RungForwardMilliseconds")
             if value > 0 and labels["Rung"] in RACING}
    other = ({"openvino", "compile"} - {rung}).pop()  # lost the race, or serves the shapes it was faster at
    assert raced[rung] == "accepted" and raced.get(other) in ("slower", "accepted"), raced
    gates = {(labels["Rung"], labels["Precision"], labels["Status"]): value for labels, value in of("Pt2RungGateValue")}
    assert gates[(rung, served, "accepted")] >= 0.999, gates
    assert all(value > 0 for _, value in of("Pt2LoadSeconds")) and of("Pt2LoadSeconds")
    stages = {labels["Stage"]: value for labels, value in of("Pt2StageMilliseconds")}
    assert stages.keys() == {"parse", "preprocess", "cores", "forward", "postprocess"} and stages["forward"] > 0, stages
    assert [value for _, value in of("Pt2BatchRequests")][0] >= 1
    assert [value for _, value in of("Pt2ForwardThreads")][0] >= 1
    assert 0 <= [value for _, value in of("Pt2PaddingPercent")][0] < 100
    # one series per rung that serves: two where the race kept both, each shape on the faster (openvino, compile)
    for counter in ("Pt2RuntimeFallbacks", "Pt2CompilesAfterReady", "Pt2EagerBatches", "Pt2FramesGivenUp"):
        values = [value for _, value in of(counter)]
        assert values and set(values) == {0.0}, (counter, of(counter))
    demoted = of("Pt2RuntimeFallbacks", "minilm-breaks")  # present when the demotion test ran before this one
    if demoted:
        assert sum(value for _, value in demoted) == 2 and any(
            labels["Rung"] == "eager" and value == 1 for labels, value in of("Pt2ActiveRung", "minilm-breaks"))
    keys = [server.key(kind) for kind in ("inference", "management")]
    assert not any(key in json.dumps(metrics) for key in keys)


def test_unregister(server):
    status, body = server.management("DELETE", "/models/minilm", timeout=120)
    assert status == 200, body
    assert server.management("GET", "/models/minilm")[0] == 404
    assert predict(server, {"text": "hello"})[0] == 404
