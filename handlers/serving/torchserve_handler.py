"""TorchServe adapter: the only module that imports ``ts``.

Package it as the archive's handler file (``--handler handlers/serving/torchserve_handler.py``) with the
``handlers`` package beside it; TorchServe then finds ``Pt2Handler``, the one class defined here.
Everything below is translation: TorchServe context -> Engine, Engine answers/errors -> responses.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import sys
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

import orjson
import torch
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.utils.util import PredictionException

from handlers.config import load_config
from handlers.errors import ConfigError, HandlerError, InvalidInput, PathNotFound
from handlers.models.files import ModelFiles
from handlers.rungs import compile_cache
from handlers.serving import server_timing
from handlers.serving.batch_gauges import GaugeWindow
from handlers.serving.engine import Engine

logger = logging.getLogger(__name__)

JSON = "application/json"
JSON_LINES = "application/jsonl"  # a streamed answer: one JSON object per line, the last one the answer itself
TS_IPEX_SWITCH = "TS_IPEX_ENABLE"
OPENVINO_DYNAMO_MODULES = ("openvino", "openvino.torch")  # base_handler imports these for its dynamo backend
# TorchServe 0.12 passes the path after /predictions/<model>/<version>/ in this header ("" where there is none)
URL_PATH = "url_path"


def _base_handler_class() -> type:
    """TorchServe's ``BaseHandler``, imported so that ``TS_IPEX_ENABLE=true`` cannot take the worker down, and
    without OpenVINO's dynamo backend.

    With the switch on, base_handler imports IPEX at import time and catches only ImportError; a mismatched
    IPEX (2.8 on torch 2.13 raises AttributeError) kills every worker before any handler code runs. The
    switch only serves the stock ``initialize``, which Pt2Handler replaces: the ladder's ipex rung probes
    IPEX itself and records why it cannot run. So base_handler is imported with the switch hidden, and the
    environment is restored at once.

    base_handler also imports ``openvino.torch`` where openvino is installed, which imports dynamo at once: before
    the compile cache is checked (``handlers.rungs.compile_cache``), where an unusable cache directory kills the
    worker. pt2-handlers serves OpenVINO with its own rung (``pt2.compile.backend: openvino`` included), so that
    import is made to fail as if openvino were absent (base_handler logs "OpenVINO is not enabled").
    """
    switch = os.environ.pop(TS_IPEX_SWITCH, None)
    hidden = [name for name in OPENVINO_DYNAMO_MODULES if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))  # None: an import of it raises ImportError
    try:
        return importlib.import_module("ts.torch_handler.base_handler").BaseHandler
    finally:
        for name in hidden:
            sys.modules.pop(name, None)
        if switch is not None:
            os.environ[TS_IPEX_SWITCH] = switch
            logger.info("%s=%s: IPEX is tried by the pt2-handlers ladder (the ipex rung), not by TorchServe's "
                        "base handler", TS_IPEX_SWITCH, switch)


BaseHandler = _base_handler_class()


class Pt2Handler(BaseHandler):
    """Compile at load through the verified ladder; serve the configured task."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None

    def initialize(self, context: Any) -> None:
        properties = context.system_properties
        # Before the config is validated: validating imports torch._dynamo, which dies on an unusable cache dir.
        cache = compile_cache.prepare(compile_cache.configured_dir(context.model_yaml_config))
        try:
            config = load_config(context.model_yaml_config)
        except ConfigError as exc:  # the same line Engine.load writes, so tools watching the log find either
            for problem in exc.problems:  # a line each: log lines are read (and grepped) one at a time
                logger.error("model %s failed to load: invalid model YAML: %s", context.model_name, problem)
            raise
        self.device = _device(properties.get("gpu_id"))
        model = (getattr(context, "manifest", None) or {}).get("model", {})
        # torch-model-archiver's --model-file and --serialized-file, at the archive's root (none: save_pretrained)
        files = ModelFiles(model.get("modelFile") or None, model.get("serializedFile") or None)
        self.engine = Engine(config, Path(properties["model_dir"]), self.device, context.model_name, cache,
                             model.get("modelVersion"), files)
        self.engine.load()
        frozen = _freeze_what_the_load_left()
        logger.info("model %s: %d objects the load left kept out of full garbage collections", context.model_name,
                    frozen)
        self.context = context
        self._batch_gauges = GaugeWindow(config.settings.batch_metrics_every_s)
        pid = str(os.getpid())
        for attempt in self.engine.attempts:  # each rung x precision tried, the screens included
            tried = {"Rung": attempt.rung, "Precision": attempt.dtype or "none", "Status": attempt.status.value}
            self._counter("Pt2RungAttempts", 1, **tried)
            self._gauge("Pt2RungSeconds", attempt.seconds, "s", **tried, WorkerPid=pid)
            if attempt.quality is not None:
                self._gauge("Pt2RungGateValue", attempt.quality.value, "ratio", **tried, WorkerPid=pid)
            if attempt.forward_ms is not None:  # raced: which rung or precision was faster, and by how much
                self._gauge("Pt2RungForwardMilliseconds", attempt.forward_ms, "ms", **tried, WorkerPid=pid)
        self._gauge("Pt2LoadSeconds", self.engine.load_seconds or 0.0, "s", WorkerPid=pid)
        self._gauge("Pt2ActiveRung", 1, "count", Rung=self.engine.active_rung or "none",
                    Precision=self.engine.dtype.value.value, WorkerPid=pid)
        # Counters start at 0, so a scrape shows them (and rate() works) before the first event.
        self._counter("Pt2RuntimeFallbacks", 0, Rung=self.engine.active_rung or "none")
        self._counter("Pt2CompilesAfterReady", 0)
        self._counter("Pt2EagerBatches", 0)
        self._counter("Pt2FramesGivenUp", 0)
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str | bytes]:
        if context.get_request_header(0, "describe") == "True":
            return [json.dumps(self.describe_handle())]
        if self.engine is None:
            raise PredictionException(json.dumps({"code": 503, "message": "model is not loaded"}), 503)
        started = time.perf_counter()
        before = self.engine.runtime_counters()
        answers: dict[int, Any] = {}
        bodies: dict[int, Any] = {}
        for index, row in enumerate(data):
            try:
                _check_path(context.get_request_header(index, URL_PATH), self.engine.paths, context.model_name,
                            self.engine.model_version)
                bodies[index] = _body(row)
            except (InvalidInput, PathNotFound) as exc:
                answers[index] = exc
        rows = list(bodies)  # body index -> TorchServe's row index
        streamed: set[int] = set()

        def emit(chunks: dict[int, Any]) -> None:
            """Send each chunk now, as a chunk of its request's HTTP response (gRPC: a stream message)."""
            lines = {rows[index]: _json(chunk) + b"\n" for index, chunk in chunks.items()}
            for row in lines:
                context.set_response_content_type(row, JSON_LINES)
            streamed.update(lines)
            send_intermediate_predict_response(lines, {row: context.request_ids[row] for row in lines},
                                               "Intermediate prediction", 200, context)

        try:
            if bodies:
                answers.update(zip(bodies, self.engine.predict(list(bodies.values()), emit), strict=True))
        except HandlerError as exc:
            logger.error("batch failed: %s", exc.message, exc_info=exc.__cause__ is not None)
            raise PredictionException(json.dumps(exc.to_json()), exc.status) from exc
        self._batch_metrics(before)
        # The last batch's stages are this one's only where it reached the engine.
        timing = server_timing.header(self.engine.last_batch.milliseconds if bodies else {},
                                      (time.perf_counter() - started) * 1000, len(bodies))
        return [_respond(context, index, answers[index], timing, index in streamed) for index in range(len(data))]

    def _batch_metrics(self, before: dict[str, Any]) -> None:
        engine = self.engine
        after = engine.runtime_counters()
        if after["runtime_failures"] > before["runtime_failures"]:
            self._counter("Pt2RuntimeFallbacks", after["runtime_failures"] - before["runtime_failures"],
                            Rung=before["active"])
        for counter, name in (("compiles_after_ready", "Pt2CompilesAfterReady"), ("eager_batches", "Pt2EagerBatches"),
                              ("frames_given_up", "Pt2FramesGivenUp")):
            if after[counter] > before[counter]:
                self._counter(name, after[counter] - before[counter])
        if after["active"] != before["active"]:  # demoted: this worker now serves fp32 eager
            pid = str(os.getpid())
            self._gauge("Pt2ActiveRung", 0, "count", Rung=before["active"], Precision=engine.dtype.value.value,
                        WorkerPid=pid)
            self._gauge("Pt2ActiveRung", 1, "count", Rung=after["active"], Precision="float32", WorkerPid=pid)
        batch = engine.last_batch
        values = {("Pt2StageMilliseconds", "ms", stage): milliseconds for stage, milliseconds in
                  batch.milliseconds.items()}
        values[("Pt2BatchRequests", "count", None)] = batch.requests
        values[("Pt2ForwardThreads", "count", None)] = batch.threads
        values[("Pt2PaddingPercent", "percent", None)] = 100 * batch.padding_ratio
        for (name, unit, stage), value in (self._batch_gauges.add(values) or {}).items():
            self._gauge(name, round(value, 3), unit, **({"Stage": stage} if stage else {}))

    def _counter(self, name: str, value: float, **dimensions: str) -> None:
        _emit(self.context, name, value, "count", MetricTypes.COUNTER, **dimensions)

    def _gauge(self, name: str, value: float, unit: str, **dimensions: str) -> None:
        _emit(self.context, name, value, unit, MetricTypes.GAUGE, **dimensions)

    def describe_handle(self) -> dict[str, Any]:
        return self.engine.describe() if self.engine else {"state": "not initialized"}


def _freeze_what_the_load_left() -> int:
    """The worker process is the model's once it is READY: the objects its load left (model, tokenizer, compiled
    graphs; ~550k for MiniLM) move out of the garbage collector's reach. A full collection over them stalled a 2-core
    worker for ~260 ms, during which no batch is served; after this it scans only what serving allocates."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _device(gpu_id: int | None) -> torch.device:
    if gpu_id is not None and torch.cuda.is_available():
        return torch.device(f"cuda:{gpu_id}")
    return torch.device("cpu")


def _check_path(path: str | None, answered: tuple[str, ...], model: str, version: str | None) -> None:
    """/predictions/<model>/<version>/<path> is served only where the task answers that path (OpenAI clients
    append theirs to a base URL); anywhere else the request fails alone, instead of being answered as if sent to the
    model's own URL."""
    if not path or path.strip("/") in answered:
        return
    url = f"/predictions/{model}"
    where = " or ".join([f"{url}[/<version>]", *(f"{url}/{version or '<version>'}/{known}" for known in answered)])
    raise PathNotFound(f"this model serves nothing at {path[:200]!r} after its version; send to {where}")


def _body(row: dict[str, Any]) -> Any:
    # TorchServe names a raw body "body" and a form field "data". A form-encoded body (curl -d without
    # a Content-Type) arrives as fields named after the text, or as nothing at all.
    if "datatype" in row and "shape" in row:  # one tensor, unwrapped by TorchServe's v2 envelope
        raise InvalidInput("this request was unwrapped by TorchServe's service_envelope=kservev2, which reads only "
                           "the first request of a batch and the first string of each input; remove "
                           "service_envelope: pt2-handlers reads Open Inference (KServe v2) bodies itself")
    for name in ("body", "data"):
        if name in row:
            return row[name]
    raise InvalidInput(
        "no request body found; form-encoded bodies are not supported: send the text with "
        "Content-Type: text/plain, or JSON with Content-Type: application/json"
    )


def _respond(context: Any, index: int, answer: Any, timing: str, streamed: bool = False) -> bytes:
    """The answer (or error) as JSON, with its batch's Server-Timing; a streamed request's last line (its headers
    went out with its first chunk, before any timing was known)."""
    context.set_response_content_type(index, JSON_LINES if streamed else JSON)
    if not streamed:
        context.set_response_header(index, server_timing.NAME, timing)
    if isinstance(answer, HandlerError):
        # The reason phrase is the standard one: the message (which may echo client input) stays in the body.
        context.set_response_status(answer.status, HTTPStatus(answer.status).phrase, index)
        return _json(answer.to_json())
    return _json(answer)


def _json(value: Any) -> bytes:
    """An answer as compact JSON. orjson, because json.dumps spent 1.2 ms of the worker's time per batch of eight
    384-float embeddings (orjson: 0.09 ms); TorchServe sends bytes on as they are."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)  # int keys as json.dumps writes them


def _emit(context: Any, name: str, value: float, unit: str, kind: Any, **dimensions: str) -> None:
    """One of pt2-handlers' metrics through TorchServe's metrics API. model_configs/metrics.yaml declares each with
    its dimensions in this order: ours, then ModelName and Level. (A function, not a class: TorchServe requires
    the handler file to define exactly one class.) Emitting never breaks serving: a metrics configuration that
    rejects a metric only logs."""
    try:
        dims = [Dimension(key, val) for key, val in dimensions.items()]
        dims += [Dimension("ModelName", context.model_name), Dimension("Level", "Model")]
        context.metrics.add_metric(name, value, unit, None, dims, kind)
    except Exception:  # noqa: BLE001
        logger.warning("could not emit metric %s", name, exc_info=True)
