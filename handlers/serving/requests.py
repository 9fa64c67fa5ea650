"""A batch's requests before and after the forward: each body read on its own (an Open Inference body mapped to the
task's own), the parsed ones collated, each answer put in the protocol its request came in. A failure is its
request's alone: it becomes that request's answer, and its neighbours are answered.

Pure Python; no TorchServe import.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any

from handlers.errors import HandlerError, InferenceError, native_panic
from handlers.ladder import summarize
from handlers.tasks import Task, open_inference

logger = logging.getLogger(__name__)

V2Pending = dict[int, tuple[open_inference.InferRequest, Any] | None]  # body index -> request, task body


class Requests:
    """The request path around one task's forward, for the model ``model_name`` (``model_version``)."""

    def __init__(self, task: Task, model_name: str, model_version: str | None):
        self.task = task
        self.model_name = model_name
        self.model_version = model_version
        self._pool: ThreadPoolExecutor | None = None  # reads a batch's bodies where the task parses on threads

    def parse(self, bodies: Sequence[Any], answers: list[Any], v2: V2Pending) -> dict[int, Any]:
        """Each body read on its own (body index -> request); a failure becomes that body's answer. v2 bodies are
        noted in ``v2`` (None where the v2 body itself is invalid). A task whose parsing is heavy and lets go of the
        GIL (``Task.parse_threads``: images, decoded and resized by PIL) reads a batch's bodies on that many threads."""
        parsed: dict[int, Any] = {}
        threads = min(self.task.parse_threads(), len(bodies))
        if threads > 1:
            if self._pool is None:  # made once: a batch would otherwise start its threads anew
                self._pool = ThreadPoolExecutor(max_workers=self.task.parse_threads(), thread_name_prefix="parse")
            read = list(self._pool.map(lambda item: self._read(*item, v2), enumerate(bodies)))
        else:
            read = [self._read(index, body, v2) for index, body in enumerate(bodies)]
        for index, (request, error) in enumerate(read):
            if error is None:
                parsed[index] = request
            else:
                answers[index] = error
        return parsed

    def _read(self, index: int, body: Any, v2: V2Pending) -> tuple[Any, Any]:
        """One body: (its request, None), or (None, the error it is answered with)."""
        try:
            body = self.task.decode(body)
            if open_inference.is_request(body):
                v2[index] = None
                request = open_inference.parse_request(body, numeric=self.task.reads_tensors)
                body = self.task.from_open_inference(request)
                v2[index] = (request, body)
            return self.task.parse(body), None
        except HandlerError as exc:
            return None, exc
        except BaseException as exc:  # a bug reading one request must not fail its neighbours
            if not isinstance(exc, Exception) and not native_panic(exc):
                raise
            return None, failed(exc, "parse")

    def preprocess(self, parsed: dict[int, Any], answers: list[Any]) -> Any:
        """The parsed requests collated into one batch. If collating fails, each request is tried alone: the ones
        that fail get their own error (and leave ``parsed``), the rest are collated without them."""
        if not parsed:
            return None
        try:
            return self.task.preprocess(list(parsed.values()))
        except BaseException as exc:  # noqa: BLE001 - isolated below, request by request
            if not isinstance(exc, Exception) and not native_panic(exc):
                raise
            logger.warning("preprocess failed on a batch of %d requests; retrying each alone", len(parsed))
        for index, request in list(parsed.items()):
            try:
                self.task.preprocess([request])
            except BaseException as exc:  # noqa: BLE001
                if not isinstance(exc, Exception) and not native_panic(exc):
                    raise
                answers[index] = exc if isinstance(exc, HandlerError) else failed(exc, "preprocess")
                del parsed[index]
        return self.task.preprocess(list(parsed.values())) if parsed else None

    def in_protocol(self, answers: list[Any], v2: V2Pending) -> None:
        """Each v2 request's answer as the protocol's response, or its error as ``{"error": ...}``."""
        for index, pending in v2.items():
            answer = answers[index]
            if pending is not None and not isinstance(answer, HandlerError):
                request, body = pending
                try:
                    answer = open_inference.response(request, self.task.to_open_inference(answer, body),
                                                     self.model_name, self.model_version)
                except HandlerError as exc:
                    answer = exc
                except Exception as exc:  # a bug formatting one answer must not fail its neighbours
                    answer = failed(exc, "format")
            answers[index] = open_inference.OpenInferenceError(answer) if isinstance(answer, HandlerError) else answer


def failed(exc: BaseException, stage: str) -> InferenceError:
    """A request's own failure at ``stage``, logged in full and told to its client in a line."""
    logger.error("%s failed on one request: %s", stage, summarize(exc), exc_info=exc)
    return InferenceError(f"the server failed to {stage} this request ({type(exc).__name__}); it is logged")
